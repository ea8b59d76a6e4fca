"""Per-token policy losses, the KL and entropy terms, and how they stream into a step loss.

Contract: inputs are ragged lists, one 1-D tensor per response, one value per response token:
``new`` log-probs (carrying grad), ``old`` log-probs (treated as constants; the policy that
generated the responses, scored at the same temperature), final ``advantages`` (constants), and
optionally ``ref`` log-probs of the frozen reference policy and per-token ``entropy``.
:func:`objective` turns them into an :class:`Objective`: the partial sum to backpropagate now,
the :class:`AggCounts` its step-level denominator is made of, and detached statistics. For a
multi-turn response "response token" means a trained one: the trainer scores through the
response's loss mask (:mod:`~trainer_svc.learn.algorithms.logprobs`), so no observation token
reaches anything here, and every count and denominator below is over trained tokens.

Streaming. Every ``loss_agg`` mode is ``sum over groups of partial_sum(group) / denominator``,
where :func:`partial_sum` needs only the group's own per-token losses and :func:`denominator`
needs only the step's counts (added up over groups, and ranks, as they arrive). A trainer
backpropagates each group's partial sum the moment the group is scored and divides the
accumulated gradient once, at the barrier; by linearity that equals :func:`aggregate` over the
whole step exactly (tested in float64). For per-token losses ``l[i][t]`` of responses
i = 1..N with lengths ``L_i``:

    token_mean              sum_i sum_t l[i][t]            / sum_i L_i
    seq_mean_token_sum      sum_i sum_t l[i][t]            / N
    seq_mean_token_mean     sum_i (sum_t l[i][t]) / L_i    / N
    seq_mean_token_sum_norm sum_i sum_t l[i][t]            / (N * norm_len)

These are veRL's ``agg_loss`` modes as of veRL 0.9.1 (tested against it where installed; its
``seq-mean-token-mean`` adds 1e-8 to each length, a relative difference below 1e-8). The last is
Dr. GRPO's: a per-response token sum over a constant, then the mean over responses (older veRL
trees returned ``sum / norm_len`` and left N to the caller's gradient-accumulation scale).
``norm_len`` is a constant of the run (Dr. GRPO: the generation budget, ``max_new_tokens``),
never the longest response of a batch, so the loss scale does not depend on how the step was
batched. As in veRL, responses with no tokens count towards no ``N``.

The per-token loss is ``pg + kl_coef * kl - entropy_coef * entropy``, each term aggregated with
the same ``loss_agg`` mode (as veRL's actor does), where ``pg`` is:

- ``token_clip`` (PPO; GRPO; DAPO eq. 8 with eps_low / eps_high):
  ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`` with ``r = exp(new - old)`` per token.
  No dual clip (veRL adds one at 3 for negative advantages; it is in none of these papers).
- ``sequence_clip`` (GSPO, Zheng et al. 2025): the sequence ratio is the geometric mean of the
  token ratios, ``s_i = exp(mean_t(new - old))`` (eq. 7), clipped per response. It is applied
  in the paper's GSPO-token form: ``s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]``, whose value is
  ``s_i`` at every token and whose gradient is ``s_i * grad log pi(y_t)``. Aggregated with
  ``seq_mean_token_mean`` this equals eq. 5, ``-(1/G) sum_i min(s_i A_i, clip(s_i) A_i)``, in
  value and gradient; other modes weigh responses differently but keep the sequence-level
  ratio and clip.

KL estimators of KL(pi || pi_ref) from a sample of pi (Schulman, "Approximating KL
Divergence", 2020), with ``d = new - ref``: k1 = ``d``; k2 = ``d^2 / 2``; k3 =
``exp(-d) + d - 1``. Which divergence each one's *gradient* follows as a loss term is in
:mod:`shared.algorithm` (k1's is zero in expectation, so it is refused there).

The log-ratio clamp. Every exponentiated difference is clamped to :data:`LOG_RATIO_CLAMP`
(20, veRL's bound on the PPO log-ratio) first: in float32 ``exp`` overflows to inf above ~88,
and one inf token makes the loss inf and, through ``maximum`` or ``0 * inf``, the gradient NaN,
which the optimizer step spreads to every weight. Within the bound nothing changes (the float64
references use the unclamped formulas); beyond it:

- the policy ratio, ``r = exp(clamp(new - old))``, and GSPO's ``s_i``: the clamp is applied
  to the whole log-ratio, so a token (GSPO: a response) past +-20 has the constant ratio
  ``e^+-20`` and no gradient. ``e^20`` is 4.9e8, far beyond any clip range, so the clip has
  already made that gradient zero for one sign of the advantage; ``e^-20`` is 2e-9, so the
  gradient lost on that side is at most 2e-9 |A|.
- k3: ``d`` is clamped below at -20 only, where ``exp(-d)`` overflows; above, ``exp(-d)``
  only underflows towards 0 and k3 stays exact (its gradient ``1 - exp(-d)`` tends to 1, which
  keeps pulling a policy that has run far ahead of the reference back). Below -20 the token's
  k3 is the constant ``e^20 - 21`` with no gradient.
- :func:`first_pass_parts` exponentiates ``new - sg(new)``, which is 0.

:func:`first_pass_parts` serves batch-scope estimators: while the ratio is exactly 1 (the first
pass, before any update), the policy-gradient loss is linear in the advantage, so a group can be
backpropagated before the barrier as two sums whose combination the barrier's whitening fixes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.algorithm import AlgorithmConfig, KlEstimator, LossAgg, OffPolicy, PolicyLoss

# LOG_RATIO_CLAMP is defined beside the off-policy weights, which share it (re-exported).
from trainer_svc.learn.algorithms.off_policy import LOG_RATIO_CLAMP as LOG_RATIO_CLAMP
from trainer_svc.learn.algorithms.off_policy import Weights
from trainer_svc.learn.algorithms.stats import TrainStats

# --- aggregation -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AggCounts:
    """What the denominators are made of; adds up over groups (and over ranks)."""

    tokens: int = 0  # response tokens
    sequences: int = 0  # responses with at least one token

    def __add__(self, other: AggCounts) -> AggCounts:
        return AggCounts(self.tokens + other.tokens, self.sequences + other.sequences)

    @classmethod
    def of(cls, lengths: Sequence[int]) -> AggCounts:
        return cls(sum(lengths), sum(1 for n in lengths if n > 0))


def partial_sum(token_losses: Sequence[torch.Tensor], mode: LossAgg) -> torch.Tensor:
    """One group's (or any set of responses') share of the numerator; carries grad."""
    if not token_losses:
        raise ValueError("no responses to aggregate")
    if mode is LossAgg.SEQ_MEAN_TOKEN_MEAN:
        terms = [t.sum() / t.numel() for t in token_losses if t.numel()]
        return torch.stack(terms).sum() if terms else token_losses[0].new_zeros(())
    return torch.cat([t.reshape(-1) for t in token_losses]).sum()


def denominator(mode: LossAgg, counts: AggCounts, norm_len: int | None = None) -> float:
    """The step-level divisor; 1.0 for a step with nothing in it (its numerator is 0)."""
    match mode:
        case LossAgg.TOKEN_MEAN:
            value = float(counts.tokens)
        case LossAgg.SEQ_MEAN_TOKEN_SUM | LossAgg.SEQ_MEAN_TOKEN_MEAN:
            value = float(counts.sequences)
        case LossAgg.SEQ_MEAN_TOKEN_SUM_NORM:
            if norm_len is None or norm_len < 1:
                raise ValueError("seq_mean_token_sum_norm needs a positive norm_len "
                                 "(the run's max_new_tokens)")
            value = float(counts.sequences * norm_len)
    return value if value > 0 else 1.0


def aggregate(token_losses: Sequence[torch.Tensor], mode: LossAgg,
              norm_len: int | None = None) -> torch.Tensor:
    """The batch computation: every response at once."""
    counts = AggCounts.of([int(t.numel()) for t in token_losses])
    return partial_sum(token_losses, mode) / denominator(mode, counts, norm_len)


# --- per-token terms -----------------------------------------------------------------------


def _flat(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([r.reshape(-1) for r in rows])


def _split(flat: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    return list(torch.split(flat, lengths))


def _check(name: str, rows: Sequence[torch.Tensor], lengths: list[int]) -> None:
    got = [int(r.numel()) for r in rows]
    if got != lengths:
        raise ValueError(f"{name} lengths {got} differ from the log-prob lengths {lengths}")


def kl_estimate(new: torch.Tensor, ref: torch.Tensor, estimator: KlEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) for tokens sampled from pi; grad flows via ``new``."""
    d = new - ref.detach().to(new.dtype)
    match estimator:
        case KlEstimator.K1:
            return d
        case KlEstimator.K2:
            return 0.5 * d * d
        case KlEstimator.K3:
            d = d.clamp(min=-LOG_RATIO_CLAMP)  # exp(-d) overflows only below (module doc)
            return torch.exp(-d) + d - 1.0


