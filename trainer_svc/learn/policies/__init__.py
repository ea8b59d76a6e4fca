"""What the trainer trains, and the factory that picks it from a run spec.

Contract: the service imports :func:`make_policy` and the :class:`Policy` interface from this
package and drives whatever comes back the same way.

* ``base`` -- the :class:`Policy` interface, and :class:`PublishesItself` for a policy
  whose version files are spread over processes.
* ``publish`` -- the ranks of a sharded trainer upload their own files of a version; one commit.
* ``torch_policy`` -- :class:`TorchPolicy`: a real HF causal LM trained by torch with the
  run's algorithm (:class:`~trainer_svc.learn.step_trainer.StepTrainer`).
* ``distributed`` -- :class:`~trainer_svc.learn.policies.distributed.DistributedPolicy`: rank 0 of a
  torchrun job, keeping one ``TorchPolicy`` per rank identical; also joins and leaves the job.
* ``emu`` -- EMULATION: :class:`EmuPolicy` waits the time a :class:`ComputeModel` gives
  (:data:`PRESETS`) instead of training.

Imports point one way only: ``distributed`` builds on ``torch_policy``, ``emu`` stands apart,
and this package imports them all; no module inside imports the package.
"""

from __future__ import annotations

from pathlib import Path

from shared.spec import RunSpec
from trainer_svc.embedded.tiny import build_tiny
from trainer_svc.embedded.tiny_chat import build_tiny_chat
from trainer_svc.embedded.tiny_chat_tools import NAME as TOOLS_MODEL
from trainer_svc.embedded.tiny_chat_tools import build_tiny_chat_tools
from trainer_svc.learn.compute_model import PRESETS, ComputeModel
from trainer_svc.learn.policies.base import Policy, PublishesItself
from trainer_svc.learn.policies.distributed import DistributedPolicy, channel
from trainer_svc.learn.policies.emu import EmuPolicy
from trainer_svc.learn.policies.publish import WeightsAccess
from trainer_svc.learn.policies.torch_policy import TorchPolicy
from trainer_svc.learn.step_trainer import RunShape

__all__ = [
    "PRESETS",
    "ComputeModel",
    "EmuPolicy",
    "Policy",
    "PublishesItself",
    "TorchPolicy",
    "WeightsAccess",
    "make_policy",
]


def make_policy(spec: RunSpec, data_dir: Path, run_dir: Path,
                emu_time_scale: float, emu_publish_s: float = 0.0,
                emu_token_scale: int = 1) -> Policy:
    """The policy a run spec asks for.

    An emu preset is emulated on rank 0 alone (the other ranks of a torchrun job stay idle);
    a torch model is data-parallel over every rank when the process group has several.
    """
    name = spec.model
    if name in PRESETS:
        return EmuPolicy(PRESETS[name], run_dir, emu_time_scale, emu_publish_s, emu_token_scale)
    seed = spec.seed
    if name == "tiny":
        model_dir = build_tiny(data_dir, seed)
    elif name == "tiny-chat":
        model_dir = build_tiny_chat(data_dir, seed)
    elif name == TOOLS_MODEL:
        model_dir = build_tiny_chat_tools(data_dir, seed)
    else:
        model_dir = Path(name)
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"model {name!r} is neither 'tiny', 'tiny-chat', "
                             f"{TOOLS_MODEL!r}, an emu preset, "
                             "nor an HF model directory")
    learning_rate = spec.learning_rate
    algorithm = spec.algorithm_config()
    shape = RunShape(max_new_tokens=spec.max_new_tokens, temperature=spec.temperature,
                     groups_per_step=spec.prompts_per_step)
    if channel() is not None:
        # Under torchrun with several ranks: the same model, data-parallel over the ranks.
        return DistributedPolicy.setup(model_dir, run_dir, learning_rate, seed,
                                       algorithm=algorithm, shape=shape, lora=spec.lora)
    return TorchPolicy(model_dir, run_dir, learning_rate, seed, algorithm=algorithm,
                       shape=shape, lora=spec.lora)
