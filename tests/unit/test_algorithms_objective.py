"""The whole objective against a float64 reference written here, and the log-ratio clamp.

The reference is the per-token loss ``pg + kl_coef * kl - entropy_coef * H`` with each term
aggregated by the same ``loss_agg`` mode (veRL's actor; the module doc of
``trainer_svc.learn.algorithms.losses``), computed with ``math`` and loops, with its gradient
written out by hand. It catches what a test of each term alone cannot: a sign flip of the KL or
entropy term, or a coefficient applied twice.

The clamp: a float32 log-ratio past ~88 overflows ``exp`` to inf, and the gradient to NaN.
Past ``LOG_RATIO_CLAMP`` every objective must stay finite in value and gradient.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from shared.algorithm import AlgorithmConfig, KlEstimator, LossAgg
from trainer_svc.learn.algorithms import losses
from trainer_svc.learn.algorithms.losses import LOG_RATIO_CLAMP, denominator

NORM_LEN = 8
C = LOG_RATIO_CLAMP


def _rows(rows: list[list[float]], dtype: torch.dtype, grad: bool = False
          ) -> list[torch.Tensor]:
    return [torch.tensor(r, dtype=dtype, requires_grad=grad) for r in rows]


def _step_loss(cfg: AlgorithmConfig, new: list[torch.Tensor], old: list[torch.Tensor],
               adv: list[float], ref: list[torch.Tensor] | None = None,
               ent: list[torch.Tensor] | None = None) -> torch.Tensor:
    a = [torch.full_like(n, x).detach() for n, x in zip(new, adv, strict=True)]
    part = losses.objective(cfg, new, old, a, ref=ref, entropy=ent)
    return part.partial / denominator(cfg.loss_agg, part.counts, NORM_LEN)


# --- the clamp ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(LossAgg))
@pytest.mark.parametrize("algorithm", ["grpo", "gspo"])
def test_a_huge_float32_log_ratio_gives_a_finite_loss_and_gradient(algorithm: str,
                                                                    mode: LossAgg) -> None:
    # Log-ratios of +-100 and beyond, each sign of advantage and zero, and a reference that is
    # 100 nats away either side: every exp in the objective would overflow unclamped.
    assert math.isinf(float(torch.exp(torch.tensor(100.0, dtype=torch.float32))))
    new_rows = [[-0.5, -1.0, -0.2], [-0.1, -3.0], [-2.0, -0.7], [-1.5]]
    shift = [[100.0, 0.1, -100.0], [95.0, 89.0], [-0.3, 0.2], [300.0]]
    old_rows = [[n - s for n, s in zip(rn, rs, strict=True)]
                for rn, rs in zip(new_rows, shift, strict=True)]
    kl_d = [[-100.0, 100.0, 0.0], [-95.0, 0.4], [0.0, -0.5], [-120.0]]  # d = new - ref
    ref_rows = [[n - d for n, d in zip(rn, rd, strict=True)]
                for rn, rd in zip(new_rows, kl_d, strict=True)]
    cfg = AlgorithmConfig.for_algorithm(algorithm, loss_agg=mode, kl_coef=0.1,
                                        kl_estimator="k3", entropy_coef=0.01)
    for adv in ([1.0, -1.0, 0.0, 2.0], [-1.0, 1.0, 0.5, -2.0]):
        new = _rows(new_rows, torch.float32, grad=True)
        ent = _rows([[0.3] * len(r) for r in new_rows], torch.float32, grad=True)
        loss = _step_loss(cfg, new, _rows(old_rows, torch.float32), adv,
                          ref=_rows(ref_rows, torch.float32), ent=ent)
        assert math.isfinite(float(loss.detach()))
        loss.backward()
        for leaf in new + ent:
            assert leaf.grad is not None and bool(torch.isfinite(leaf.grad).all()), leaf.grad


def test_past_the_clamp_a_token_has_the_bounded_ratio_and_no_gradient() -> None:
    """Float64, one token each side of the bound, negative advantage (the unclipped branch)."""
    cfg = AlgorithmConfig.for_algorithm("grpo", loss_agg="seq_mean_token_sum")
    for shift, ratio, slope in ((C + 10.0, math.exp(C), 0.0), (C - 0.5, math.exp(C - 0.5),
                                                                 math.exp(C - 0.5))):
        new = _rows([[-1.0]], torch.float64, grad=True)
        loss = _step_loss(cfg, new, _rows([[-1.0 - shift]], torch.float64), [-1.0])
        loss.backward()
        assert float(loss.detach()) == pytest.approx(ratio, rel=1e-13)  # -A r with A = -1
        assert new[0].grad is not None
        assert float(new[0].grad[0]) == pytest.approx(slope, rel=1e-13)


def test_k3_is_clamped_below_only() -> None:
    """Below -C exp(-d) would overflow: constant there; above, k3 stays exact."""
    d = [-(C + 10.0), -(C - 1.0), C + 10.0, 50.0]
    new = torch.zeros(len(d), dtype=torch.float64, requires_grad=True)
    out = losses.kl_estimate(new, torch.tensor([-x for x in d], dtype=torch.float64),
                             KlEstimator.K3)
    out.sum().backward()
    assert new.grad is not None
    want = [(math.exp(C) - C - 1.0, 0.0)] + [(math.exp(-x) + x - 1.0, 1.0 - math.exp(-x))
                                             for x in d[1:]]
    for i, (value, slope) in enumerate(want):
        assert float(out.detach()[i]) == pytest.approx(value, rel=1e-13)
        assert float(new.grad[i]) == pytest.approx(slope, rel=1e-13)


# --- the whole objective -------------------------------------------------------------------

Rows = list[list[float]]


def _weights(lengths: list[int], mode: LossAgg) -> list[float]:
    """Per response, the weight of each of its tokens in the step loss (veRL's agg_loss):
    token_mean 1/T; seq_mean_token_sum 1/N; seq_mean_token_mean 1/(N L_i);
    seq_mean_token_sum_norm 1/(N norm_len); N counts responses with a token."""
    n = sum(1 for k in lengths if k)
    match mode:
        case LossAgg.TOKEN_MEAN:
            return [1.0 / sum(lengths)] * len(lengths)
        case LossAgg.SEQ_MEAN_TOKEN_SUM:
            return [1.0 / n] * len(lengths)
        case LossAgg.SEQ_MEAN_TOKEN_MEAN:
            return [1.0 / (n * k) if k else 0.0 for k in lengths]
        case LossAgg.SEQ_MEAN_TOKEN_SUM_NORM:
            return [1.0 / (n * NORM_LEN)] * len(lengths)


def ref_objective(cfg: AlgorithmConfig, kl_coef: float, entropy_coef: float, new: Rows,
                  old: Rows, adv: list[float], ref: Rows, ent: Rows
                  ) -> tuple[float, Rows, Rows]:
    """``sum w (pg + kl_coef k - entropy_coef H)`` and its gradient in ``new`` and ``H``.

    pg per token: ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`` (DAPO eq. 8; PPO/GRPO
    with equal bounds), ``r = exp(new - old)``; for GSPO ``r`` is the response's
    ``s = exp(mean_t(new - old))`` (eq. 7) at every token, whose gradient in token t's
    log-prob is ``s`` (the GSPO-token form). Where the clip binds in the direction the
    advantage pushes the term is flat. k (Schulman 2020, d = new - ref): k2 ``d^2 / 2``,
    slope ``d``; k3 ``exp(-d) + d - 1``, slope ``1 - exp(-d)``.
    """
    lo, hi = 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high
    w = _weights([len(r) for r in new], cfg.loss_agg)
    total, g_new, g_ent = 0.0, [], []
    for i, row in enumerate(new):
        seq = math.exp(sum(n - o for n, o in zip(row, old[i], strict=True)) / max(1, len(row)))
        gn, ge = [], []
        for t, x in enumerate(row):
            r = seq if cfg.algorithm.value == "gspo" else math.exp(x - old[i][t])
            pg = -min(r * adv[i], min(max(r, lo), hi) * adv[i])
            flat = (adv[i] > 0 and r > hi) or (adv[i] < 0 and r < lo)
            d = x - ref[i][t]
            if cfg.kl_estimator is KlEstimator.K2:
                k, dk = 0.5 * d * d, d
            else:
                k, dk = math.exp(-d) + d - 1.0, 1.0 - math.exp(-d)
            total += w[i] * (pg + kl_coef * k - entropy_coef * ent[i][t])
            gn.append(w[i] * ((0.0 if flat else -adv[i] * r) + kl_coef * dk))
            ge.append(-w[i] * entropy_coef)
        g_new.append(gn)
        g_ent.append(ge)
    return total, g_new, g_ent


def _objective_case(spread: float) -> tuple[Rows, Rows, list[float], Rows, Rows]:
    rng = random.Random(11)
    lengths = [3, 7, 1, 5, 0, 4, 6, 2]  # one empty response: it counts towards no N
    new = [[-rng.uniform(0.05, 3.0) for _ in range(k)] for k in lengths]
    old = [[x - rng.uniform(-spread, spread) for x in r] for r in new]
    ref = [[x - rng.uniform(-0.8, 0.8) for x in r] for r in new]
    ent = [[rng.uniform(0.1, 2.0) for _ in range(k)] for k in lengths]
    adv = [rng.uniform(-2.0, 2.0) for _ in lengths]
    return new, old, adv, ref, ent


@pytest.mark.parametrize("estimator", [KlEstimator.K2, KlEstimator.K3])
@pytest.mark.parametrize("mode", list(LossAgg))
@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "gspo"])
def test_the_objective_equals_its_float64_reference(algorithm: str, mode: LossAgg,
                                                    estimator: KlEstimator) -> None:
    kl_coef, entropy_coef = 0.3, 0.05
    cfg = AlgorithmConfig.for_algorithm(algorithm, loss_agg=mode, kl_coef=kl_coef,
                                        kl_estimator=estimator, entropy_coef=entropy_coef)
    new_rows, old, adv, ref, ent_rows = _objective_case(0.003 if algorithm == "gspo" else 0.6)
    new = _rows(new_rows, torch.float64, grad=True)
    ent = _rows(ent_rows, torch.float64, grad=True)
    loss = _step_loss(cfg, new, _rows(old, torch.float64), adv, ref=_rows(ref, torch.float64),
                      ent=ent)
    loss.backward()
    got_new = [_grad(t).tolist() for t in new]
    got_ent = [_grad(t).tolist() for t in ent]
    want, want_new, want_ent = ref_objective(cfg, kl_coef, entropy_coef, new_rows, old, adv,
                                             ref, ent_rows)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-12, abs=1e-14)
    for g, r in zip(got_new + got_ent, want_new + want_ent, strict=True):
        assert g == pytest.approx(r, rel=1e-10, abs=1e-14)
    # The comparison can fail: a KL or entropy term of the wrong sign, or kl_coef applied
    # twice, moves the value or the gradient far beyond the tolerances above.
    for wrong in ((-kl_coef, entropy_coef), (kl_coef, -entropy_coef), (2 * kl_coef,
                                                                        entropy_coef)):
        value, g_new, g_ent = ref_objective(cfg, *wrong, new_rows, old, adv, ref, ent_rows)
        gap = max(abs(a - b) for ga, gb in zip(got_new + got_ent, g_new + g_ent, strict=True)
                  for a, b in zip(ga, gb, strict=True))
        assert abs(value - want) > 1e-4 and gap > 1e-4, wrong


def _grad(t: torch.Tensor) -> torch.Tensor:
    if t.grad is None and t.numel() == 0:  # an empty response may be skipped altogether
        return torch.zeros_like(t)
    assert t.grad is not None
    return t.grad


# --- which divergence each KL estimator's gradient follows ---------------------------------


def test_each_estimators_expected_gradient_as_a_loss_term() -> None:
    """Exactly, on a categorical policy pi = softmax(theta) sampled on-policy: the expected
    gradient ``sum_y sg(pi(y)) grad k(y)`` (the sample's probability is not differentiated) is
    0 for k1, grad KL(pi || ref) for k2 and grad KL(ref || pi) for k3 (shared.algorithm)."""
    theta = torch.tensor([0.3, -1.2, 0.8, 0.0, 2.1], dtype=torch.float64, requires_grad=True)
    log_ref = torch.log_softmax(torch.tensor([1.0, 0.2, -0.5, 0.7, 0.1],
                                             dtype=torch.float64), 0)
    ref = log_ref.exp()

    def expected_grad(estimator: KlEstimator) -> torch.Tensor:
        log_pi = torch.log_softmax(theta, 0)
        k = losses.kl_estimate(log_pi, log_ref, estimator)
        return torch.autograd.grad((log_pi.exp().detach() * k).sum(), theta)[0]

    log_pi = torch.log_softmax(theta, 0)
    reverse = torch.autograd.grad((log_pi.exp() * (log_pi - log_ref)).sum(), theta)[0]
    log_pi = torch.log_softmax(theta, 0)
    forward = torch.autograd.grad((ref * (log_ref - log_pi)).sum(), theta)[0]
    torch.testing.assert_close(expected_grad(KlEstimator.K1), torch.zeros_like(theta),
                               rtol=0, atol=1e-15)
    torch.testing.assert_close(expected_grad(KlEstimator.K2), reverse, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(expected_grad(KlEstimator.K3), forward, rtol=1e-12, atol=1e-15)
    assert float((reverse - forward).abs().max()) > 0.05  # the two divergences differ here
