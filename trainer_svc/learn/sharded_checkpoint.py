"""A sharded trainer's durable state: every rank writes its own part, nobody holds the whole.

Contract (the layout of :class:`~trainer_svc.learn.checkpoint.RunCheckpoints`, with ``v<k>.dcp/`` in
place of ``v<k>.pt``):

- ``v<k>.dcp/`` is a ``torch.distributed.checkpoint`` (DCP) directory: each rank writes the
  shards of the parameters and of AdamW's state it holds; :meth:`ShardedCheckpoints.restore`
  loads them back into the same sharding, exactly (the same bytes).
- ``hf-<k>/`` is the policy as an HF model directory (safetensors + ``model.safetensors.index
  .json`` + config + the base model's tokenizer files), written by :func:`write_hf` from the
  shards: each parameter is all-gathered once, in turn, and kept only by the one rank that
  owns it (parameters are dealt to ranks by size); a rank writes a file whenever what it keeps
  reaches ``file_bytes``. A rank's memory for this is therefore bounded by ``file_bytes`` plus
  the largest single parameter, never the model. Rank 0 writes the index from every rank's
  list of names, the config and the tokenizer files.
- A LoRA policy's ``v<k>.dcp/`` holds the adapter's shards and their AdamW state only (the
  frozen base is the model directory, loaded again on restart, as for one process); its
  ``hf-<k>/`` is the merged model, written the same way, plus the adapter's files, written by
  rank 0 (:mod:`trainer_svc.learn.sharded_lora`).
- Each rank's files are named ``model-r<rank>-<n>.safetensors``, so :func:`file_rank` tells
  which rank wrote (and uploads, :mod:`trainer_svc.learn.policies.publish`) a file of the directory;
  the index, config and tokenizer files are rank 0's.
- Every method here is collective (all ranks call it in the same order), and every directory is
  written under a temporary name that rank 0 renames once all ranks have written: a reader sees
  a complete version or none. Rank 0 decides what exists (the newest version, whether an HF
  directory is missing) and tells the others, so no two ranks can decide differently on a
  shared file system that is still catching up.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from trainer_svc.learn.checkpoint import BASE_FILES, KEEP, RunCheckpoints, lora_of

FILE_BYTES = 1 << 30  # a rank's largest safetensors file, hence its extra memory while saving
INDEX = "model.safetensors.index.json"
_RANK_FILE = re.compile(r"model-r(\d{5})-\d{5}\.safetensors")


def file_rank(name: str) -> int:
    """The rank that wrote the file ``name`` of a :func:`write_hf` directory (module doc)."""
    match = _RANK_FILE.fullmatch(name)
    return int(match.group(1)) if match else 0


def _from_rank0(value: Any) -> Any:
    box = [value if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _owners(sizes: list[int], world: int) -> list[int]:
    """Deal parameters to ranks, largest first, each to the least loaded (deterministic)."""
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += sizes[i]
    return owner


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def _sharded_lora(model: torch.nn.Module) -> ModuleType | None:
    """:mod:`trainer_svc.learn.sharded_lora` for a LoRA policy, else None (nor imported)."""
    if lora_of(model) is None:
        return None
    from trainer_svc.learn import sharded_lora
    return sharded_lora


def write_hf(model: torch.nn.Module, out: Path, base_dir: Path,
             file_bytes: int = FILE_BYTES) -> None:
    """Write ``model`` (sharded or not) as an HF directory at ``out`` (module doc)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
    dist.barrier()
    adapters = _sharded_lora(model)
    # (name, parameter, collective gather of its full tensor); tied weights once, under HF's
    # first name. A LoRA policy's are the merged model's (sharded_lora).
    params: list[tuple[str, torch.Tensor, Callable[[], torch.Tensor]]] = (
        adapters.merged_tensors(model) if adapters is not None
        else [(name, p, partial(_full, p)) for name, p in model.named_parameters()])
    owner = _owners([p.numel() * p.element_size() for _, p, _ in params], world)
    kept: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    files = 0

    def flush() -> None:
        nonlocal files, kept
        if kept:
            name = f"model-r{rank:05d}-{files:05d}.safetensors"  # file_rank's pattern
            save_file(kept, str(out / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(kept, name))
            files += 1
            kept = {}

    for (name, _, gather), who in zip(params, owner, strict=True):
        full = gather()
        if who == rank:
            kept[name] = full.detach().to("cpu", copy=True).contiguous()
            if sum(t.numel() * t.element_size() for t in kept.values()) >= file_bytes:
                flush()
        del full
    flush()
    maps: list[dict[str, str] | None] = [None] * world
    dist.all_gather_object(maps, weight_map)
    if rank == 0:
        merged = {k: v for m in maps if m for k, v in m.items()}
        total = sum(p.numel() * p.element_size() for _, p, _ in params)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(merged.items()))}
        (out / INDEX).write_text(json.dumps(index, indent=2))
        model.config.save_pretrained(out)  # type: ignore[union-attr, operator]
        for name in BASE_FILES:
            if (base_dir / name).is_file():
                shutil.copy2(base_dir / name, out / name)
    if adapters is not None:
        adapters.save_adapter(model, out)
    dist.barrier()


