"""Off-policy corrections: weighting each token by how its behaviour policy differs.

Three policies score a sampled token: the *behaviour* policy ``mu`` that sampled it (the
engine's log-prob, committed with the token: ``Sample.behaviour_logprobs``), the *proximal*
policy ``pi_prox`` (the trainer's weights at the start of the step: the ``old`` log-probs every
objective already recomputes) and the policy being optimised, ``pi_theta``. Without a
correction the trainer takes ``pi_prox`` for ``mu``; they differ whenever the engine's numerics
differ from the trainer's (kernels, precision, a different framework: the mismatch Yao et al.
measure) or the tokens were sampled by an older version (asynchronous training).

Contract: :func:`behaviour_weights` gives one detached weight per token, from the proximal and
behaviour log-probs, clamped like every other exponentiated difference
(:data:`~trainer_svc.learn.algorithms.losses.LOG_RATIO_CLAMP`); the trainer hands them to
:func:`~trainer_svc.learn.algorithms.losses.objective` (and ``first_pass_parts``), which
multiply each token's policy-gradient term by its weight; the KL and entropy terms are not.
With ``w = exp(log pi_prox - log mu)``:

- ``tis``, truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework
  Secretly Brings You Off-Policy RL Training"; veRL's ``tis_imp_ratio_cap``): the token's
  PPO term ``max(-A r, -A clip(r))``, ``r = pi_theta / pi_prox``, is multiplied by
  ``min(w, C)`` (``off_policy_cap``, default 2).
- ``decoupled``, AReaL's decoupled PPO objective (Fu et al. 2025, arXiv 2505.24298, eq. 5):
  ``-(pi_prox / mu) * min(r A, clip(r, 1 - eps, 1 + eps) A)`` with ``r`` against the proximal
  policy, so the trust region is the proximal policy's, not the stale behaviour's. The weight is
  ``w`` itself; with a cap, a token whose ``w`` exceeds it gets no policy-gradient term
  (AReaL's ``behav_imp_weight_cap`` filters such tokens; here they stay in the loss's
  denominator, so the aggregation's counts never depend on the weights, which keeps the
  step loss streamable group by group).

With ``pi_prox`` recomputed every step, as here, the two share their form and differ in what
the cap does: TIS keeps an overweighted token at ``C``, decoupled drops it. ``none`` is weight 1
exactly (the multiplication is skipped), bit for bit the objective without this module.

Statistics (:class:`~trainer_svc.learn.algorithms.stats.TrainStats`): the mean weight, the
share of tokens the cap changed, and the mean ``|log pi_prox - log mu|`` (how far engine and
trainer disagree: the quantity to watch before choosing a correction).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.algorithm import OffPolicy

# Bound on every exponentiated log-ratio (losses' module doc), here and in the objective:
# exp(20) = 4.9e8 is finite in float32 (and bfloat16), whose exp overflows above ~88.7; veRL
# clamps the PPO log-ratio to +-20 too.
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True, slots=True)
class Weights:
    """Each response's per-token weights (detached) and what they amount to."""

    per_token: list[torch.Tensor]
    tokens: int  # tokens weighted
    weight_sum: float  # sum of the weights used
    capped: int  # tokens the cap changed (truncated, or dropped)
    log_ratio_abs_sum: float  # sum of |log pi_prox - log mu|


def behaviour_weights(policy: OffPolicy, cap: float | None, proximal: Sequence[torch.Tensor],
                      behaviour: Sequence[torch.Tensor]) -> Weights:
    """The per-token weights of ``policy`` (module doc); ``proximal`` and ``behaviour`` are
    per response, one log-prob per trained token each."""
    if policy is OffPolicy.NONE:
        raise ValueError("off_policy none has no weights")
    lengths = [int(t.numel()) for t in proximal]
    got = [int(t.numel()) for t in behaviour]
    if got != lengths:
        raise ValueError(f"behaviour log-prob lengths {got} differ from the log-prob "
                         f"lengths {lengths}")
    out: list[torch.Tensor] = []
    weight_sum, capped, abs_sum = 0.0, 0, 0.0
    for prox, mu in zip(proximal, behaviour, strict=True):
        prox = prox.detach()
        d = prox - mu.detach().to(prox.dtype)
        w = torch.exp(d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        if cap is not None:
            over = w > cap
            capped += int(over.sum())
            w = torch.where(over, w.new_tensor(cap) if policy is OffPolicy.TIS
                            else w.new_zeros(()), w)
        out.append(w)
        weight_sum += float(w.sum())
        abs_sum += float(d.abs().sum())
    return Weights(out, sum(lengths), weight_sum, capped, abs_sum)


def trained_behaviour(responses: Sequence[Sequence[int]],
                      behaviour: Sequence[Sequence[float]] | None,
                      loss_masks: Sequence[Sequence[int]] | None) -> list[list[float] | None]:
    """Each response's behaviour log-probs at its trained tokens (its loss mask's 1s); None
    where they are unknown (none given, or not one per token)."""
    out: list[list[float] | None] = []
    for i, response in enumerate(responses):
        given = behaviour[i] if behaviour is not None else []
        if len(given) != len(response) or not response:
            out.append(None)
            continue
        mask = loss_masks[i] if loss_masks is not None else None
        out.append(list(given) if mask is None else [b for b, m in zip(given, mask, strict=True)
                                                     if m])
    return out
