"""The simulator's robustness knobs: hard kills, another spot GPU type, the length model."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

import pytest

from rollout_svc.engines.emu_models import response_length
from sim.config import RLBOOST, Cluster, Costs, Workload
from sim.outcome import simulate
from sim.turns import length, make_response

WORK = Workload(prompts=16, samples=4, max_new_tokens=256, mean_tokens=64.0, seed=3)
COSTS = Costs.emulation("emu-8b", max_batch=8, grace_s=5.0)
# Instances leave every few seconds: 4 -> 1 -> 4 -> 0, looping.
CHURN = Cluster(reserved_gpus=2, spot_times=[0.0, 3.0, 9.0, 15.0],
                spot_counts=[4, 1, 4, 0], trace_length_s=20.0)


def test_a_synchronous_steps_lengths_are_the_emu_engines_for_its_version() -> None:
    # The emu engine keys a length by the weight version it runs; step n runs version n.
    for step in (0, 1, 7):
        for p in range(4):
            r = make_response(WORK, step, p, 2, 0)
            assert r.length == response_length(WORK.seed, step, p, 2, step, WORK.mean_tokens,
                                                WORK.sigma, WORK.max_new_tokens)
    assert [length(WORK, 0, p, 0) for p in range(16)] != [length(WORK, 1, p, 0)
                                                          for p in range(16)]


def _log_lengths(work: Workload, step: int = 0) -> list[list[float]]:
    return [[math.log(length(work, step, p, s)) for s in range(work.samples)]
            for p in range(work.prompts)]


def test_a_prompt_share_moves_variance_between_groups_and_keeps_the_marginal() -> None:
    work = Workload(prompts=400, samples=8, max_new_tokens=1 << 20, mean_tokens=500.0, seed=1)
    shared = replace(work, prompt_share=0.6)

    def within(groups: list[list[float]]) -> float:
        return statistics.mean(statistics.pvariance(g) for g in groups)

    plain, grouped = _log_lengths(work), _log_lengths(shared)
    # Within a group the log-variance is what the prompt does not explain: 0.4 of sigma^2.
    assert within(plain) == pytest.approx(1.0 * 7 / 8, rel=0.1)
    assert within(grouped) == pytest.approx(0.4 * 7 / 8, rel=0.1)
    every = [x for g in grouped for x in g]
    assert statistics.pvariance(every) == pytest.approx(1.0, rel=0.1)
    mean = statistics.mean(math.exp(x) for x in every)
    assert mean == pytest.approx(work.mean_tokens, rel=0.1)


def test_growth_lengthens_later_steps_by_its_rate() -> None:
    work = Workload(prompts=200, samples=8, max_new_tokens=1 << 20, mean_tokens=500.0, seed=2,
                    growth=0.05)

    def mean_at(step: int) -> float:
        return statistics.mean(length(work, step, p, s) for p in range(work.prompts)
                               for s in range(work.samples))

    assert mean_at(10) / mean_at(0) == pytest.approx(1.05**10, rel=0.12)
    with pytest.raises(ValueError, match="prompt_share"):
        Workload(prompt_share=1.5)


def test_hard_kills_lose_uncommitted_tokens_wait_for_leases_and_stop_billing() -> None:
    notice = simulate(RLBOOST, WORK, COSTS, CHURN, 60.0)
    killed = simulate(RLBOOST, WORK, COSTS, replace(CHURN, hard_kill_share=1.0), 60.0)
    # Nothing is lost: every step trains every response.
    for run in (notice, killed):
        assert all(s["responses"] == WORK.prompts * WORK.samples for s in run.steps)
    # A notice hands everything back (flushed); a kill keeps only whole committed chunks.
    assert killed.total("tokens_regenerated") > notice.total("tokens_regenerated")
    # A kill is not billed through the grace period.
    per_s = [r.spot_gpu_s / r.window_s for r in (notice, killed)]
    assert per_s[1] < per_s[0]
    # Leases that take long to expire hold the dead instance's responses back.
    ttl = {t: simulate(RLBOOST, WORK, replace(COSTS, lease_ttl_s=t),
                       replace(CHURN, hard_kill_share=1.0), 60.0) for t in (0.2, 8.0)}
    assert ttl[8.0].step_s > ttl[0.2].step_s + 2.0
    with pytest.raises(ValueError, match="hard_kill_share"):
        Cluster(hard_kill_share=1.5)


def test_slower_spot_gpus_slow_the_run_and_bill_their_own_gpus() -> None:
    fast = simulate(RLBOOST, WORK, COSTS, CHURN, 60.0)
    slow = simulate(RLBOOST, WORK, COSTS, replace(CHURN, spot_speed=0.25), 60.0)
    assert slow.tokens_per_s < fast.tokens_per_s
    # Same instances, twice the GPUs each: twice the GPU-seconds billed per second.
    double = simulate(RLBOOST, WORK, COSTS, replace(CHURN, spot_gpus=2), 60.0)
    assert double.steps == fast.steps
    assert double.spot_gpu_s == pytest.approx(2 * fast.spot_gpu_s)