def _sequence_log_ratio(log_ratio: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Each token's response-mean log-ratio, detached (GSPO's log s_i, eq. 7)."""
    lens = torch.tensor(lengths, device=log_ratio.device)
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=log_ratio.device), lens)
    sums = log_ratio.new_zeros(len(lengths)).index_add_(0, seg, log_ratio.detach())
    means = sums / lens.clamp(min=1).to(log_ratio.dtype)
    return means[seg]


def policy_token_losses(
    policy: PolicyLoss, new: Sequence[torch.Tensor], old: Sequence[torch.Tensor],
    advantages: Sequence[torch.Tensor], clip_low: float, clip_high: float,
    weights: Sequence[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-token policy-gradient losses and per-token "clipped branch taken" flags; each
    token's loss times its off-policy weight, where ``weights`` are given
    (:mod:`~trainer_svc.learn.algorithms.off_policy`)."""
    lengths = [int(t.numel()) for t in new]
    _check("old log-prob", old, lengths)
    _check("advantage", advantages, lengths)
    if weights is not None:
        _check("off-policy weight", weights, lengths)
    if not lengths or sum(lengths) == 0:
        empty = [t.reshape(-1) * 0 for t in new]
        return empty, [t.new_zeros(t.numel(), dtype=torch.bool) for t in new]
    flat_new = _flat(new)
    adv = _flat(advantages).detach().to(flat_new.dtype)
    log_ratio = flat_new - _flat(old).detach().to(flat_new.dtype)
    if policy is PolicyLoss.SEQUENCE_CLIP:
        log_ratio = flat_new - flat_new.detach() + _sequence_log_ratio(log_ratio, lengths)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if weights is not None:
        loss = loss * _flat(weights).detach().to(loss.dtype)
    return _split(loss, lengths), _split(clipped > unclipped, lengths)


