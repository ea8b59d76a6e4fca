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
