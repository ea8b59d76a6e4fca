"""LoRA runs in the torch policy: only adapters train, the base stays bit-identical, the KL
reference is the base, checkpoints round-trip the adapter, and a version is the merged model
with the adapter's files beside it under hidden names."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from shared.spec import LoraSpec, RunSpec
from shared.weights.manifest import ADAPTER_FILES, ADAPTER_SUFFIX
from trainer_svc.learn.lora import BaseView, merged_state_dict
from trainer_svc.learn.policies.torch_policy import TorchPolicy
from trainer_svc.learn.step_trainer import Group, RunShape

VOCAB = 32
SHAPE = RunShape(max_new_tokens=6, groups_per_step=3)
SPEC = LoraSpec(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(3)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=True,
                         initializer_range=0.3)
    path = tmp_path_factory.mktemp("base") / "model"
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def _policy(model_dir: Path, run_dir: Path) -> TorchPolicy:
    # KL on: the reference must be the frozen base (BaseView), not a second load.
    algorithm = RunSpec(prompts_per_step=SHAPE.groups_per_step, kl_coef=0.1,
                        kl_estimator="k3").algorithm_config()
    return TorchPolicy(model_dir, run_dir, learning_rate=5e-2, seed=1, algorithm=algorithm,
                       shape=SHAPE, lora=SPEC)


def _groups(seed: int) -> list[Group]:
    rng = random.Random(seed)
    groups = []
    for index in range(SHAPE.groups_per_step):
        prompt = [rng.randrange(3, VOCAB) for _ in range(4)]
        responses = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 6))]
                     for _ in range(4)]
        groups.append(Group(prompt_index=index, prompts=[prompt] * 4, responses=responses,
                            rewards=[0.0, 1.0, 0.0, 1.0], truncated=[False] * 4))
    return groups


def _train(policy: TorchPolicy, steps: int) -> None:
    for step in range(steps):
        policy.reset()
        for group in _groups(step):
            policy.add_group(group)
        policy.step(step + 5)  # past the warm-up: the full learning rate


def _frozen(policy: TorchPolicy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model.named_parameters()
            if not p.requires_grad}


def _adapter(policy: TorchPolicy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=ids).logits
    return out


IDS = torch.tensor([[5, 9, 3, 17, 30, 4]])


def test_only_adapters_train_and_the_base_stays_bit_identical(model_dir: Path,
                                                              tmp_path: Path) -> None:
    policy = _policy(model_dir, tmp_path)
    assert policy.restore() == 0
    base, before = _frozen(policy), _adapter(policy)
    assert before and all(".lora_" in n for n in before)
    assert all(".lora_" not in n for n in base)
    # AdamW and the step trainer hold the adapters alone.
    trained = {id(p) for p in policy.model.parameters() if p.requires_grad}
    assert {id(p) for g in policy.optimizer.param_groups for p in g["params"]} == trained
    assert {id(p) for p in policy.trainer.params} == trained

    _train(policy, 2)
    after = _frozen(policy)
    assert after.keys() == base.keys()
    for name, value in base.items():
        assert torch.equal(after[name], value), name
    moved = [n for n, p in _adapter(policy).items() if not torch.equal(p, before[n])]
    assert any("lora_B" in n for n in moved) and any("lora_A" in n for n in moved)
    assert set(policy.optimizer.state) and all(
        id(p) in trained for p in policy.optimizer.state)

    # The KL reference is the base the run started from, though the adapters have moved.
    fresh = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference = policy.trainer.reference
    assert isinstance(reference, BaseView)
    assert torch.equal(_logits(reference, IDS), _logits(fresh, IDS))
    assert not torch.allclose(_logits(policy.model, IDS), _logits(fresh, IDS))


def test_checkpoint_round_trips_adapter_and_optimizer(model_dir: Path, tmp_path: Path) -> None:
    policy = _policy(model_dir, tmp_path)
    policy.restore()
    _train(policy, 2)
    policy.save(2)
    state = torch.load(tmp_path / "v2.pt", weights_only=True)
    assert "model" not in state  # the base is the model directory, not the checkpoint
    assert all(".lora_" in k for k in state["adapter"])

    again = _policy(model_dir, tmp_path)  # a restarted trainer: new adapters, then restore
    assert not all(torch.equal(p, _adapter(policy)[n]) for n, p in _adapter(again).items())
    assert again.restore() == 2
    for name, value in _adapter(policy).items():
        assert torch.equal(_adapter(again)[name], value), name
    ours, theirs = policy.optimizer.state_dict(), again.optimizer.state_dict()
    assert ours["state"].keys() == theirs["state"].keys()
    for key, moments in ours["state"].items():
        for field, value in moments.items():
            assert torch.equal(theirs["state"][key][field], value), (key, field)
    # Both continue identically from there.
    _train(policy, 1)
    _train(again, 1)
    assert all(torch.equal(_adapter(again)[n], p) for n, p in _adapter(policy).items())


def test_version_is_the_merged_model_with_the_adapter_hidden(model_dir: Path,
                                                            tmp_path: Path) -> None:
    policy = _policy(model_dir, tmp_path)
    policy.restore()
    _train(policy, 2)
    policy.save(2)
    hf = policy.checkpoints.hf_dir(2)
    names = sorted(p.name for p in hf.iterdir())
    assert [n for n in names if n.endswith(".safetensors")] == ["model.safetensors"]
    assert "adapter_config.json" not in names
    for name in ADAPTER_FILES:
        assert name + ADAPTER_SUFFIX in names
    # What an engine loads is the policy the trainer trained.
    merged = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    torch.testing.assert_close(_logits(merged, IDS), _logits(policy.model, IDS),
                               rtol=1e-5, atol=1e-5)
    # Merging wrote new tensors: the live base is untouched, and tied weights stay one file key.
    saved = load_file(hf / "model.safetensors")
    assert set(saved) <= set(merged_state_dict(policy.model))  # type: ignore[arg-type]
    adapter = load_file(hf / ("adapter_model.safetensors" + ADAPTER_SUFFIX))
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    model_bytes = sum(t.numel() * t.element_size() for t in saved.values())
    assert 0 < adapter_bytes < model_bytes


WRITE_ADAPTER = """
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from shared.spec import LoraSpec
from trainer_svc.learn.lora import save_adapter, wrap

torch.manual_seed(0)
model = wrap(AutoModelForCausalLM.from_pretrained(sys.argv[1]), LoraSpec(rank=4, alpha=8.0))
save_adapter(model, Path(sys.argv[2]))
"""


def test_two_processes_write_one_adapter_in_the_same_bytes(model_dir: Path,
                                                           tmp_path: Path) -> None:
    # A restarted trainer re-publishes a version byte for byte; PEFT's target modules are a set,
    # written in each process's string-hash order unless the writer sorts them.
    written = []
    for hash_seed in ("1", "2"):
        out = tmp_path / hash_seed
        out.mkdir()
        subprocess.run([sys.executable, "-c", WRITE_ADAPTER, str(model_dir), str(out)],
                       check=True, env={**os.environ, "PYTHONHASHSEED": hash_seed},
                       timeout=300)
        written.append({name: (out / (name + ADAPTER_SUFFIX)).read_bytes()
                        for name in ADAPTER_FILES})
    assert written[0] == written[1]
    config = json.loads(written[0]["adapter_config.json"])
    assert config["target_modules"] == sorted(SPEC.target_modules)