@dataclass(frozen=True, slots=True)
class Objective:
    """Some responses' share of the step loss: the step loss is ``sum(partial) / denominator``."""

    partial: torch.Tensor  # numerator share; backpropagate it as soon as it is computed
    counts: AggCounts  # what these responses add to the step's denominator
    stats: TrainStats  # detached loss-side statistics of these tokens


def objective(
    cfg: AlgorithmConfig, new: Sequence[torch.Tensor], old: Sequence[torch.Tensor],
    advantages: Sequence[torch.Tensor], *, ref: Sequence[torch.Tensor] | None = None,
    entropy: Sequence[torch.Tensor] | None = None, weights: Weights | None = None,
) -> Objective:
    """The configured objective over some responses (a group, a mini-batch or a whole step).
    ``weights``: the off-policy correction's, from ``old``
    (:func:`~trainer_svc.learn.algorithms.off_policy.behaviour_weights`); needed unless
    ``cfg.off_policy`` is none."""
    if not new:
        raise ValueError("no responses")
    if (weights is None) != (cfg.off_policy is OffPolicy.NONE):
        raise ValueError(f"off_policy {cfg.off_policy.value} needs weights exactly when it "
                         "is not none")
    lengths = [int(t.numel()) for t in new]
    pg, flags = policy_token_losses(cfg.policy_loss, new, old, advantages,
                                    cfg.clip_ratio_low, cfg.clip_ratio_high,
                                    None if weights is None else weights.per_token)
    total = list(pg)
    stats = TrainStats(loss_tokens=sum(lengths),
                       clipped_tokens=int(sum(int(f.sum()) for f in flags)))
    if weights is not None:
        stats.behaviour_tokens, stats.behaviour_weight_sum = weights.tokens, weights.weight_sum
        stats.behaviour_capped = weights.capped
        stats.behaviour_log_ratio_abs_sum = weights.log_ratio_abs_sum
    if cfg.kl_coef > 0.0 and ref is None:
        raise ValueError("kl_coef > 0 needs the reference policy's log-probs")
    if ref is not None:
        _check("reference log-prob", ref, lengths)
        kl = [kl_estimate(n, r, cfg.kl_estimator) for n, r in zip(new, ref, strict=True)]
        stats.kl_sum = float(sum(float(k.detach().sum()) for k in kl))
        stats.kl_tokens = sum(lengths)
        if cfg.kl_coef > 0.0:
            total = [t + cfg.kl_coef * k for t, k in zip(total, kl, strict=True)]
    if cfg.entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs per-token entropies")
    if entropy is not None:
        _check("entropy", entropy, lengths)
        stats.entropy_sum = float(sum(float(h.detach().sum()) for h in entropy))
        stats.entropy_tokens = sum(lengths)
        if cfg.entropy_coef != 0.0:
            total = [t - cfg.entropy_coef * h.to(t.dtype)
                     for t, h in zip(total, entropy, strict=True)]
    return Objective(partial_sum(total, cfg.loss_agg), AggCounts.of(lengths), stats)


