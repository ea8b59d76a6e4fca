"""EMULATION: a policy that only takes time, with the compute model that says how much.

Contract: :class:`EmuPolicy` keeps the :class:`~trainer_svc.learn.policies.base.Policy` interface
but replaces torch with a :class:`ComputeModel`: it sleeps the modelled GPU time of training on the
tokens it is given and publishes a small placeholder checkpoint, so the manager, buses, leases
and weight transfer around it are the real system. Any figure made with it must say it is
emulation. :data:`PRESETS` names the model classes a run spec's ``model`` may ask for.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from trainer_svc.embedded import task
from trainer_svc.learn.checkpoint import RunCheckpoints
from trainer_svc.learn.compute_model import ComputeModel
from trainer_svc.learn.step_trainer import Group

# The emu engine's vocabulary (rollout_svc.engines.emu's default): ingest drops any token
# id at or above it.
EMU_VOCAB_SIZE = 32000


class EmuPolicy:
    """EMULATION: waits the modelled compute time instead of running torch."""

    def __init__(self, preset: ComputeModel, run_dir: Path, time_scale: float,
                 publish_s: float = 0.0, token_scale: int = 1) -> None:
        self.preset = preset
        self.time_scale = time_scale
        self.publish_s = publish_s  # modelled write + hash + upload of the real checkpoint
        # Modelled tokens per response token (RLBOOST_EMU_TOKEN_SCALE, the emu engine's): a
        # response of n tokens stands for about n times this many trained ones.
        self.token_scale = token_scale
        self.checkpoints = RunCheckpoints(run_dir, run_dir)
        self.eos_id = task.EOS_ID
        self.vocab_size = EMU_VOCAB_SIZE
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

    def add_group(self, group: Group) -> None:
        tokens = sum(len(p) + self.token_scale * len(r)
                     for p, r in zip(group.prompts, group.responses, strict=True))
        time.sleep(self.time_scale * tokens * self.preset.seconds_per_token)

    def reset(self) -> None:
        pass

    def step(self, step_index: int) -> dict[str, Any]:
        time.sleep(self.time_scale * self.preset.optimizer_step_s)
        return {"loss": 0.0}

    def save(self, version: int) -> None:
        if version > 0:  # version 0 exists before the run: nothing to publish
            time.sleep(self.time_scale * self.publish_s)
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
