"""One rank of a sharded trainer: the model, its gradients and AdamW's state split by FSDP2.

Contract:

- :func:`shard` applies ``torch.distributed.fsdp.fully_shard`` to every decoder layer (the
  classes HF names in ``_no_split_modules``), to the input and the output embedding when they
  are two tensors, and then to the root, so a rank holds 1/world of each parameter, of its
  gradient and of AdamW's moments (DTensors sharded on dim 0). A unit's full parameters exist
  only while it runs: its forward all-gathers them and frees them after, its backward
  all-gathers them again and reduce-scatters the gradient. Embeddings are units of their own
  because the root's parameters stay gathered from the start of the forward to its end, and
  in backward from the first gradient to the last, with their full gradient: an untied
  vocabulary-sized matrix left in the root is held whole, twice, for most of the step (the
  largest models, where sharding matters, do not tie: Qwen2.5-7B and up). Tied embeddings are
  one parameter used at both ends and stay in the root.
- Gradients are *summed* over the ranks (FSDP2 averages by default): the step trainer divides
  by the step's token denominator itself, exactly as in one process.
- Mixed precision is FSDP2's :class:`MixedPrecisionPolicy`: the parameters stay in the model's
  dtype (fp32 master weights) and are cast to ``param_dtype`` for compute; gradients are
  reduced in ``reduce_dtype``. ``None`` keeps the model's dtype (the float64 equality tests).
- :class:`ShardedPolicy` has :class:`~trainer_svc.learn.policies.torch_policy.TorchPolicy`'s
  methods, but every one of them that computes is *collective*: all ranks call it, in the same
  order. Groups therefore arrive in rounds (:meth:`ShardedPolicy.add_round`), one group per rank
  at most; every rank records the whole round and runs the forwards and backwards its own group
  needs, or :meth:`~trainer_svc.learn.step_trainer.StepTrainer.pad` of the same kind, in one fixed
  order of kinds. At the barrier each optimizer step is padded the same way to the largest
  number of backwards any rank has in it, known before the step from one all-reduce.
- Checkpoints are :class:`~trainer_svc.learn.sharded_checkpoint.ShardedCheckpoints`: each rank
  writes its own shards (torch.distributed.checkpoint), and the published HF directory is
  written from shards too.
- A LoRA run (``lora``, :mod:`trainer_svc.learn.lora`) wraps the base in PEFT's adapters
  *before* sharding, so the frozen base is sharded like any model (1/world of it per rank) but
  has no gradient and no AdamW state; only the adapters' shards train. Its reference policy is
  that base with the adapters off (:class:`~trainer_svc.learn.lora.BaseView`), not a second
  sharded copy. Checkpoints keep the adapter and its AdamW state; versions are the merged
  model plus the adapter's files (:mod:`trainer_svc.learn.sharded_lora`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from shared.algorithm import AlgorithmConfig
from shared.config import TrainerConfig
from shared.spec import LoraSpec
from trainer_svc.learn.checkpoint import load_policy
from trainer_svc.learn.policies.torch_policy import ModelPolicy
from trainer_svc.learn.schedule import learning_rate_at
from trainer_svc.learn.sharded_checkpoint import ShardedCheckpoints
from trainer_svc.learn.step_trainer import Group, RunShape, Work

# Kinds of work in the order every rank runs them within a round (module doc).
_ROUND_ORDER = (Work.STREAM, Work.SCORE)


@dataclass(frozen=True, slots=True)
class ShardingConfig:
    """How a sharded trainer holds and computes (the RLBOOST_TRAINER_* settings)."""

    param_dtype: torch.dtype | None = torch.bfloat16  # compute dtype; None = the model's
    reduce_dtype: torch.dtype | None = torch.float32  # gradient reduction; None = param_dtype
    activation_checkpointing: bool = False  # recompute each layer's activations in backward
    offload_optimizer: bool = False  # parameters, gradients and AdamW state in host memory


def _dtype(name: str) -> torch.dtype | None:
    return None if name == "model" else getattr(torch, name)  # type: ignore[no-any-return]


def sharding_of(cfg: TrainerConfig) -> ShardingConfig | None:
    """The trainer settings' sharding; None when the ranks replicate the model."""
    if cfg.sharding != "fsdp2":
        return None
    return ShardingConfig(_dtype(cfg.param_dtype), _dtype(cfg.reduce_dtype),
                          cfg.activation_checkpointing, cfg.offload_optimizer)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one: HF's own list of modules never to split."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class to shard by")
    return layers


