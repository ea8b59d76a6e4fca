"""The off-policy corrections against a float64 reference written here, token by token.

References (trainer_svc.learn.algorithms.off_policy):

- TIS (Yao et al. 2025): per token ``min(w, C) * max(-A r, -A clip(r, 1 - el, 1 + eh))`` with
  ``w = pi_prox / mu`` and ``r = pi_theta / pi_prox``;
- decoupled PPO (Fu et al. 2025, AReaL, eq. 5): ``w * max(-A r, -A clip(r))``, ``r`` against
  the proximal policy; with a cap, ``w > cap`` drops the token's term (it stays counted).

Gradients are written out by hand: ``d/d log pi_theta`` of the unclipped branch is ``-A r``,
of the clipped one 0. The trainer's path is tested too: a step whose behaviour log-probs equal
the proximal ones updates the weights exactly as one without a correction, and a shifted one
does not.
"""

from __future__ import annotations

import math

import pytest
import torch

from shared.algorithm import AlgorithmConfig, AlgorithmConfigError, OffPolicy
from trainer_svc.learn.algorithms import losses
from trainer_svc.learn.algorithms.losses import denominator
from trainer_svc.learn.algorithms.off_policy import behaviour_weights, trained_behaviour

NEW = [[-0.5, -1.0, -0.2], [-0.1, -3.0], [-2.0, -0.7, -0.4, -1.1]]
OLD = [[-0.6, -0.9, -0.2], [-0.35, -2.9], [-1.8, -0.7, -0.9, -1.0]]  # proximal
MU = [[-0.3, -2.5, -0.2], [-0.3, -2.9], [-4.0, -0.6, -0.9, -0.2]]  # behaviour
ADV = [1.0, -0.5, 2.0]
CLIP = 0.2


def rows(values: list[list[float]], grad: bool = False) -> list[torch.Tensor]:
    return [torch.tensor(r, dtype=torch.float64, requires_grad=grad) for r in values]


def reference(policy: OffPolicy, cap: float | None) -> tuple[float, list[list[float]]]:
    """Token-mean loss and its gradient with respect to each new log-prob."""
    losses_, grads = 0.0, []
    tokens = sum(len(r) for r in NEW)
    for new, old, mu, a in zip(NEW, OLD, MU, ADV, strict=True):
        g_row = []
        for n, o, m in zip(new, old, mu, strict=True):
            w = math.exp(o - m)
            if cap is not None and w > cap:
                w = cap if policy is OffPolicy.TIS else 0.0
            r = math.exp(n - o)
            unclipped, clipped = -a * r, -a * min(max(r, 1 - CLIP), 1 + CLIP)
            losses_ += w * max(unclipped, clipped)
            g_row.append(w * -a * r / tokens if unclipped >= clipped else 0.0)
        grads.append(g_row)
    return losses_ / tokens, grads


@pytest.mark.parametrize(("policy", "cap"), [(OffPolicy.TIS, 2.0), (OffPolicy.TIS, 1.5),
                                             (OffPolicy.DECOUPLED, None),
                                             (OffPolicy.DECOUPLED, 3.0)])
def test_each_correction_matches_its_reference(policy: OffPolicy, cap: float | None) -> None:
    cfg = AlgorithmConfig.for_algorithm("grpo", off_policy=policy, off_policy_cap=cap)
    assert cfg.off_policy_cap == cap  # TIS's default would be 2.0; these set it
    new, old = rows(NEW, grad=True), rows(OLD)
    weights = behaviour_weights(cfg.off_policy, cfg.off_policy_cap, old, rows(MU))
    adv = [torch.full_like(n, a) for n, a in zip(new, ADV, strict=True)]
    obj = losses.objective(cfg, new, old, adv, weights=weights)
    loss = obj.partial / denominator(cfg.loss_agg, obj.counts)
    loss.backward()
    want, want_grad = reference(policy, cap)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-12)
    for n, g in zip(new, want_grad, strict=True):
        assert n.grad is not None
        assert n.grad.tolist() == pytest.approx(g, rel=1e-12, abs=1e-15)
    # Some token's weight is over every cap used here, so each cap changed something.
    assert weights.capped > 0 or cap is None
    summary = obj.stats.summary()
    assert summary["off_policy_weight"] == pytest.approx(weights.weight_sum / 9)
    assert summary["behaviour_log_ratio_abs"] == pytest.approx(
        sum(abs(o - m) for ro, rm in zip(OLD, MU, strict=True)
            for o, m in zip(ro, rm, strict=True)) / 9)


