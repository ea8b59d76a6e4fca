"""A LoRA policy sharded by FSDP2, published: the merged model and the adapter, from shards.

Contract (what :func:`~trainer_svc.learn.sharded_checkpoint.write_hf` writes of a LoRA policy; the
same version, tensor for tensor, as :class:`~trainer_svc.learn.checkpoint.RunCheckpoints` writes
of an unsharded one):

- :func:`merged_tensors` lists the merged model's tensors: the base's parameters under HF's
  names (PEFT's ``base_model.model.`` prefix and ``.base_layer.`` dropped, tied weights once),
  each with a collective ``gather`` that returns the full tensor on every rank. An adapted
  weight is gathered with its adapter's matrices and merged by the unsharded code itself:
  PEFT's ``get_delta_weight`` of the layer, called (``torch.func.functional_call``) with the
  gathered matrices in place of the shards, then :func:`~trainer_svc.learn.lora.merged_weight`.
  Given the same base and adapter, the merged tensor is therefore bit for bit what
  :func:`~trainer_svc.learn.lora.merged_state_dict` computes in one process. Only one layer's
  adapter is gathered at a time: a rank's extra memory stays one weight and its adapter.
- :func:`save_adapter` (collective) gathers the adapter and has rank 0 write PEFT's two files
  under the reserved names (:func:`~trainer_svc.learn.lora.save_adapter`).

Importing this module imports PEFT: the sharded checkpoints import it only for a LoRA policy.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from torch.distributed.tensor import DTensor

from trainer_svc.learn import lora

# (HF name, the sharded parameter it comes from, collective: the full tensor)
Published = tuple[str, torch.Tensor, Callable[[], torch.Tensor]]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class _Delta(torch.nn.Module):
    """Calls a LoRA layer's own ``get_delta_weight`` (for ``functional_call``)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self) -> torch.Tensor:
        layer: Any = self.layer  # every LoRA layer kind (Linear, Embedding...) defines it
        delta: torch.Tensor = layer.get_delta_weight(lora.ADAPTER)
        return delta


@torch.no_grad()
def _merged(weight: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    gathered = {f"layer.{name}": _full(p) for name, p in layer.named_parameters()
                if name.startswith("lora_")}  # not base_layer: the delta never reads it
    delta = torch.func.functional_call(_Delta(layer), gathered, ())
    return lora.merged_weight(_full(weight), delta)


@torch.no_grad()
def _gathered(weight: torch.Tensor) -> torch.Tensor:
    return _full(weight)


def merged_tensors(model: PeftModel) -> list[Published]:
    """The merged model's tensors in a fixed order, each with its collective gather."""
    base = model.get_base_model()
    adapted = {name: base.get_submodule(name) for name, module in base.named_modules()
               if isinstance(module, LoraLayer) and lora.ADAPTER in module.lora_A}
    out: list[Published] = []
    for name, p in base.named_parameters():
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".")
        layer = adapted.get(owner.removesuffix(".base_layer"))
        gather = (partial(_merged, p, layer) if leaf == "weight" and layer is not None
                  and owner.endswith(".base_layer") else partial(_gathered, p))
        out.append((name.replace(".base_layer.", "."), p, gather))
    return out


def save_adapter(model: PeftModel, out: Path) -> None:
    """Collective: gather the adapter; rank 0 writes its files into ``out`` (module doc)."""
    with torch.no_grad():
        state = {k: _full(v).detach().cpu() for k, v in model.state_dict().items()
                 if ".lora_" in k}
    if dist.get_rank() == 0:
        lora.save_adapter(model, out, state_dict=state)
