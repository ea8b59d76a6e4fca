"""Log-probs and entropies of response tokens under the distribution they were sampled from.

Contract: rollout engines sample from ``softmax(logits / T)`` (pure temperature sampling, no
top-k or top-p), so the policy whose ratio and gradient the loss needs is that tempered
distribution, not ``softmax(logits)``. :func:`response_scores` scores every response token
under ``log_softmax(logits / T)``; the trainer must use it, at the run's temperature, for the
old log-probs, the new ones and the reference policy's alike, or the ratio and KL compare
different distributions. (veRL divides the logits by the rollout temperature the same way.)

``T = 0`` is greedy decoding: the sampling distribution is a point mass on the argmax, whose
log-prob is 0 for every generated token and has no gradient, so there is nothing to train on.
Such responses are scored at ``T = 1``, the model's own distribution (what engines report as
log-probs under greedy decoding); the run spec may allow ``T = 0`` for evaluation, and a
trainer that wants to refuse training on it can check :func:`logit_scale`'s input itself.

Dropout must be off while scoring, for the loss as much as for the old log-probs: with dropout
on, a ratio compares two random sub-networks and is not 1 even before any update, and the
gradient is that of a different policy than the one that generated the tokens. ``model.eval()``
turns dropout off without stopping gradients; :func:`dropout_off` does so for a block and
restores every module's previous mode afterwards.

Loss masks. A multi-turn response holds observation tokens the model did not sample
(:mod:`shared.turns`). With ``loss_masks`` :func:`response_scores` multiplies each response's
mask into the response positions it reads: the observation tokens stay in the forward (they
are context for every later token) but their log-probs and entropies are never taken, so every
loss term, count and denominator downstream covers trained tokens only, and no gradient can
reach an observation token's logits. Selecting rather than multiplying the losses by zero keeps
an unconstrained observation log-prob (never trained, it may drift far from the reference)
from turning ``0 * inf`` into NaN.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def logit_scale(temperature: float) -> float:
    """What the logits are multiplied by: ``1 / T``, or 1 for greedy ``T = 0`` (module doc)."""
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    return 1.0 if temperature == 0.0 else 1.0 / temperature


@contextmanager
def dropout_off(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Eval-mode behaviour (no dropout) with gradients still on; restores each module's mode."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training


@dataclass(frozen=True, slots=True)
class TokenScores:
    logprobs: list[torch.Tensor]  # per response: log-prob of each trained response token
    entropy: list[torch.Tensor] | None  # per response: entropy of each such token's distribution


def response_scores(
    model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]], pad_id: int,
    *, temperature: float = 1.0, entropy: bool = False,
    loss_masks: list[list[int]] | None = None,
) -> TokenScores:
    """Score each response token given its prompt and the response tokens before it.

    One batched forward over right-padded ``prompt + response`` rows (padding never shifts a
    real token, so position ids are a plain ``arange``). Returns one 1-D tensor per response of
    length ``len(response)``, or with ``loss_masks`` (one 0/1 per response token) of the
    tokens whose mask is 1, in order (module doc); carrying grad when grad is enabled;
    half-precision logits are upcast to float32 first. The caller sets dropout (see
    :func:`dropout_off`).
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if loss_masks is not None and [len(m) for m in loss_masks] != [len(r) for r in responses]:
        raise ValueError(f"loss mask lengths {[len(m) for m in loss_masks]} differ from the "
                         f"response lengths {[len(r) for r in responses]}")
    if not prompts:
        return TokenScores([], [] if entropy else None)
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token to condition on")
    scale = logit_scale(temperature)
    seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
    device = next(model.parameters()).device
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(seqs), width), dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long, device=device)
        mask[i, : len(s)] = 1
    positions = torch.arange(width, device=device).unsqueeze(0).expand(len(seqs), -1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    # Logits at t predict token t + 1. A log_softmax in bf16 loses the small probability
    # differences a ratio is made of, hence the upcast.
    shifted = logits[:, :-1]
    if shifted.dtype in (torch.float16, torch.bfloat16):
        shifted = shifted.float()
    if scale != 1.0:
        shifted = shifted * scale
    logp = F.log_softmax(shifted, dim=-1)
    token_logp = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    out: list[torch.Tensor] = []
    ent: list[torch.Tensor] = []
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        rows: slice | torch.Tensor = slice(len(p) - 1, len(p) - 1 + len(r))
        if loss_masks is not None:
            # The response's positions times its loss mask: the trained positions only.
            keep = torch.tensor(loss_masks[i], dtype=torch.bool, device=device)
            rows = torch.arange(len(p) - 1, len(p) - 1 + len(r), device=device)[keep]
        out.append(token_logp[i, rows])
        if entropy:
            # Only the response positions: H = -sum_v p_v log p_v of the tempered distribution.
            lp = logp[i, rows]
            ent.append(-(lp.exp() * lp).sum(-1))
    return TokenScores(out, ent if entropy else None)


def response_logprobs(
    model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]], pad_id: int,
    temperature: float = 1.0, loss_masks: list[list[int]] | None = None,
) -> list[torch.Tensor]:
    """Just the log-probs of :func:`response_scores`."""
    return response_scores(model, prompts, responses, pad_id, temperature=temperature,
                           loss_masks=loss_masks).logprobs
