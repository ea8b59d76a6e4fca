"""The trainer's weights on disk: the model directory a run starts from, and its durable state.

Contract: :func:`load_policy` loads a run's base model (an HF model directory) offline, the one
way the trainer, its eval and the self-checks read weights. :class:`RunCheckpoints` keeps one
run's state under ``<data dir>/trainer/<run id>/``: ``v<k>.pt`` holds the policy and optimizer
after k optimizer steps; ``hf-<k>/`` is the same policy as an HF model directory (what the
weight service publishes); ``finish-<n>.json`` is the report of step n. A LoRA run's
``v<k>.pt`` holds the adapter instead of the model (its base is the model directory), and its
``hf-<k>/`` the merged model plus the adapter's files (:mod:`trainer_svc.learn.lora`).
Every file is written to a temporary name and renamed, and the report of step n is written
before checkpoint n+1, so a checkpoint on disk always has its report.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import msgspec
import torch
from transformers import AutoModelForCausalLM

from shared.protocol import StepFinish

# Tokenizer and generation files travel with every published version, unchanged from the base.
BASE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "generation_config.json", "vocab.json", "merges.txt", "chat_template.jinja")
KEEP = 2


def load_policy(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Load an HF causal LM from a directory, offline, in ``dtype``."""
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, local_files_only=True
    )
    return model


def lora_of(model: torch.nn.Module) -> ModuleType | None:
    """:mod:`trainer_svc.learn.lora` when ``model`` is a LoRA policy, else None; a process
    that never imported PEFT has no LoRA policy, and does not import it here either."""
    if "peft" not in sys.modules:
        return None
    from trainer_svc.learn import lora
    return lora if lora.is_lora(model) else None


class RunCheckpoints:
    def __init__(self, root: Path, base_dir: Path) -> None:
        self.root = root
        self.base_dir = base_dir
        root.mkdir(parents=True, exist_ok=True)

    def hf_dir(self, version: int) -> Path:
        return self.root / f"hf-{version}"

    def _pt(self, version: int) -> Path:
        return self.root / f"v{version}.pt"

    def latest(self) -> int | None:
        versions = [int(p.stem[1:]) for p in self.root.glob("v*.pt") if p.stem[1:].isdigit()]
        return max(versions) if versions else None

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """Load the newest checkpoint into ``model``/``optimizer``; 0 when there is none."""
        version = self.latest()
        if version is None:
            return 0
        state = torch.load(self._pt(version), map_location="cpu", weights_only=True)
        lora = lora_of(model)
        if lora is not None:
            lora.load_adapter_state(model, state["adapter"])
        else:
            model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if not self.hf_dir(version).is_dir():
            self._save_hf(model, version)
        return version

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, version: int) -> None:
        self._save_hf(model, version)
        tmp = self._pt(version).with_suffix(".tmp")
        lora = lora_of(model)
        weights = ({"adapter": lora.adapter_state(model)} if lora is not None
                   else {"model": model.state_dict()})
        torch.save({**weights, "optimizer": optimizer.state_dict()}, tmp)
        os.replace(tmp, self._pt(version))
        for old in range(version - KEEP, -1, -1):
            if not self._pt(old).exists() and not self.hf_dir(old).exists():
                break
            self._pt(old).unlink(missing_ok=True)
            shutil.rmtree(self.hf_dir(old), ignore_errors=True)

    def _save_hf(self, model: torch.nn.Module, version: int) -> None:
        final = self.hf_dir(version)
        tmp = self.root / f".hf-{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        lora = lora_of(model)
        if lora is not None:
            # What every engine loads is the merged model; the adapter rides along.
            model.get_base_model().save_pretrained(  # type: ignore[operator]
                tmp, state_dict=lora.merged_state_dict(model), safe_serialization=True)
            lora.save_adapter(model, tmp)
        else:
            model.save_pretrained(tmp, safe_serialization=True)  # type: ignore[operator]
        for name in BASE_FILES:
            if (self.base_dir / name).is_file():
                shutil.copy2(self.base_dir / name, tmp / name)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)

    def save_finish(self, report: StepFinish) -> None:
        path = self.root / f"finish-{report.step}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(report))
        os.replace(tmp, path)

    def load_finish(self, step: int) -> StepFinish | None:
        path = self.root / f"finish-{step}.json"
        if not path.is_file():
            return None
        return msgspec.json.decode(path.read_bytes(), type=StepFinish)
