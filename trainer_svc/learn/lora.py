"""LoRA runs: PEFT adapters on a frozen base, and the files a LoRA version is made of.

Contract:

- :func:`wrap` turns the loaded base into a PEFT model with the run's
  :class:`~shared.spec.LoraSpec`: only the adapter matrices require a gradient, so the step
  trainer and AdamW (which take the parameters that do) never touch a base weight; those stay
  bit-identical to the model directory's for the whole run. Target modules that match nothing
  are a :class:`~trainer_svc.errors.RunSpecError`: the run fails, saying so. The adapters start
  as PEFT initialises them (A random from torch's generator, B zero), so step 0's policy *is*
  the base.
- :class:`BaseView` is the frozen reference policy of a KL term: the same modules with the
  adapters disabled (PEFT's ``disable_adapter``), no second copy of the weights.
- :func:`adapter_state` / :func:`load_adapter_state`: what a checkpoint keeps of the model
  (the base is the model directory, reloaded on restart).
- :func:`merged_state_dict` is the policy as one plain HF state dict (each adapted weight
  ``W + (alpha / rank) B A``), computed beside the live model without merging into it: a
  merge and unmerge in place would round the base weights.
- :func:`save_adapter` writes PEFT's two adapter files into a version directory under names
  with a reserved suffix, so a loader that takes every ``*.safetensors`` of a directory (the
  torch engine, SGLang) or finds ``adapter_config.json`` (transformers) still sees the merged
  model alone (:data:`~shared.weights.manifest.ADAPTER_SUFFIX`); ``rlboost export`` strips
  the suffix again.

Importing this module imports PEFT (seconds); the trainer imports it only for a LoRA run.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from peft import (
    LoraConfig,
    PeftModel,
    get_peft_model,
    get_peft_model_state_dict,
    set_peft_model_state_dict,
)
from peft.tuners.lora import LoraLayer

from shared.spec import LoraSpec
from shared.weights.manifest import ADAPTER_FILES, ADAPTER_SUFFIX
from trainer_svc.errors import RunSpecError
from trainer_svc.learn.algorithms.logprobs import dropout_off

ADAPTER = "default"  # PEFT's name for a model's one adapter


def wrap(model: torch.nn.Module, spec: LoraSpec) -> PeftModel:
    """``model`` with LoRA adapters on ``spec.target_modules``; its own weights frozen."""
    # PEFT annotates lora_alpha as an int but only ever divides it by r: a float is exact.
    alpha: Any = spec.alpha
    config = LoraConfig(r=spec.rank, lora_alpha=alpha, lora_dropout=spec.dropout,
                        target_modules=list(spec.target_modules), bias="none",
                        task_type="CAUSAL_LM")
    try:
        peft_model = get_peft_model(model, config)  # type: ignore[arg-type]
    except ValueError as exc:  # PEFT's "Target modules ... not found in the base model"
        raise RunSpecError(f"lora.target_modules: {exc}") from exc
    return peft_model


class BaseView(torch.nn.Module):
    """The frozen base of a PEFT model, for the KL term's reference log-probs."""

    def __init__(self, model: PeftModel) -> None:
        super().__init__()
        self.model = model  # shared with the policy: its parameters, device and dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Dropout off as for any reference (the trainer restores each module's mode after).
        with self.model.disable_adapter(), dropout_off(self.model):
            return self.model(*args, **kwargs)


def is_lora(model: torch.nn.Module) -> bool:
    return isinstance(model, PeftModel)


def adapter_state(model: PeftModel) -> dict[str, torch.Tensor]:
    """The adapter's tensors (PEFT's names, without the adapter's name), on the CPU."""
    return {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(model).items()}


def load_adapter_state(model: PeftModel, state: dict[str, torch.Tensor]) -> None:
    result: Any = set_peft_model_state_dict(model, state)  # load_state_dict's named tuple
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"checkpoint does not fit the run's adapter: missing {missing[:3]}, "
                         f"unexpected {list(result.unexpected_keys)[:3]}")


def merged_state_dict(model: PeftModel) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter merged in (module doc)."""
    base = model.get_base_model()
    deltas: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
                layer: Any = module  # every LoRA layer kind (Linear, Embedding...) defines it
                deltas[name] = layer.get_delta_weight(ADAPTER)
        merged: dict[str, torch.Tensor] = {}
        for key, value in base.state_dict().items():
            if ".lora_" in key:
                continue
            key = key.replace(".base_layer.", ".")
            owner, _, leaf = key.rpartition(".")
            if leaf == "weight" and owner in deltas:
                value = merged_weight(value, deltas[owner])
            merged[key] = value  # others keep their storage, so tied weights stay tied
    return merged


def merged_weight(weight: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``weight + delta`` in ``weight``'s dtype, as a new tensor: the live base weight is left
    exactly as it was. Summed in the wider dtype (PEFT keeps adapters of a half-precision base
    in float32)."""
    wide = torch.promote_types(weight.dtype, delta.dtype)
    return (weight.to(wide) + delta.to(wide)).to(weight.dtype)


def save_adapter(model: PeftModel, version_dir: Path,
                 state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Write the adapter's files into ``version_dir`` under hidden names (module doc); from
    ``state_dict`` (the model's own names) in place of the live weights when given, as a
    sharded model's gathered adapter."""
    with tempfile.TemporaryDirectory(dir=version_dir.parent) as scratch:
        model.save_pretrained(scratch, safe_serialization=True, state_dict=state_dict)
        _canonical_config(Path(scratch) / "adapter_config.json")
        for name in ADAPTER_FILES:
            (Path(scratch) / name).replace(version_dir / (name + ADAPTER_SUFFIX))


def _canonical_config(path: Path) -> None:
    """Rewrite PEFT's adapter config with its set-valued fields sorted. PEFT keeps
    ``target_modules`` as a set and writes it in the process's string-hash order, so two
    processes (a trainer restarted mid-run, ranks of one job) wrote one version's config in
    different bytes: a re-publish must be byte-identical to what was published."""
    config = json.loads(path.read_text())
    for key, value in config.items():
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            config[key] = sorted(value)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

