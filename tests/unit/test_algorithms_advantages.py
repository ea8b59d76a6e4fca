"""Advantage estimators and DAPO reward shaping against float64 references written with loops.

Each reference is written from its paper's definition, not from the code under test:
- GRPO: DeepSeekMath (arXiv 2402.03300) §4.1.2, outcome supervision; DAPO (2503.14476) eq. 9.
- Dr. GRPO: Liu et al. (2503.20783) §3.1, the advantage without the std.
- RLOO: Ahmadian et al. (2402.14740) §3, the leave-one-out baseline.
- REINFORCE++ and REINFORCE++ w/ baseline: Hu (2501.03262), the token-level return with the
  KL penalty in the reward and the normalisation over the global batch of token advantages.
- Overlong reward shaping: DAPO eq. 13; dynamic sampling: DAPO eq. 11.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from shared.algorithm import SCOPE, Algorithm, AlgorithmConfig, Estimator, Scope
from trainer_svc.learn.algorithms import advantages as adv

# --- references ------------------------------------------------------------------------------


def ref_grpo(r: list[float], eps: float = 1e-6) -> list[float]:
    n = len(r)
    if n < 2 or all(x == r[0] for x in r):
        return [0.0] * n
    mean = sum(r) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in r) / (n - 1))
    return [(x - mean) / (std + eps) for x in r]


def ref_dr_grpo(r: list[float]) -> list[float]:
    if len(r) < 2:
        return [0.0] * len(r)
    mean = sum(r) / len(r)
    return [x - mean for x in r]


def ref_rloo(r: list[float]) -> list[float]:
    n = len(r)
    if n < 2:
        return [0.0]
    out = []
    for i in range(n):
        others = [r[j] for j in range(n) if j != i]
        out.append(r[i] - sum(others) / (n - 1))
    return out


def ref_token_returns(reward: float, kl: list[float], beta: float, gamma: float) -> list[float]:
    """Hu 2025: A_t = r gamma^(L-1-t) - beta sum_{s>=t} gamma^(s-t) KL_s (the paper: gamma 1)."""
    n = len(kl)
    out = []
    for t in range(n):
        value = reward * gamma ** (n - 1 - t)
        for s in range(t, n):
            value -= beta * gamma ** (s - t) * kl[s]
        out.append(value)
    return out


def ref_whiten(tokens: list[list[float]], eps: float = 1e-8) -> list[list[float]]:
    """Hu 2025: (A - mean over the batch's token advantages) / std (unbiased), eps in the sqrt."""
    flat = [x for row in tokens for x in row]
    if all(x == flat[0] for x in flat):
        return [[0.0] * len(row) for row in tokens]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    return [[(x - mean) / math.sqrt(var + eps) for x in row] for row in tokens]


def ref_step(estimator: Estimator,
             groups: list[tuple[list[float], list[int]]]) -> list[list[list[float]]]:
    if estimator in (Estimator.GRPO, Estimator.DR_GRPO, Estimator.RLOO):
        fn = {Estimator.GRPO: ref_grpo, Estimator.DR_GRPO: ref_dr_grpo,
              Estimator.RLOO: ref_rloo}[estimator]
        return [[[a] * n for a, n in zip(fn(r), lens, strict=True)] for r, lens in groups]
    raw: list[list[float]] = []
    shape: list[int] = []
    for r, lens in groups:
        centred = r if estimator is Estimator.REINFORCE_PP else ref_dr_grpo(r)
        for a, n in zip(centred, lens, strict=True):
            raw.append(ref_token_returns(a, [0.0] * n, 0.0, 1.0))
        shape.append(len(r))
    flat = ref_whiten(raw)
    out, k = [], 0
    for size in shape:
        out.append(flat[k:k + size])
        k += size
    return out


def _groups(seed: int, sizes: list[int]) -> list[tuple[list[float], list[int]]]:
    rng = random.Random(seed)
    out = []
    for size in sizes:
        rewards = [rng.choice([0.0, 0.2, 0.4, 0.6, 0.8, 1.0]) for _ in range(size)]
        lengths = [rng.randint(1, 9) for _ in range(size)]
        out.append((rewards, lengths))
    return out


def _t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# --- estimators ------------------------------------------------------------------------------

STEP = [4, 1, 8, 3, 2]  # a group of one among them


@pytest.mark.parametrize("estimator", list(Estimator))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_step_advantages_match_reference(estimator: Estimator, seed: int) -> None:
    groups = _groups(seed, STEP)
    groups[2] = ([0.4] * 8, groups[2][1])  # all-equal rewards in one group
    got = adv.step_advantages(estimator, [(_t(r), lens) for r, lens in groups])
    want = ref_step(estimator, groups)
    for g_got, g_want, (_, lens) in zip(got, want, groups, strict=True):
        for t, row, n in zip(g_got, g_want, lens, strict=True):
            assert t.shape == (n,) and t.dtype == torch.float64
            assert t.tolist() == pytest.approx(row, rel=1e-12, abs=1e-12)


def test_group_of_one_and_equal_rewards_give_zero_for_group_estimators() -> None:
    for estimator in (Estimator.GRPO, Estimator.DR_GRPO, Estimator.RLOO):
        for rewards in ([0.7], [0.3, 0.3, 0.3]):
            got = adv.raw_advantages(estimator, _t(rewards), [3] * len(rewards))
            assert all(t.tolist() == [0.0] * 3 for t in got)


def test_grpo_uses_unbiased_std_and_veRL_epsilon() -> None:
    got = adv.grpo(_t([0.0, 1.0]))
    # mean 0.5, unbiased std sqrt(0.5)
    assert got.tolist() == pytest.approx([-0.5 / (math.sqrt(0.5) + 1e-6),
                                          0.5 / (math.sqrt(0.5) + 1e-6)], rel=1e-15)


def test_rloo_equals_scaled_centred_reward() -> None:
    r = [0.1, 0.9, 0.4, 0.4, 1.0]
    n = len(r)
    mean = sum(r) / n
    assert adv.rloo(_t(r)).tolist() == pytest.approx([n / (n - 1) * (x - mean) for x in r],
                                                     rel=1e-13)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_token_returns_match_paper_definition(gamma: float) -> None:
    rng = random.Random(4)
    kl = [rng.uniform(-0.3, 0.5) for _ in range(7)]
    got = adv.token_returns(0.8, 7, gamma, torch.tensor(kl, dtype=torch.float64), kl_coef=0.05)
    assert got.tolist() == pytest.approx(ref_token_returns(0.8, kl, 0.05, gamma), rel=1e-13)
    # The outcome-reward reduction rlboost trains with: every token's return is the reward.
    assert adv.token_returns(0.8, 5).tolist() == [0.8] * 5


def test_reinforce_pp_weighs_responses_by_length() -> None:
    # Two responses, rewards 1 and 0, lengths 3 and 1: the token mean is 3/4, not 1/2.
    [[a, b]] = adv.step_advantages(Estimator.REINFORCE_PP, [(_t([1.0, 0.0]), [3, 1])])
    mean, var = 0.75, (3 * 0.25**2 + 0.75**2) / 3
    assert a.tolist() == pytest.approx([(1 - mean) / math.sqrt(var + 1e-8)] * 3, rel=1e-13)
    assert b.tolist() == pytest.approx([(0 - mean) / math.sqrt(var + 1e-8)], rel=1e-13)


def test_batch_whitening_of_equal_values_is_exactly_zero() -> None:
    out = adv.step_advantages(Estimator.REINFORCE_PP, [(_t([0.1, 0.1]), [3, 2]),
                                                       (_t([0.1]), [4])])
    assert all(t.tolist() == [0.0] * t.numel() for g in out for t in g)
    one_token = adv.step_advantages(Estimator.REINFORCE_PP, [(_t([0.3]), [1])])
    assert one_token[0][0].tolist() == [0.0]


def test_baseline_variant_moves_an_all_equal_group_after_whitening() -> None:
    # The documented consequence of a token-weighted batch mean.
    groups = [(_t([1.0, 0.0]), [5, 1]), (_t([0.5, 0.5]), [2, 2])]
    out = adv.step_advantages(Estimator.REINFORCE_PP_BASELINE, groups)
    assert out[1][0].tolist()[0] != 0.0


def test_scope_flags_and_group_locality() -> None:
    """A group-scope estimator's group is untouched by other groups; a batch-scope one is not."""
    assert {e for e, s in SCOPE.items() if s is Scope.BATCH} == {
        Estimator.REINFORCE_PP, Estimator.REINFORCE_PP_BASELINE}
    for algo in Algorithm:
        cfg = AlgorithmConfig.for_algorithm(algo)
        want = Scope.BATCH if algo.value.startswith("reinforce_pp") else Scope.GROUP
        assert cfg.scope is want
    mine = (_t([0.0, 0.5, 1.0]), [2, 3, 4])
    for estimator in Estimator:
        alone = adv.step_advantages(estimator, [mine])[0]
        with_others = adv.step_advantages(estimator, [mine, (_t([0.9, 0.1]), [7, 1])])[0]
        same = all(torch.equal(a, b) for a, b in zip(alone, with_others, strict=True))
        assert same == (SCOPE[estimator] is Scope.GROUP), estimator


def test_raw_advantages_streamed_in_any_order_equal_the_batch() -> None:
    groups = [(_t(r), lens) for r, lens in _groups(9, [4, 4, 2, 6])]
    for estimator in Estimator:
        batch = adv.step_advantages(estimator, groups)
        order = [3, 0, 2, 1]
        raw = {i: adv.raw_advantages(estimator, *groups[i]) for i in order}
        w = adv.batch_whitening(estimator, [raw[i] for i in order])
        for i in order:
            for got, want in zip(raw[i], batch[i], strict=True):
                torch.testing.assert_close(w.apply(got), want, rtol=0, atol=1e-14)


def test_raw_advantages_reject_mismatched_lengths() -> None:
    with pytest.raises(ValueError):
        adv.raw_advantages(Estimator.GRPO, _t([0.0, 1.0]), [3])
    with pytest.raises(ValueError):
        adv.grpo(torch.zeros(2, 2))


# --- DAPO reward shaping -----------------------------------------------------------------------


def ref_overlong(length: int, l_max: int, l_cache: int) -> float:
    """DAPO eq. 13."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_overlong_penalty_matches_eq_13(factor: float) -> None:
    for length in range(0, 26):
        got = adv.overlong_penalty(length, 20, 8, factor)
        assert got == pytest.approx(factor * ref_overlong(length, 20, 8), abs=1e-15)
    assert adv.overlong_penalty(20480, 20480, 4096) == -1.0  # truncated: the full penalty
    assert adv.overlong_penalty(16384, 20480, 4096) == 0.0
    assert adv.overlong_penalty(19, 20, 0) == 0.0  # buffer 0: off


def test_shaped_rewards_and_bad_buffers() -> None:
    assert adv.shaped([1.0, 1.0, 0.0], [4, 10, 10], 10, 4) == pytest.approx([1.0, 0.0, -1.0])
    with pytest.raises(ValueError):
        adv.overlong_penalty(3, 10, 11)
    with pytest.raises(ValueError):
        adv.shaped([1.0], [1, 2], 10, 2)


def test_dynamic_sampling_filter() -> None:
    assert adv.is_informative([0.0, 1.0, 1.0])
    assert not adv.is_informative([1.0, 1.0, 1.0])  # DAPO eq. 11: all correct
    assert not adv.is_informative([0.0, 0.0])  # all wrong
    assert not adv.is_informative([0.5])  # a group of one never compares


def test_truncation() -> None:
    assert adv.is_truncated([5, 6, 7], 3, {2})
    assert not adv.is_truncated([5, 6, 2], 3, {2})  # ended on EOS at the budget
    assert not adv.is_truncated([5, 2], 3, {2})
