"""``rlboost export RUN_ID DIR [--version N] [--merged]``: a run's weights as an HF directory.

Contract: DIR ends up holding one weight version of the run exactly as the trainer published
it (``config.json``, ``model.safetensors``, ``generation_config.json`` and the tokenizer files of
the base model), so ``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads it. The
files come through the weight service (RLBOOST_WEIGHTS_URL, with RLBOOST_WEIGHTS_READ_TOKEN, or
the write token), every chunk checked against the service's sha256 manifest, into a hidden
directory beside DIR that is renamed to DIR at the end: DIR appears whole or not at all, and an
existing non-empty DIR is never touched. Without ``--version``, the newest version the service
holds: the final one of a finished run, the last trained one of a cancelled or failed run.
``GET /v1/runs/{id}/checkpoints`` lists the versions the run keeps (``save_every``).

A LoRA run's version carries its adapter beside the merged model (:mod:`trainer_svc.learn.lora`).
Its export is the adapter as PEFT writes it (``adapter_model.safetensors``,
``adapter_config.json``) with the base's tokenizer and generation files, loadable with
``peft.PeftModel.from_pretrained(<the run's base model>, DIR)``; with ``merged`` it is the merged
model instead, as for a full fine-tuning run (whose export ``merged`` does not change).
A LoRA run's versions after its base are adapter-only (docs/weights.md "LoRA versions"): the
pull brings the base too; the adapter's export takes the base's tokenizer and generation
files, the merged one is the base with the adapter merged as the trainer merges it
(:mod:`shared.weights.adapter`, bit for bit).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from shared.errors import WeightsError
from shared.tls import Tls
from shared.weights import MANIFEST_NAME, PullStats, list_versions, pull_version
from shared.weights.manifest import ADAPTER_BASE_NAME, ADAPTER_FILES, ADAPTER_SUFFIX

# What makes a directory loadable; the rest (tokenizer files) travels when the base has it.
REQUIRED = ("config.json",)


class ExportError(Exception):
    """The export cannot be done as asked; the message says why (the CLI exits 1)."""


@dataclass(frozen=True, slots=True)
class Exported:
    run_id: str
    version: int
    path: Path
    files: list[str]
    adapter: bool = False  # the files are a LoRA adapter, not a whole model


def _choose(run_id: str, versions: list[int], asked: int | None) -> int:
    if not versions:
        raise ExportError(f"the weight service holds no version of run {run_id}")
    if asked is None:
        return versions[-1]
    if asked not in versions:
        raise ExportError(f"version {asked} of run {run_id} is not in the weight service; it "
                          f"holds {versions} (GET /v1/runs/{run_id}/checkpoints lists the kept "
                          "ones)")
    return asked


def _over_base(pulled: Path, base_dir: Path, merged: bool) -> None:
    """Make an adapter-only version's directory an export: the base's other files beside the
    adapter, or (``merged``) the merged model in the adapter's place."""
    from safetensors.torch import save_file

    from shared.weights.adapter import merge_adapter, read_base

    (pulled / ADAPTER_BASE_NAME).unlink(missing_ok=True)
    if merged:
        state = merge_adapter(read_base(base_dir), pulled)
        for name in ADAPTER_FILES:
            (pulled / name).unlink()
        save_file(state, pulled / "model.safetensors", metadata={"format": "pt"})
    for path in base_dir.iterdir():
        skip = path.name == MANIFEST_NAME or path.name.endswith(ADAPTER_SUFFIX) or \
            path.name.endswith((".safetensors", ".safetensors.index.json")) or \
            (path.name == "config.json" and not merged)
        if not skip and path.is_file():
            shutil.copyfile(path, pulled / path.name)


def _adapter_only(pulled: Path) -> None:
    """Keep a LoRA version's adapter under PEFT's names, and drop the merged model."""
    for path in list(pulled.iterdir()):
        if path.name == "config.json" or path.name.endswith(
                (".safetensors", ".safetensors.index.json")):
            path.unlink()
    for name in ADAPTER_FILES:
        (pulled / (name + ADAPTER_SUFFIX)).replace(pulled / name)


async def export(weights_url: str, token: str | None, run_id: str, dest: Path,
                 version: int | None = None, timeout_s: float = 120,
                 tls: Tls | None = None, merged: bool = False) -> Exported:
    """Pull one version of ``run_id`` into ``dest`` (module doc); raises :class:`ExportError`."""
    dest = dest.resolve()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ExportError(f"{dest} exists and is not an empty directory")
    try:
        versions, _ = await list_versions(weights_url, token, run_id, tls=tls)
        chosen = _choose(run_id, versions, version)
        dest.parent.mkdir(parents=True, exist_ok=True)
        # Beside dest, so the final move is one rename on one file system.
        scratch = Path(tempfile.mkdtemp(prefix=f".{dest.name}.export-", dir=dest.parent))
        try:
            stats = PullStats()
            pulled = await pull_version(weights_url, token, run_id, chosen, scratch,
                                        timeout_s=timeout_s, tls=tls, stats=stats)
            (pulled / MANIFEST_NAME).unlink(missing_ok=True)
            adapter = (pulled / (ADAPTER_FILES[0] + ADAPTER_SUFFIX)).is_file()
            if stats.base_dir is not None:
                await asyncio.to_thread(_over_base, pulled, stats.base_dir, merged)
                adapter = True
            elif adapter and not merged:
                _adapter_only(pulled)
            else:
                for name in ADAPTER_FILES:
                    (pulled / (name + ADAPTER_SUFFIX)).unlink(missing_ok=True)
            adapter = adapter and not merged
            files = sorted(p.name for p in pulled.iterdir())
            missing = [name for name in (ADAPTER_FILES if adapter else REQUIRED)
                       if name not in files]
            if missing or not any(name.endswith(".safetensors") for name in files):
                raise ExportError(f"version {chosen} of run {run_id} is not an HF model "
                                  f"directory (it holds {files}); an emu run has no weights")
            if dest.is_dir():
                dest.rmdir()  # empty (checked above): the rename needs it gone
            os.replace(pulled, dest)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    except WeightsError as exc:
        raise ExportError(str(exc)) from exc
    return Exported(run_id, chosen, dest, files, adapter)


def run_export(run_id: str, dest: Path, version: int | None, merged: bool = False) -> Exported:
    """The CLI's call: the service and token from the environment, as every service reads them."""
    url = os.environ.get("RLBOOST_WEIGHTS_URL", "http://127.0.0.1:8001")
    token = os.environ.get("RLBOOST_WEIGHTS_READ_TOKEN") or os.environ.get(
        "RLBOOST_WEIGHTS_TOKEN") or None
    return asyncio.run(export(url, token, run_id, dest, version, tls=Tls.client_env(),
                              merged=merged))