def _options(model: torch.nn.Module) -> StateDictOptions:
    """A LoRA policy's checkpoint leaves the frozen base out (module doc); loading it then
    cannot be strict, so :func:`_check_loaded` checks instead."""
    return StateDictOptions(strict=lora_of(model) is None)


def _trained(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """A LoRA policy's ``state`` less its frozen base (buffers included: the base is the model
    directory); any other model's whole. By hand: torch's own ``ignore_frozen_params`` keeps a
    tied weight's second name (a tied base would write its whole embedding matrix into every
    checkpoint as ``lm_head.weight``)."""
    if lora_of(model) is None:
        return state
    trained = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {k: v for k, v in state.items() if k in trained}


def _check_loaded(model: torch.nn.Module, missing: list[str], unexpected: list[str]) -> None:
    """Every trainable parameter was in the checkpoint, and nothing else was."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    absent = [k for k in missing if k in trainable]
    if absent or unexpected:
        raise ValueError(f"checkpoint does not fit the run's model: missing {absent[:3]}, "
                         f"unexpected {unexpected[:3]}")


class ShardedCheckpoints(RunCheckpoints):
    """:class:`RunCheckpoints` for a sharded model: DCP directories, HF written from shards."""

    def _dcp(self, version: int) -> Path:
        return self.root / f"v{version}.dcp"

    def latest(self) -> int | None:
        versions = [int(p.stem[1:]) for p in self.root.glob("v*.dcp") if p.stem[1:].isdigit()]
        return max(versions) if versions else None

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
        version: int | None = _from_rank0(self.latest())
        if version is None:
            return 0
        path = str(self._dcp(version))
        saved = FileSystemReader(path).read_metadata().state_dict_metadata
        options = _options(model)
        if any(key.startswith("optimizer") for key in saved):
            # get_state_dict first gives AdamW a state (a zero step); loading overwrites all of
            # it, the step count included.
            model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
            model_sd = _trained(model, model_sd)
            dcp_load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)
            result = set_state_dict(model, optimizer, model_state_dict=model_sd,
                                    optim_state_dict=optim_sd, options=options)
        else:
            model_sd = _trained(model, get_model_state_dict(model, options=options))
            dcp_load({"model": model_sd}, checkpoint_id=path)
            result = set_model_state_dict(model, model_sd, options=options)
        _check_loaded(model, result.missing_keys, result.unexpected_keys)
        if _from_rank0(not self.hf_dir(version).is_dir()):
            self._save_hf(model, version)
        return version

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, version: int) -> None:
        self._save_hf(model, version)
        tmp = self.root / f".v{version}.dcp.tmp"
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        state: dict[str, Any]
        options = _options(model)
        if optimizer.state:
            model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
            state = {"model": _trained(model, model_sd), "optimizer": optim_sd}
        else:
            # Before the first step AdamW has no state, and get_state_dict would create one
            # by a zero step, which changes the bias correction of every later step.
            state = {"model": _trained(model, get_model_state_dict(model, options=options))}
        dcp_save(state, checkpoint_id=str(tmp))
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(self._dcp(version), ignore_errors=True)
            os.replace(tmp, self._dcp(version))
            for old in range(version - KEEP, -1, -1):
                if not self._dcp(old).exists() and not self.hf_dir(old).exists():
                    break
                shutil.rmtree(self._dcp(old), ignore_errors=True)
                shutil.rmtree(self.hf_dir(old), ignore_errors=True)
        dist.barrier()

    def _save_hf(self, model: torch.nn.Module, version: int) -> None:
        tmp = self.root / f".hf-{version}.tmp"
        write_hf(model, tmp, self.base_dir)
        if dist.get_rank() == 0:
            shutil.rmtree(self.hf_dir(version), ignore_errors=True)
            os.replace(tmp, self.hf_dir(version))
        dist.barrier()