def first_pass_parts(new: Sequence[torch.Tensor], raw_advantages: Sequence[torch.Tensor],
                     mode: LossAgg, weights: Weights | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P_adv, P_one)`` for responses whose old log-probs equal ``new`` (ratio exactly 1).

    There both policy losses reduce to ``-A * rho`` per token with ``rho = exp(new - sg(new))``
    (value 1, gradient ``grad log pi``): the clip cannot bind at 1. With final advantages
    ``A = (raw - mean) * scale`` the policy-gradient partial sum is therefore
    ``scale * (P_adv - mean * P_one)`` in value and gradient, where ``P_adv`` and ``P_one`` use
    only the raw advantages. A trainer can backpropagate ``P_adv`` and ``P_one`` into two
    gradient buffers as groups arrive and combine them once the barrier fixes ``mean`` and
    ``scale``: two backward passes before the barrier instead of one after it. The KL and
    entropy terms do not involve the advantage and stream through :func:`objective` as usual.
    """
    lengths = [int(t.numel()) for t in new]
    _check("advantage", raw_advantages, lengths)
    rho = [torch.exp(t - t.detach()) for t in new]
    if weights is not None:  # an off-policy weight is a constant factor per token: still linear
        _check("off-policy weight", weights.per_token, lengths)
        rho = [r * w.detach().to(r.dtype) for r, w in zip(rho, weights.per_token, strict=True)]
    p_adv = partial_sum([-a.detach().to(r.dtype) * r for a, r in zip(raw_advantages, rho,
                                                                        strict=True)], mode)
    p_one = partial_sum([-r for r in rho], mode)
    return p_adv, p_one
