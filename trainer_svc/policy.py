"""What the trainer trains: a real torch policy, or an emulated one that only takes time.

Contract: a :class:`Policy` scores and accumulates one group at a time (``add_group``), takes
one optimizer step per RL step (``step``), and keeps its durable state under a run directory
(``save``/``restore``, ``hf_dir`` for the files the weight service publishes). The trainer's
step loop is the same for both; only the compute differs.

The emulated policy (EMULATION: any figure made with it must say so) replaces torch with a
compute model: it sleeps the modelled GPU time of training on the tokens it is given and
publishes a small placeholder checkpoint, so the manager, buses, leases and weight transfer
around it are the real system.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from trainer_svc import task
from trainer_svc.checkpoint import RunCheckpoints
from trainer_svc.grpo import GrpoAccumulator, learning_rate_at
from trainer_svc.model import build_tiny, load_policy


class Policy(Protocol):
    eos_id: int
    checkpoints: RunCheckpoints

    def restore(self) -> int: ...
    def reward(self, prompt: list[int], response: list[int]) -> float: ...
    def add_group(self, prompts: list[list[int]], responses: list[list[int]],
                  rewards: list[float]) -> None: ...
    def reset(self) -> None: ...
    def step(self, step_index: int) -> dict[str, Any]: ...
    def save(self, version: int) -> None: ...


class TorchPolicy:
    """An HF causal LM trained with GRPO on the CPU or a GPU, in one process.

    Under torchrun each rank holds one of these; :mod:`trainer_svc.distributed` keeps them
    identical.
    """

    def __init__(self, model_dir: Path, run_dir: Path, learning_rate: float, seed: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> None:
        torch.manual_seed(seed)
        self.model = load_policy(model_dir, dtype=dtype)
        if device is not None:
            self.model.to(device)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=learning_rate,
                                           weight_decay=0.0)
        self.accumulator = GrpoAccumulator(self.model, self.optimizer, pad_id=task.PAD_ID)
        self.learning_rate = learning_rate
        self.checkpoints = RunCheckpoints(run_dir, model_dir)
        self.eos_id = task.EOS_ID

    def restore(self) -> int:
        version = self.checkpoints.restore(self.model, self.optimizer)
        if version == 0:
            self.checkpoints.save(self.model, self.optimizer, 0)
        return version

    def reward(self, prompt: list[int], response: list[int]) -> float:
        return task.reward(prompt, response)

    def add_group(self, prompts: list[list[int]], responses: list[list[int]],
                  rewards: list[float]) -> None:
        self.accumulator.add_group(prompts, responses, rewards)

    def reset(self) -> None:
        self.accumulator.reset()

    def step(self, step_index: int) -> dict[str, Any]:
        # The warm-up schedule is a pure function of the step: a restarted trainer needs no
        # scheduler state to resume it.
        return self.accumulator.step(lr=learning_rate_at(step_index, self.learning_rate))

    def save(self, version: int) -> None:
        self.checkpoints.save(self.model, self.optimizer, version)


@dataclass(frozen=True, slots=True)
class ComputeModel:
    """Modelled training cost of a model class on reserved GPUs (see PRESETS for sources)."""

    name: str
    params: float  # parameters
    gpus: int  # reserved GPUs training it
    mfu: float  # model FLOPs utilisation reached by the training framework
    peak_flops: float = 989e12  # H100 SXM dense bf16 peak, NVIDIA datasheet
    checkpoint_bytes: int = 64 * 1024  # size of the placeholder weights actually transferred

    @property
    def seconds_per_token(self) -> float:
        # 6*N FLOPs per token for forward + backward (Kaplan et al. 2020), plus 2*N for the
        # recomputed old log-probs of GRPO's ratio: 8*N per trained token.
        return 8 * self.params / (self.gpus * self.peak_flops * self.mfu)

    @property
    def optimizer_step_s(self) -> float:
        # AdamW touches params, grads and two moments in fp32: 16 bytes/param, sharded over
        # the GPUs at ~3.35 TB/s HBM each, taken at 50 % efficiency.
        return 16 * self.params / (self.gpus * 3.35e12 * 0.5)


# MFU 0.35-0.40 is what Megatron/FSDP report for dense 8B-32B training on H100 clusters.
PRESETS: dict[str, ComputeModel] = {
    "emu": ComputeModel("emu", params=8e9, gpus=8, mfu=0.35),
    "emu-8b": ComputeModel("emu-8b", params=8e9, gpus=8, mfu=0.35),
    "emu-14b": ComputeModel("emu-14b", params=14e9, gpus=8, mfu=0.37),
    "emu-32b": ComputeModel("emu-32b", params=32e9, gpus=8, mfu=0.40),
}


class EmuPolicy:
    """EMULATION: waits the modelled compute time instead of running torch."""

    def __init__(self, preset: ComputeModel, run_dir: Path, time_scale: float) -> None:
        self.preset = preset
        self.time_scale = time_scale
        self.checkpoints = RunCheckpoints(run_dir, run_dir)
        self.eos_id = task.EOS_ID
        self._state = run_dir / "emu-state.json"

    def restore(self) -> int:
        version = 0
        if self._state.is_file():
            version = int(json.loads(self._state.read_text())["version"])
        if version == 0:
            self.save(0)
        return version

    def reward(self, prompt: list[int], response: list[int]) -> float:
        # A deterministic stand-in for a verifier: the share of even token ids.
        return sum(1 for t in response if t % 2 == 0) / len(response) if response else 0.0

    def add_group(self, prompts: list[list[int]], responses: list[list[int]],
                  rewards: list[float]) -> None:
        tokens = sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
        time.sleep(self.time_scale * tokens * self.preset.seconds_per_token)

    def reset(self) -> None:
        pass

    def step(self, step_index: int) -> dict[str, Any]:
        time.sleep(self.time_scale * self.preset.optimizer_step_s)
        return {"loss": 0.0}

    def save(self, version: int) -> None:
        final = self.checkpoints.hf_dir(version)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps(
            {"model_type": "emu", "preset": self.preset.name, "version": version}))
        # Deterministic bytes, so a re-publish after a crash is byte-identical.
        block = version.to_bytes(8, "little") * (self.preset.checkpoint_bytes // 8)
        (tmp / "weights.bin").write_bytes(block)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        state_tmp = self._state.with_suffix(".tmp")
        state_tmp.write_text(json.dumps({"version": version}))
        os.replace(state_tmp, self._state)
        old = self.checkpoints.hf_dir(version - 2)
        shutil.rmtree(old, ignore_errors=True)


def make_policy(spec: dict[str, Any], data_dir: Path, run_dir: Path,
                emu_time_scale: float) -> Policy:
    """The policy a run spec asks for.

    An emu preset is emulated on rank 0 alone (the other ranks of a torchrun job stay idle);
    a torch model is data-parallel over every rank when the process group has several.
    """
    name = str(spec.get("model", "tiny"))
    if name in PRESETS:
        return EmuPolicy(PRESETS[name], run_dir, emu_time_scale)
    seed = int(spec.get("seed", 0))
    if name == "tiny":
        model_dir = build_tiny(data_dir, seed)
    else:
        model_dir = Path(name)
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"model {name!r} is neither 'tiny', an emu preset, nor an HF "
                             "model directory")
    learning_rate = float(spec["learning_rate"])
    # Imported here: distributed builds on TorchPolicy, so it imports this module.
    from trainer_svc import distributed

    if distributed.channel() is not None:
        # Under torchrun with several ranks: the same model, data-parallel over the ranks.
        return distributed.DistributedPolicy.setup(model_dir, run_dir, learning_rate, seed)
    return TorchPolicy(model_dir, run_dir, learning_rate, seed)
