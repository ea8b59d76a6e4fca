"""Training statistics for a step record, kept as sums so they stream and merge.

Contract: a :class:`TrainStats` holds only sums, counts and maxima, so the stats of a step are
the :meth:`TrainStats.merge` of its groups' (and its ranks') stats in any order, and
:meth:`TrainStats.summary` turns them into the step record's fields:

- ``kl``: token mean of the configured KL estimator against the reference policy, over every
  token of every optimizer pass; absent when no reference policy was scored.
- ``entropy``: token mean of the policy's entropy at the sampling temperature, over the same
  tokens; absent when entropy was not computed.
- ``clip_fraction``: share of those tokens whose clipped branch was taken (its gradient is
  zero), as veRL's ``pg_clipfrac``. On the first pass of a step the ratio is 1 and nothing
  clips; it is non-zero only with several updates per step.
- ``off_policy_weight``, ``off_policy_capped_fraction``, ``behaviour_log_ratio_abs``: with an
  off-policy correction, the token mean of its weight, the share of tokens its cap changed, and
  the token mean of ``|log pi_prox - log mu|`` (:mod:`~trainer_svc.learn.algorithms.off_policy`),
  over the same tokens as ``clip_fraction``.
- ``advantage_mean`` / ``advantage_std``: over response tokens (each token's advantage, the
  population std), counted once per step, not once per pass.
- ``response_len_mean`` / ``response_len_max`` and ``truncated_fraction``: over responses.

``grad_norm`` is not here: it comes from the optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch


@dataclass(slots=True)
class TrainStats:
    # loss side: summed over every optimizer pass
    loss_tokens: int = 0  # tokens that entered a loss
    clipped_tokens: int = 0  # of those, tokens on the clipped (flat) branch
    kl_sum: float = 0.0  # sum of per-token KL estimates
    kl_tokens: int = 0  # tokens with a KL estimate
    entropy_sum: float = 0.0  # sum of per-token entropies
    entropy_tokens: int = 0  # tokens with an entropy
    behaviour_tokens: int = 0  # tokens with an off-policy weight (algorithms.off_policy)
    behaviour_weight_sum: float = 0.0
    behaviour_capped: int = 0  # of those, tokens whose weight the cap changed
    behaviour_log_ratio_abs_sum: float = 0.0  # sum of |log pi_prox - log mu|
    # data side: once per step
    responses: int = 0
    truncated: int = 0  # responses that ran out of budget
    len_sum: int = 0
    len_max: int = 0
    adv_tokens: int = 0
    adv_sum: float = 0.0
    adv_sq_sum: float = 0.0

    def merge(self, other: TrainStats) -> TrainStats:
        """Add ``other`` into this one (maxima take the larger); returns self."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, max(mine, theirs) if f.name == "len_max" else mine + theirs)
        return self

    def summary(self) -> dict[str, float]:
        """The step record's statistics; a statistic with nothing measured is left out."""
        out: dict[str, float] = {}
        if self.kl_tokens:
            out["kl"] = self.kl_sum / self.kl_tokens
        if self.entropy_tokens:
            out["entropy"] = self.entropy_sum / self.entropy_tokens
        if self.loss_tokens:
            out["clip_fraction"] = self.clipped_tokens / self.loss_tokens
        if self.behaviour_tokens:
            out["off_policy_weight"] = self.behaviour_weight_sum / self.behaviour_tokens
            out["off_policy_capped_fraction"] = self.behaviour_capped / self.behaviour_tokens
            out["behaviour_log_ratio_abs"] = (self.behaviour_log_ratio_abs_sum
                                              / self.behaviour_tokens)
        if self.adv_tokens:
            mean = self.adv_sum / self.adv_tokens
            out["advantage_mean"] = mean
            out["advantage_std"] = math.sqrt(max(0.0, self.adv_sq_sum / self.adv_tokens - mean**2))
        if self.responses:
            out["response_len_mean"] = self.len_sum / self.responses
            out["response_len_max"] = float(self.len_max)
            out["truncated_fraction"] = self.truncated / self.responses
        return out


def response_stats(lengths: Sequence[int], truncated: Sequence[bool],
                   advantages: Sequence[torch.Tensor]) -> TrainStats:
    """The data-side statistics of some responses, with their final per-token advantages."""
    if not len(lengths) == len(truncated) == len(advantages):
        raise ValueError("lengths, truncated flags and advantages differ in count")
    flat = torch.cat([a.detach().reshape(-1).to(torch.float64) for a in advantages]) \
        if advantages else torch.zeros(0, dtype=torch.float64)
    return TrainStats(
        responses=len(lengths), truncated=sum(bool(t) for t in truncated),
        len_sum=sum(lengths), len_max=max(lengths, default=0),
        adv_tokens=int(flat.numel()), adv_sum=float(flat.sum()),
        adv_sq_sum=float((flat * flat).sum()),
    )
