"""The real policy: an HF causal LM trained by torch with the run's algorithm, in one process.

Contract: :class:`TorchPolicy` keeps the :class:`~trainer_svc.learn.policies.base.Policy` interface
on the CPU or one GPU; the step's math is :class:`~trainer_svc.learn.step_trainer.StepTrainer`.
With a KL term it also holds the frozen reference policy: the run's initial weights, loaded
from the model directory (never from a checkpoint, so a restarted trainer has the same one).
A LoRA run (``lora``, :mod:`trainer_svc.learn.lora`) trains adapters on the frozen base
instead; its reference is that base, seen through the same modules with the adapters off.
Under torchrun each rank holds one of these and :mod:`trainer_svc.learn.policies.distributed` keeps
them identical; nothing here knows about ranks beyond the ``reduce`` hook it passes on.
:class:`ModelPolicy` is what it shares with the sharded policy
(:class:`~trainer_svc.learn.policies.fsdp.ShardedPolicy`): the optimizer, the step trainer and
its reference policy, the task's reward, and checkpoints of model and optimizer together.
The module is ``torch_policy``, not ``torch``, so no reader mistakes it for the library.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shared.algorithm import AlgorithmConfig
from shared.spec import LoraSpec
from trainer_svc.embedded import task
from trainer_svc.learn.checkpoint import RunCheckpoints, load_policy
from trainer_svc.learn.schedule import learning_rate_at
from trainer_svc.learn.step_meter import StepMeter
from trainer_svc.learn.step_trainer import Group, Reduce, RunShape, StepTrainer, local_reduce


class ModelPolicy:
    """A real HF causal LM trained by :class:`StepTrainer`; subclasses load (and shard) it."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    trainer: StepTrainer
    checkpoints: RunCheckpoints
    meter: StepMeter
    learning_rate: float
    eos_id: int
    vocab_size: int

    def _train(self, model: torch.nn.Module, learning_rate: float,
               algorithm: AlgorithmConfig | None, shape: RunShape | None,
               reference: Callable[[], torch.nn.Module], reduce: Reduce,
               checkpoints: RunCheckpoints, device: torch.device | None) -> None:
        """Train ``model`` with AdamW (no weight decay); ``reference()`` loads the frozen
        reference policy, called only when the algorithm has a KL term."""
        self.model = model
        # Only what trains has AdamW state: a LoRA run's adapters, else every weight.
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                           lr=learning_rate, weight_decay=0.0)
        cfg = algorithm or AlgorithmConfig.for_algorithm()
        self.trainer = StepTrainer(model, self.optimizer, cfg, shape or RunShape(), task.PAD_ID,
                                   reference=reference() if cfg.needs_reference else None,
                                   reduce=reduce)
        self.learning_rate = learning_rate
        self.checkpoints = checkpoints
        self.eos_id = task.EOS_ID
        self.vocab_size = int(getattr(model.config, "vocab_size", 0))
        self.meter = StepMeter(device)

    def restore(self) -> int:
        version = self.checkpoints.restore(self.model, self.optimizer)
        if version == 0:
            self.checkpoints.save(self.model, self.optimizer, 0)
        return version

    def reward(self, prompt: list[int], response: list[int]) -> float:
        return task.reward(prompt, response)

    def reset(self) -> None:
        self.trainer.reset()
        self.meter.reset()

    def save(self, version: int) -> None:
        self.checkpoints.save(self.model, self.optimizer, version)


class TorchPolicy(ModelPolicy):
    """An HF causal LM trained on the CPU or a GPU, in one process."""

    def __init__(self, model_dir: Path, run_dir: Path, learning_rate: float, seed: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | None = None, *,
                 algorithm: AlgorithmConfig | None = None, shape: RunShape | None = None,
                 reduce: Reduce = local_reduce, lora: LoraSpec | None = None) -> None:
        torch.manual_seed(seed)
        model = load_policy(model_dir, dtype=dtype)
        base_view: Callable[[], torch.nn.Module] | None = None
        if lora is not None:
            # Imported here: PEFT takes seconds to import and only a LoRA run needs it.
            from trainer_svc.learn import lora as adapters
            wrapped = adapters.wrap(model, lora)
            model = wrapped
            base_view = lambda: adapters.BaseView(wrapped)  # noqa: E731
        if device is not None:
            model.to(device)
        model.train()

        def reference() -> torch.nn.Module:
            if base_view is not None:
                return base_view()
            frozen = load_policy(model_dir, dtype=dtype)
            if device is not None:
                frozen.to(device)
            return frozen.requires_grad_(False)

        self._train(model, learning_rate, algorithm, shape, reference, reduce,
                    RunCheckpoints(run_dir, model_dir), device)

    def add_group(self, group: Group, owned: bool = True) -> None:
        with self.meter.timed():
            self.trainer.add_group(group, owned)

    def step(self, step_index: int) -> dict[str, Any]:
        # The warm-up schedule is a pure function of the step: a restarted trainer needs no
        # scheduler state to resume it.
        with self.meter.timed():
            stats = self.trainer.step(lr=learning_rate_at(step_index, self.learning_rate))
        return self.meter.finish(stats)
