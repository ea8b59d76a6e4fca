"""Adapter-only versions: the manifest's ``adapter`` entry and its checks, the content hash that
names a base, and the merge an engine applies, which must be the trainer's merged model bit
for bit (so samples do not change when a LoRA run ships adapters instead of merged models)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollout_svc.engines.torch_engine import TorchEngine
from shared.errors import WeightsError
from shared.weights.adapter import AdapterError, merge_adapter, read_base
from shared.weights.manifest import (
    ADAPTER_FILES,
    ADAPTER_SUFFIX,
    Manifest,
    check_adapter,
    check_manifest,
    content_sha256,
)
from tests.unit.test_lora import IDS, _logits, _policy, _train, model_dir
from trainer_svc.learn.lora import merged_state_dict
from trainer_svc.learn.policies.torch_policy import TorchPolicy

__all__ = ["model_dir"]  # the fixture: a small Qwen2 base

DIGEST = "ab" * 32


def _manifest(**extra: object) -> Manifest:
    m: Manifest = {"run_id": "r", "version": 3, "chunk_bytes": 4, "files": [
        {"name": "adapter_config.json", "size": 2, "sha256": "0" * 64,
         "chunks": [{"offset": 0, "size": 2, "sha256": "0" * 64}]}]}
    m.update(extra)  # type: ignore[typeddict-item]
    return m


def test_adapter_entry_checks() -> None:
    check_manifest(_manifest(adapter={"base": 0, "base_sha256": DIGEST}), "r", 3)
    for bad in ({"base": 3, "base_sha256": DIGEST},  # not older
                {"base": -1, "base_sha256": DIGEST},
                {"base": True, "base_sha256": DIGEST},
                {"base": "0", "base_sha256": DIGEST},
                {"base": 0, "base_sha256": DIGEST.upper()},
                {"base": 0, "base_sha256": DIGEST[:-1]},
                {"base": 0, "base_sha256": DIGEST, "extra": 1},
                {"base": 0}, [0, DIGEST], None):
        with pytest.raises(WeightsError):
            check_manifest(_manifest(adapter=bad), "r", 3)
    assert check_adapter({"base": 2, "base_sha256": DIGEST}, 3)["base"] == 2


def test_content_hash_is_the_files_alone() -> None:
    """A base is its bytes: run, version, chunking, a delta entry and the run's initial
    adapter files do not change its hash; any other file's name, size or sha256 does."""
    one = _manifest()
    other = _manifest(run_id="s", version=9, chunk_bytes=1 << 20)
    assert content_sha256(one) == content_sha256(other)
    hidden = _manifest()  # a LoRA version's initial adapter, hidden: not part of the base
    hidden["files"].append({"name": "adapter_model.safetensors" + ADAPTER_SUFFIX, "size": 1,
                            "sha256": "2" * 64, "chunks": []})
    assert content_sha256(hidden) == content_sha256(one)
    for key, value in (("name", "config.json"), ("size", 3), ("sha256", "1" * 64)):
        changed = _manifest()
        changed["files"][0][key] = value  # type: ignore[literal-required]
        assert content_sha256(changed) != content_sha256(one), key


def _versions(policy: TorchPolicy, tmp_path: Path) -> tuple[Path, Path, Path]:
    """Version 0 (the base, full), version 2 as the trainer writes it (merged + hidden
    adapter) and version 2 as an adapter-only version's directory holds it."""
    policy.restore()
    policy.save(0)
    base = tmp_path / "base"  # the checkpoints keep two versions: 0 goes at version 2
    shutil.copytree(policy.checkpoints.hf_dir(0), base)
    _train(policy, 2)
    policy.save(2)
    full = policy.checkpoints.hf_dir(2)
    adapter = tmp_path / "adapter-2"
    adapter.mkdir()
    for name in ADAPTER_FILES:
        shutil.copyfile(full / (name + ADAPTER_SUFFIX), adapter / name)
    return base, full, adapter


def test_merge_is_the_trainers_merged_model_bit_for_bit(model_dir: Path, tmp_path: Path
                                                         ) -> None:
    policy = _policy(model_dir, tmp_path / "run")
    base, full, adapter = _versions(policy, tmp_path)
    merged = merge_adapter(read_base(base), adapter)
    published = load_file(full / "model.safetensors")
    live = merged_state_dict(policy.model)  # type: ignore[arg-type]
    assert merged.keys() == published.keys()
    moved = 0
    for key, value in published.items():
        assert merged[key].dtype == value.dtype and torch.equal(merged[key], value), key
        assert torch.equal(live[key], value), key
        moved += not torch.equal(value, read_base(base)[key])
    assert moved  # the adapter did change weights: the test can fail


def test_merge_refuses_what_it_cannot_reproduce(model_dir: Path, tmp_path: Path) -> None:
    policy = _policy(model_dir, tmp_path / "run")
    base, _, adapter = _versions(policy, tmp_path)
    config = adapter / "adapter_config.json"
    text = config.read_text()
    config.write_text(text.replace('"use_dora": false', '"use_dora": true'))
    with pytest.raises(AdapterError, match="use_dora"):
        merge_adapter(read_base(base), adapter)
    config.write_text(text)
    state = read_base(base)
    state.pop(next(k for k in state if k.endswith("q_proj.weight")))
    with pytest.raises(AdapterError, match="names no base weight"):
        merge_adapter(state, adapter)


@pytest.mark.parametrize("first", ["adapter", "base", "full"])
def test_torch_engine_applies_the_adapter_as_the_merged_model(
        model_dir: Path, tmp_path: Path, first: str) -> None:
    """Whatever the engine held before (nothing, the base, another full version), the adapter
    version leaves exactly the merged version's weights in it, and so its logits."""
    policy = _policy(model_dir, tmp_path / "run")
    base, full, adapter = _versions(policy, tmp_path)
    want, got = TorchEngine(), TorchEngine()
    want.load(full, "r", 2)
    if first == "base":
        got.load(base, "r", 0)
    elif first == "full":
        got.load(full, "r", 2)
    got.load_adapter(base, adapter, "r", 3)
    assert got.loaded == ("r", 3)
    ours, theirs = got._model.state_dict(), want._model.state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
    assert torch.equal(_logits(got._model, IDS), _logits(want._model, IDS))
    # The kept base is the file's, untouched by the merge: a second adapter starts from it.
    assert all(torch.equal(v, read_base(base)[k]) for k, v in got._base[1].items())  # type: ignore[index]
