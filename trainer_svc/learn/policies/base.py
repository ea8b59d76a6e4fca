"""The interface the trainer's step loop drives, whatever does the compute behind it.

Contract: a :class:`Policy` scores and accumulates one group at a time (``add_group``), takes
one optimizer step per RL step (``step``), and keeps its durable state under a run directory
(``save``/``restore``, ``checkpoints.hf_dir`` for the files the weight service publishes). The
trainer's step loop is the same for every policy; only the compute differs. ``restore`` returns
the weight version the run resumes from (0 for a new run, after saving version 0).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from trainer_svc.learn.checkpoint import RunCheckpoints
from trainer_svc.learn.policies.publish import WeightsAccess
from trainer_svc.learn.step_trainer import Group


class Policy(Protocol):
    eos_id: int
    vocab_size: int  # token ids the model has; rollout chunks outside it are dropped
    checkpoints: RunCheckpoints

    def restore(self) -> int: ...
    def reward(self, prompt: list[int], response: list[int]) -> float: ...
    def add_group(self, group: Group) -> None: ...
    def reset(self) -> None: ...
    def step(self, step_index: int) -> dict[str, Any]: ...
    def save(self, version: int) -> None: ...


@runtime_checkable
class PublishesItself(Protocol):
    """A policy whose version is spread over processes (the ranks of a torchrun job): it
    uploads and commits a saved version itself, instead of the service uploading
    ``checkpoints.hf_dir(version)`` from its own process."""

    async def publish(self, access: WeightsAccess, run_id: str, version: int) -> None: ...