def test_the_caps_differ_tis_truncates_decoupled_drops() -> None:
    prox, mu = rows([[0.0, 0.0]]), rows([[-3.0, -0.1]])  # weights e^3 and e^0.1
    tis = behaviour_weights(OffPolicy.TIS, 2.0, prox, mu)
    dec = behaviour_weights(OffPolicy.DECOUPLED, 2.0, prox, mu)
    assert tis.per_token[0].tolist() == pytest.approx([2.0, math.exp(0.1)])
    assert dec.per_token[0].tolist() == pytest.approx([0.0, math.exp(0.1)])
    assert tis.capped == dec.capped == 1


def test_weights_of_one_change_nothing_bit_for_bit() -> None:
    """Behaviour equal to the proximal policy: TIS's objective is the uncorrected one exactly,
    in value and gradient (a correction that is on must cost nothing where nothing differs)."""
    plain = AlgorithmConfig.for_algorithm("grpo")
    tis = plain.with_(off_policy=OffPolicy.TIS, off_policy_cap=2.0)
    out = []
    for cfg in (plain, tis):
        new, old = rows(NEW, grad=True), rows(OLD)
        weights = (None if cfg.off_policy is OffPolicy.NONE
                   else behaviour_weights(cfg.off_policy, cfg.off_policy_cap, old, rows(OLD)))
        adv = [torch.full_like(n, a) for n, a in zip(new, ADV, strict=True)]
        obj = losses.objective(cfg, new, old, adv, weights=weights)
        obj.partial.backward()
        grads = [n.grad.tolist() for n in new if n.grad is not None]
        out.append((float(obj.partial.detach()), grads))
    assert out[0] == out[1]


def test_the_first_pass_parts_carry_the_weights() -> None:
    """Batch-scope estimators stream ``P_adv`` and ``P_one``; with weights they must still
    combine to the weighted policy gradient at ratio 1."""
    new = rows(NEW, grad=True)
    old = [t.detach() for t in new]
    weights = behaviour_weights(OffPolicy.TIS, 2.0, old, rows(MU))
    raw = [torch.full_like(n, a).detach() for n, a in zip(new, ADV, strict=True)]
    p_adv, p_one = losses.first_pass_parts(new, raw, AlgorithmConfig.for_algorithm(
        "reinforce_pp").loss_agg, weights)
    mean, scale = 0.3, 1.7
    combined = scale * (p_adv - mean * p_one)
    cfg = AlgorithmConfig.for_algorithm("reinforce_pp", off_policy="tis")
    final = [(a - mean) * scale for a in raw]
    direct = losses.objective(cfg, new, old, final, weights=weights).partial
    assert float(combined.detach()) == pytest.approx(float(direct.detach()), rel=1e-12)
    g1 = torch.autograd.grad(combined, new, retain_graph=True)
    g2 = torch.autograd.grad(direct, new)
    for a, b in zip(g1, g2, strict=True):
        assert a.tolist() == pytest.approx(b.tolist(), rel=1e-12, abs=1e-15)


def test_objective_refuses_weights_that_do_not_match_the_config() -> None:
    new, old = rows(NEW), rows(OLD)
    adv = [torch.zeros_like(n) for n in new]
    with pytest.raises(ValueError, match="needs weights"):
        losses.objective(AlgorithmConfig.for_algorithm("grpo", off_policy="tis"), new, old, adv)
    weights = behaviour_weights(OffPolicy.TIS, 2.0, old, rows(MU))
    with pytest.raises(ValueError, match="needs weights"):
        losses.objective(AlgorithmConfig.for_algorithm("grpo"), new, old, adv, weights=weights)


def test_config_defaults_and_bad_caps() -> None:
    assert AlgorithmConfig.for_algorithm("grpo").off_policy is OffPolicy.NONE
    assert AlgorithmConfig.for_algorithm("grpo", off_policy="tis").off_policy_cap == 2.0
    assert AlgorithmConfig.for_algorithm("dapo", off_policy="decoupled").off_policy_cap is None
    for bad in ({"off_policy": "tis", "off_policy_cap": 0.5},
                {"off_policy_cap": 2.0},
                {"off_policy": "importance"}):
        with pytest.raises(AlgorithmConfigError):
            AlgorithmConfig.for_algorithm("grpo", **bad)


def test_trained_behaviour_follows_the_loss_mask_and_marks_unknown() -> None:
    got = trained_behaviour([[5, 6, 7, 8], [5, 6], [9]], [[-1.0, 0.0, 0.0, -2.0], [], [-0.5]],
                            [[1, 0, 0, 1], [1, 1], [1]])
    assert got == [[-1.0, -2.0], None, [-0.5]]
    assert trained_behaviour([[5]], None, None) == [None]
