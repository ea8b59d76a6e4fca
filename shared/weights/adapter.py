"""An adapter-only version applied to its base: the merged weights, exactly as the trainer's.

Contract: :func:`merge_adapter` takes the base's state dict (as its safetensors files hold it)
and a directory with PEFT's ``adapter_config.json`` and ``adapter_model.safetensors``, and
returns the state dict of the merged model: every adapted weight ``W + scaling * (B @ A)``,
every other tensor the base's own. It is PEFT's LoRA merge, operation for operation
(``LoraLayer.get_delta_weight`` of ``peft.tuners.lora.layer.Linear``: ``B @ A`` in the adapter's
dtype, or in float32 for a half-precision adapter on the CPU, transposed for
``fan_in_fan_out``, times ``lora_alpha / r`` or ``lora_alpha / sqrt(r)`` with rsLoRA), summed in
the wider of the two dtypes as the trainer's ``merged_state_dict`` does
(:mod:`trainer_svc.learn.lora`): the result equals the trainer's merged model bit for bit
(``tests/unit/test_adapter_versions.py`` checks it). What this does not reproduce is refused
with :class:`AdapterError`: DoRA, per-module rank or alpha patterns, adapters on anything but
a linear layer's ``weight``, and keys that name no base weight.

The base is read once per process and kept (:func:`read_base`): each later version costs
reading its adapter and one matmul per adapted weight.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from shared.errors import RlboostError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's names: the wrapped model's, under this prefix
_UNSUPPORTED = ("use_dora", "rank_pattern", "alpha_pattern", "layer_replication")


class AdapterError(RlboostError):
    """An adapter this module cannot merge as PEFT would; the message says why."""


def read_base(base_dir: Path) -> dict[str, torch.Tensor]:
    """The base model's tensors, from every ``*.safetensors`` of its directory (a LoRA
    version's ``*.safetensors.lora`` files are not among them)."""
    state: dict[str, torch.Tensor] = {}
    files = sorted(base_dir.glob("*.safetensors"))
    if not files:
        raise AdapterError(f"{base_dir} holds no *.safetensors")
    for file in files:
        state.update(load_file(file))
    return state


def _scaling(config: dict[str, Any]) -> float:
    for key in _UNSUPPORTED:
        if config.get(key):
            raise AdapterError(f"adapter_config.json: {key} is not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise AdapterError(f"adapter_config.json: bad r {rank!r} or lora_alpha {alpha!r}")
    # PEFT's LoraLayer.update_layer, exactly (a Python float, as it multiplies with).
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _delta(a: torch.Tensor, b: torch.Tensor, scaling: float, fan_in_fan_out: bool
           ) -> torch.Tensor:
    dtype = b.dtype
    half = a.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
    if half:
        a, b = a.float(), b.float()
    out = b @ a
    out = (out.T if fan_in_fan_out else out) * scaling
    return out.to(dtype) if half else out


def merge_adapter(base: dict[str, torch.Tensor], adapter_dir: Path) -> dict[str, torch.Tensor]:
    """The merged model's state dict: ``base`` with the adapter in ``adapter_dir`` merged."""
    try:
        config = json.loads((adapter_dir / CONFIG).read_text())
        tensors = load_file(adapter_dir / WEIGHTS)
    except (OSError, ValueError) as exc:
        raise AdapterError(f"cannot read the adapter in {adapter_dir}: {exc}") from exc
    scaling, fan = _scaling(config), bool(config.get("fan_in_fan_out"))
    modules = {k.removesuffix(".lora_A.weight") for k in tensors if k.endswith(".lora_A.weight")}
    if len(tensors) != 2 * len(modules):
        raise AdapterError(f"{adapter_dir}: only lora_A/lora_B weight pairs are supported")
    merged = dict(base)  # tensors not adapted are shared with the base, never written
    with torch.no_grad():
        for module in sorted(modules):
            key = module.removeprefix(PREFIX) + ".weight"
            b = tensors.get(f"{module}.lora_B.weight")
            if key not in base or b is None:
                raise AdapterError(f"{adapter_dir}: {module} names no base weight {key}")
            value, delta = base[key], _delta(tensors[f"{module}.lora_A.weight"], b, scaling, fan)
            wide = torch.promote_types(value.dtype, delta.dtype)
            merged[key] = (value.to(wide) + delta.to(wide)).to(value.dtype)
    return merged
