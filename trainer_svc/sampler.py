"""Batched sampling with a KV cache for prompts of any lengths: the in-process generator.

Contract: ``sample(model, prompts, max_new_tokens, temperature, eos_ids, pad_id, generator)``
returns one response per prompt, each cut after its first EOS (the EOS is kept, as the engines
keep it) or at ``max_new_tokens``. Prompts are left-padded into one batch with an attention
mask and explicit position ids, so a short prompt's first real token sits at position 0 just
as it would alone. Draws come from ``generator`` only (never the global RNG) on the CPU, so a
run is reproducible and leaves torch's global state alone. ``temperature == 0`` is greedy.

This serves the self-checks and tests; the rollout service's engines are the production path
(they stream tokens, migrate and seed per position). It is deliberately plain sampling: no
top-k or top-p, so the log-probs the trainer computes are those of the sampling distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float,
    eos_ids: Sequence[int],
    pad_id: int,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Sample one response per prompt; see the module docstring for the rules."""
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    batch = len(prompts)
    ids = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long)
    done = torch.zeros(batch, dtype=torch.bool)
    out: list[list[int]] = [[] for _ in prompts]
    past = None
    step_ids = ids
    for _ in range(max_new_tokens):
        res = model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=past,
            use_cache=True,
        )
        past = res.past_key_values
        logits = res.logits[:, -1].float().cpu()
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        for i, tok in enumerate(nxt.tolist()):
            if not done[i]:
                out[i].append(tok)
        done |= torch.isin(nxt, eos)
        if bool(done.all()):
            break
        step_ids = nxt.to(device).unsqueeze(-1)
        mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=device)], dim=1)
        positions = positions[:, -1:] + 1
    return out
