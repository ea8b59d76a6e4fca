"""In-process generation with any HF causal LM: the keyed draw and the batched KV-cache loop.

This is the one sampler of the project. The rollout service's torch engine drives its
primitives from its wave scheduler (it streams tokens, resumes after committed ones and
admits requests in waves); the trainer's eval and self-checks call :func:`generate`, a plain
loop over the same primitives. The emu engine's tokens are a pure function of the request
and use none of this. It knows token id sequences and a model; nothing about tokenizers, the
bus or the services. It imports torch, so the simulator (which must not) never imports it.

Contract:

- :func:`sample_token` is the draw of the design (invariant 5): the token at response
  position ``pos`` is the inverse CDF of softmax(logits / T), in float64 on the CPU, at
  ``shared.sampling.uniform(seed, step, prompt, sample, pos)``; ``T == 0`` is argmax (the
  first maximum on ties). It depends on nothing but the logits, the temperature and the
  five coordinates: not on the batch, the instance, or how often the response moved.
- :func:`prefill` left-pads a batch of sequences of any lengths (so every row's last token
  sits in the last column, where logits are read), with an attention mask and position ids
  that put each row's first real token at position 0 just as it would stand alone, and runs
  them through the model into a fresh ``DynamicCache``, keeping the last position's logits
  only. :func:`decode` feeds each row's ``last`` token one position further. Rows that are
  done stay in the batch as padding; their logits are computed and ignored.
- :func:`generate` samples one response per prompt, each cut after its first EOS (kept, as
  the engines keep it) or at ``max_new_tokens``, row ``i`` drawing with ``keys[i]`` at
  positions 0, 1, ... It is plain sampling, no top-k or top-p, so the log-probs the trainer
  computes are those of the distribution it samples.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from shared.sampling import uniform


@dataclass(frozen=True, slots=True)
class DrawKey:
    """The first four coordinates of a keyed draw; the response position is the fifth."""

    seed: int  # the run's seed
    step: int  # the RL step
    prompt_index: int
    sample_index: int


def sample_token(logits: torch.Tensor, temperature: float, key: DrawKey, position: int) -> int:
    """The keyed draw of the design: inverse CDF of softmax(logits / T) in float64 on the CPU."""
    row = logits.detach().to(device="cpu", dtype=torch.float64)
    if temperature == 0:
        return int(torch.argmax(row).item())  # first maximum on ties, like every argmax here
    probs = torch.softmax(row / temperature, dim=-1)
    cumulative = torch.cumsum(probs, dim=-1)
    u = uniform(key.seed, key.step, key.prompt_index, key.sample_index, position)
    # shared.sampling.pick's rule (the first cumulative probability above u * total; the last
    # index if none is) searched in C: a vocabulary's list of floats is not built per token.
    found = int(torch.searchsorted(cumulative, u * cumulative[-1], right=True))
    return min(found, cumulative.numel() - 1)


@dataclass(slots=True)
class Batch:
    """A left-padded batch being decoded: its KV cache and where each row stands."""

    cache: Any  # a transformers DynamicCache; untyped upstream
    mask: torch.Tensor  # (B, T) attention mask over everything fed so far, pads are 0
    next_pos: torch.Tensor  # (B,) position id of the token each row feeds next
    last: torch.Tensor  # (B,) the token each row feeds next: the caller sets its sampled one


def prefill(model: Any, seqs: Sequence[Sequence[int]], device: torch.device,
            pad_id: int = 0) -> tuple[torch.Tensor, Batch]:
    """Run the left-padded ``seqs`` through ``model``; each row's next-token logits ``(B, V)``."""
    width = max(len(s) for s in seqs)
    pad = [width - len(s) for s in seqs]
    ids = torch.tensor(
        [[pad_id] * p + list(s) for p, s in zip(pad, seqs, strict=True)], device=device
    )
    mask = torch.tensor(
        [[0] * p + [1] * len(s) for p, s in zip(pad, seqs, strict=True)], device=device
    )
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=position_ids,
        past_key_values=DynamicCache(),
        use_cache=True,
        logits_to_keep=1,
    )
    batch = Batch(
        cache=out.past_key_values,
        mask=mask,
        next_pos=mask.sum(-1),
        last=torch.zeros(len(seqs), dtype=torch.long, device=device),
    )
    return out.logits[:, -1, :], batch


def decode(model: Any, batch: Batch) -> torch.Tensor:
    """Feed every row's ``last`` token; each row's next-token logits ``(B, V)``."""
    batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch.last), 1)], dim=1)
    out = model(
        input_ids=batch.last[:, None],
        attention_mask=batch.mask,
        position_ids=batch.next_pos[:, None],
        past_key_values=batch.cache,
        use_cache=True,
    )
    batch.cache = out.past_key_values
    batch.next_pos = batch.next_pos + 1
    logits: torch.Tensor = out.logits[:, -1, :]
    return logits


@torch.no_grad()
def generate(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             temperature: float, eos_ids: Collection[int], keys: Sequence[DrawKey],
             pad_id: int = 0) -> list[list[int]]:
    """One response per prompt, row ``i`` drawn with ``keys[i]``; see the module docstring."""
    if len(keys) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(keys)} draw keys")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    out: list[list[int]] = [[] for _ in prompts]
    if not prompts or max_new_tokens <= 0:
        return out
    logits, batch = prefill(model, prompts, next(model.parameters()).device, pad_id)
    stops = frozenset(eos_ids)
    live = list(range(len(prompts)))
    for position in range(max_new_tokens):
        if position > 0:
            logits = decode(model, batch)
        for i in live:
            token = sample_token(logits[i], temperature, keys[i], position)
            out[i].append(token)
            batch.last[i] = token
        live = [i for i in live if out[i][-1] not in stops]
        if not live:
            break
    return out