def shard(model: torch.nn.Module, cfg: ShardingConfig, device: torch.device) -> None:
    """Shard ``model`` in place over the default process group (module doc)."""
    if cfg.activation_checkpointing:
        # Non-reentrant: FSDP2's hooks see the recomputed forward like the first one.
        model.gradient_checkpointing_enable(  # type: ignore[operator]
            gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=cfg.param_dtype, reduce_dtype=cfg.reduce_dtype)
    # FSDP2 offloads parameters and gradients with the optimizer state (the step then runs on
    # the host); on a CPU-only rank everything is in host memory already.
    offload: OffloadPolicy = (CPUOffloadPolicy(pin_memory=device.type == "cuda")
                              if cfg.offload_optimizer else OffloadPolicy())
    units = decoder_layers(model)
    inputs = model.get_input_embeddings()  # type: ignore[operator]
    outputs = model.get_output_embeddings()  # type: ignore[operator]
    if isinstance(inputs, torch.nn.Module) and isinstance(outputs, torch.nn.Module) \
            and not _shares_parameters(inputs, outputs):
        units += [inputs, outputs]  # untied: each its own unit (module doc)
    for unit in units:
        fully_shard(unit, mp_policy=mp, offload_policy=offload, reshard_after_forward=True)
    # The root too: FSDP2 keeps the root's parameters gathered after a forward by default, and
    # after a forward without backward (scoring) they would stay gathered across the next
    # optimizer step, so the forward after it would compute with the old weights.
    fully_shard(model, mp_policy=mp, offload_policy=offload, reshard_after_forward=True)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # a sum, not a mean (module doc)
            # A plain SUM in the collective: for fp32/bf16 FSDP2 would otherwise ask for
            # PREMUL_SUM, which gloo does not have.
            m.set_force_sum_reduction_for_comms(True)


def _shares_parameters(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return bool({id(p) for p in a.parameters()} & {id(p) for p in b.parameters()})


class ShardedPolicy(ModelPolicy):
    """This rank's share of the model; every computing method is collective (module doc)."""

    def __init__(self, model_dir: Path, run_dir: Path, learning_rate: float, seed: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | None = None, *,
                 algorithm: AlgorithmConfig | None = None, shape: RunShape | None = None,
                 sharding: ShardingConfig | None = None, lora: LoraSpec | None = None) -> None:
        device = device or torch.device("cpu")
        sharding = sharding or ShardingConfig()
        torch.manual_seed(seed)
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._pads: list[int] = []  # per optimizer step of this RL step: pads still to run
        model = load_policy(model_dir, dtype=dtype)
        base_view: Callable[[], torch.nn.Module] | None = None
        if lora is not None:
            # Imported here: PEFT takes seconds to import and only a LoRA run needs it.
            from trainer_svc.learn import lora as adapters
            wrapped = adapters.wrap(model, lora)  # before sharding: the adapters are shards too
            model = wrapped
            base_view = lambda: adapters.BaseView(wrapped)  # noqa: E731
        model.to(device)
        model.train()
        shard(model, sharding, device)

        def reference() -> torch.nn.Module:
            if base_view is not None:
                return base_view()  # the sharded base itself, adapters off (module doc)
            frozen = load_policy(model_dir, dtype=dtype).to(device)
            frozen.requires_grad_(False)
            shard(frozen, ShardingConfig(sharding.param_dtype, sharding.reduce_dtype), device)
            return frozen

        self._train(model, learning_rate, algorithm, shape, reference, self._reduce,
                    ShardedCheckpoints(run_dir, model_dir), device)

    def add_round(self, groups: list[Group | None]) -> None:
        """Record every group; run this rank's (``groups[rank]``), or pad for it."""
        if len(groups) != self.world_size:
            raise ValueError(f"a round has one slot per rank, got {len(groups)}")
        with self.meter.timed():
            self._run_round(groups)

    def _run_round(self, groups: list[Group | None]) -> None:
        own = groups[self.rank]
        for i, group in enumerate(groups):
            if group is not None and i != self.rank:
                self.trainer.add_group(group, owned=False)
        kinds = {self.trainer.work(g) for g in groups if g is not None}
        mine = self.trainer.work(own) if own is not None else None
        for kind in _ROUND_ORDER:
            if kind not in kinds:
                continue
            if own is not None and mine is kind:
                self.trainer.add_group(own, owned=True)
            else:
                self.trainer.pad(kind)
        if own is not None and mine is Work.NONE:
            self.trainer.add_group(own, owned=True)  # recorded; it computes nothing

    def step(self, step_index: int) -> dict[str, Any]:
        with self.meter.timed():
            stats = self._step(step_index)
        return self.meter.finish(stats)

    def _step(self, step_index: int) -> dict[str, Any]:
        mine = torch.tensor(self.trainer.barrier_backwards(), dtype=torch.int64)
        most = mine.to(self.device, copy=True)  # all_reduce works in place
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        self._pads = (most.cpu() - mine).tolist()
        return self.trainer.step(lr=learning_rate_at(step_index, self.learning_rate))

    def _reduce(self, params: list[torch.nn.Parameter], sums: torch.Tensor) -> torch.Tensor:
        # The gradients are summed already, by the reduce-scatters inside each backward; what is
        # left is to run this optimizer step's pads, then sum the loss-side numbers.
        if not self._pads:
            raise RuntimeError("an optimizer step the barrier did not plan for")
        del params
        for _ in range(self._pads.pop(0)):
            self.trainer.pad()
        summed = sums.to(device=self.device, dtype=torch.float64)
        dist.all_reduce(summed)
        return summed.cpu()
