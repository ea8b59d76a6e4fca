"""The simulator: deterministic, conserving, billing what the cloud bills."""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest

from manager_svc import placement
from manager_svc.seeding import SeedingState, next_window, observe, optimal_window, retarget
from sim import ideal
from sim.config import RESERVED_ONLY, RLBOOST, Cluster, Costs, Policy, Workload
from sim.events import EventQueue
from sim.outcome import simulate
from sim.simulator import Simulator

WORK = Workload(prompts=16, samples=4, max_new_tokens=64, mean_tokens=16.0, seed=3)
COSTS = Costs.emulation("emu-8b", max_batch=8, grace_s=5.0)
# Spot capacity that drops mid-step (preemptions with work held) and comes back.
CHURN = Cluster(reserved_gpus=2, spot_times=[0.0, 3.0, 9.0, 15.0],
                spot_counts=[3, 1, 4, 0], trace_length_s=20.0)


def test_simultaneous_events_run_in_the_order_scheduled() -> None:
    clock, seen = EventQueue(), []
    for n in range(5):
        clock.at(1.0, lambda n=n: seen.append(n))
    clock.at(0.5, lambda: seen.append(-1))
    clock.run_until(2.0)
    assert seen == [-1, 0, 1, 2, 3, 4]
    assert clock.now == 2.0


def test_a_run_is_a_pure_function_of_its_configuration() -> None:
    runs = [Simulator(WORK, COSTS, CHURN, RLBOOST) for _ in range(2)]
    for sim in runs:
        sim.run(60.0)
    assert runs[0].records == runs[1].records
    assert len(runs[0].records) >= 3


def test_every_response_completes_exactly_once_through_preemptions() -> None:
    per_step = WORK.prompts * WORK.samples
    for policy in (RLBOOST, replace(RLBOOST, migration="request"),
                   Policy("seeding off", seeding="off"), RESERVED_ONLY):
        sim = Simulator(WORK, COSTS, CHURN, policy, audit=True)
        sim.run(60.0)
        assert sim.audit is not None and len(sim.records) >= 2, policy.name
        finished_steps = {rec["step"] for rec in sim.records}
        done = [a for a in sim.audit if a[0] in finished_steps]
        keys = [a[:3] for a in done]
        # Once each, every response of every finished step, with exactly its tokens.
        assert len(keys) == len(set(keys)) == per_step * len(finished_steps), policy.name
        assert all(a[3] == 0 for a in done), policy.name
        for rec in sim.records:
            assert rec["responses"] == per_step
            if policy.migration == "token":
                # Flushed moves keep every token: only rebalances lose uncommitted ones.
                assert rec["tokens_regenerated"] <= rec["migrations"] * COSTS.chunk_tokens
        if policy.name == "rlboost":
            assert sum(rec["migrations"] for rec in sim.records) > 0, "the drops moved nothing"


def test_control_plane_latencies_lengthen_each_step_where_the_emulation_pays_them() -> None:
    # Reserved-only trains after the barrier: it learns of it barrier_s late, and the step
    # ends report_s after the publish; the rollout itself is unchanged.
    cluster = Cluster(reserved_gpus=2, spot_counts=[0])
    base = simulate(RESERVED_ONLY, WORK, COSTS, cluster, 1000.0, steps=2)
    slow = simulate(RESERVED_ONLY, WORK, replace(COSTS, barrier_s=0.5, report_s=0.25), cluster,
                    1000.0, steps=2)
    for b, s in zip(base.steps, slow.steps, strict=True):
        assert s["rollout_s"] == pytest.approx(b["rollout_s"])
        assert s["step_s"] == pytest.approx(b["step_s"] + 0.75)
        assert s["trainer_idle_s"] == pytest.approx(s["rollout_s"] + 0.5)
        assert s["step_s"] - s["train_s"] - s["trainer_idle_s"] == pytest.approx(0.25)


def test_a_count_of_steps_is_measured_whatever_the_span_holds() -> None:
    # A span holds whole steps only: compared step for step with a run that had three, the
    # simulator measures three, not the one or two that finish inside the same span.
    span = simulate(RLBOOST, WORK, COSTS, CHURN, 4.0)
    counted = simulate(RLBOOST, WORK, COSTS, CHURN, 1000.0, steps=3)
    assert len(counted.steps) == 3 and len(span.steps) < 3
    assert counted.steps[:len(span.steps)] == span.steps
    assert counted.window_s == pytest.approx(
        counted.steps[-1]["finished_at"] - counted.steps[0]["started_at"])


def test_spot_is_billed_from_grant_through_the_grace_period() -> None:
    cluster = Cluster(reserved_gpus=1, spot_times=[0.0, 4.0], spot_counts=[2, 0],
                      trace_length_s=1000.0)
    sim = Simulator(WORK, COSTS, cluster, RLBOOST)
    t0, _ = sim.run(20.0)
    reserved, spot = sim.gpu_seconds(0.0, t0 + 20.0)
    # Two instances from 0 until the notice at t0 + 4, then the 5 s grace each.
    assert spot == 2 * (t0 + 4.0 + COSTS.grace_s)
    assert reserved == 1 * (t0 + 20.0)


def test_seeding_pays_off_and_reserved_only_uses_no_spot() -> None:
    cluster = Cluster(reserved_gpus=2, spot_times=[0.0], spot_counts=[4])
    work = Workload(prompts=32, samples=8, max_new_tokens=256, mean_tokens=64.0, seed=3)
    base = simulate(RESERVED_ONLY, work, COSTS, cluster, 60.0)
    boost = simulate(RLBOOST, work, COSTS, cluster, 60.0)
    assert base.spot_gpu_s == 0
    # Three times the GPUs on a rollout-bound workload: well over half of them pays off.
    assert boost.tokens_per_s > 1.5 * base.tokens_per_s
    assert all(s["tokens_spot"] > 0 for s in boost.steps)


def test_a_step_never_handed_off_measures_the_reserved_rate_over_its_rollout() -> None:
    # No spot instance: the window ends with nobody to hand to, and the reserved side makes
    # every token over the whole rollout. Over the 1 s window instead, the rate reads many
    # times too high and caps the next windows at W/r, too short to measure it again.
    work = Workload(prompts=32, samples=8, max_new_tokens=256, mean_tokens=64.0, seed=3)
    sim = Simulator(work, COSTS, Cluster(reserved_gpus=2, spot_counts=[0]), RLBOOST)
    sim.run(0.0, warmup_steps=1)
    [record] = sim.records
    assert record["tokens_reserved"] == record["tokens"] and record["seeding_window_s"] > 0
    assert record["rollout_s"] > 2 * record["seeding_window_s"]
    assert sim.seeding.reserved_rate == pytest.approx(record["tokens"] / record["rollout_s"])


def test_lease_plan_gives_fair_shares_reserved_first_within_capacity() -> None:
    rows = [{"id": "s", "kind": "spot", "held": 0, "capacity": 100},
            {"id": "r", "kind": "reserved", "held": 2, "capacity": 4}]
    plan = [(i["id"], n) for i, n in placement.lease_plan(10, rows)]
    assert plan == [("r", 2), ("s", 6)]  # share ceil(12 / 2) = 6, capped by capacity 4


def test_rebalance_moves_half_the_skew_from_the_busiest_after_idling() -> None:
    rows = [{"id": "a", "held": 10}, {"id": "b", "held": 0}]
    assert placement.rebalance_move(rows, {"b": 0.5}, {}, 1.0, 4) is None  # idle only 0.5 s
    chosen = placement.rebalance_move(rows, {"b": 0.0}, {}, 1.5, 4)
    assert chosen is not None and chosen[0]["id"] == "a" and chosen[2] == 5
    assert placement.rebalance_move(rows, {"b": 0.0}, {"a": 0.5}, 1.5, 4) is None  # cooldown
    assert placement.least_advanced([("x", 9), ("y", 1), ("z", 5)], 2) == ["y", "z"]


def test_no_policy_beats_the_ideal_bound() -> None:
    cluster = Cluster(reserved_gpus=2, spot_times=[0.0], spot_counts=[4])
    work = Workload(prompts=32, samples=8, max_new_tokens=256, mean_tokens=64.0, seed=3)
    for policy, spot in ((RESERVED_ONLY, 0.0), (RLBOOST, 4.0)):
        out = simulate(policy, work, COSTS, cluster, 60.0)
        for s in out.steps:
            bound = ideal.step_bound(work, COSTS, s["step"], 2, spot)
            assert bound.critical_s > 0 and bound.work_s > 0
            assert bound.step_s <= s["step_s"], (policy.name, s["step"])


def test_a_step_whose_spot_came_late_measures_the_reserved_rate_to_its_last_token() -> None:
    # Spot instances boot after the 1 s window: nobody to hand to, so the reserved side keeps
    # its responses, then the spot instances take all that is left. Over the whole rollout
    # the reserved rate reads many times too low; up to its last token it is the rate it had.
    work = Workload(prompts=32, samples=8, max_new_tokens=256, mean_tokens=64.0, seed=3)
    late = replace(COSTS, spot_start_s=4.0)
    alone = Simulator(work, COSTS, Cluster(reserved_gpus=2, spot_counts=[0]), RLBOOST)
    alone.run(0.0, warmup_steps=1)
    sim = Simulator(work, late, Cluster(reserved_gpus=2, spot_counts=[6],
                                        spot_join_at_start=False), RLBOOST)
    sim.run(0.0, warmup_steps=1)
    [record] = sim.records
    assert 0 < record["tokens_reserved"] < record["tokens"] and record["tokens_spot"] > 0
    span = record["reserved_last_s"]
    assert record["seeding_window_s"] < span < record["rollout_s"]
    assert sim.seeding.reserved_rate == pytest.approx(record["tokens_reserved"] / span)
    whole = record["tokens_reserved"] / record["rollout_s"]
    assert sim.seeding.reserved_rate > 1.5 * whole
    assert sim.seeding.reserved_rate > 0.5 * alone.seeding.reserved_rate


def test_unmeasured_spot_is_taken_as_fast_as_a_reserved_instance() -> None:
    # A warm-up without spot measured the reserved side only: with 11 spot instances now,
    # the window is the model's for spot at the reserved rate per instance, not W/r (all on
    # the reserved side); and the time to a first spot token stays unmeasured (0), not the
    # rollout's length.
    state = SeedingState(spot_count=0)
    observe(state, {"tokens": 8000, "tokens_reserved": 8000, "tokens_spot": 0,
                    "window_s": 10.0, "train_s": 4.0, "spot_ready_s": 10.0,
                    "spot_busy_s": 0.0, "spot_count": 0, "reserved_count": 8})
    assert state.reserved_rate == 800.0 and state.spot_rate_each == 0.0
    assert state.spot_ready_s == 0.0 and state.reserved_count == 8
    r, s, c = 800.0, 11 * 100.0, 4.0 / 8000
    assert optimal_window(state, 11) == pytest.approx((8000 - c * 8000 * s) / (s + r))
    assert next_window(state, 11) < 0.5 * 8000 / 800
    assert SeedingState.load({k: str(v) for k, v in state.dump().items()}) == state
    unknown = SeedingState(tokens=8000, reserved_rate=800.0)  # no count: nothing to go on
    assert optimal_window(unknown, 11) == 10.0


def test_seeding_measures_spot_rate_on_the_instances_that_did_the_work() -> None:
    # Chosen on 8 instances, ended on 2: the rate per instance is over the mean, 5, not 2;
    # and the publish, which follows the barrier whatever the window, is not training.
    state = SeedingState(spot_count=8)
    observe(state, {"tokens": 1000, "tokens_reserved": 200, "tokens_spot": 800,
                    "window_s": 2.0, "train_s": 30.0, "publish_s": 10.0, "spot_ready_s": 1.0,
                    "spot_busy_s": 10.0, "spot_count": 2})
    assert state.spot_rate_each == 800 / 10.0 / 5
    assert state.train_s_per_token == 20.0 / 1000
    assert state.reserved_rate == 100.0


def _measured(spot_count: int = 8) -> SeedingState:
    """A state after one step: 1,000 tokens, reserved 100 tok/s, spot 10 tok/s each."""
    state = SeedingState(window_s=2.0, spot_count=spot_count)
    observe(state, {"tokens": 1000, "tokens_reserved": 200, "tokens_spot": 800,
                    "window_s": 2.0, "train_s": 12.0, "publish_s": 2.0, "spot_ready_s": 0.0,
                    "spot_busy_s": 10.0, "spot_count": spot_count})
    return state


def test_seeding_counts_instances_for_the_part_of_the_step_they_were_there() -> None:
    # 2 there throughout, 10 joined for the last fifth of the spot span: 4 did the work,
    # not the 7 that the mean of the counts at both ends gives.
    state = SeedingState(spot_count=2)
    observe(state, {"tokens": 1000, "tokens_reserved": 200, "tokens_spot": 800,
                    "window_s": 2.0, "train_s": 30.0, "spot_ready_s": 1.0, "spot_busy_s": 10.0,
                    "spot_count": 12, "spot_joined": [-5.0, 0.5] + [9.0] * 10})
    assert state.spot_rate_each == pytest.approx(800 / 10.0 / 4)


def test_seeding_feedback_moves_the_window_against_what_the_step_showed() -> None:
    # 2,000 tokens; window 10 s at 100 tok/s; 2 spot instances at 25 tok/s each until 20 s.
    # The model's step towards balance is s/(s+r) = 1/3 of the imbalance, the feedback's half.
    def after(train_s: float) -> SeedingState:
        state = SeedingState(window_s=10.0, spot_count=2)
        observe(state, {"tokens": 2000, "tokens_reserved": 1000, "tokens_spot": 1000,
                        "window_s": 10.0, "train_s": train_s, "spot_ready_s": 0.0,
                        "spot_busy_s": 20.0, "spot_count": 2})
        return state

    spot_late = after(4.0)  # spot ended 6 s after the reserved side: w* = 12, feedback 13
    assert optimal_window(spot_late, 2) == pytest.approx(12.0)
    assert next_window(spot_late, 2) == pytest.approx(13.0)
    trainer_late = after(16.0)  # the reserved side ended 6 s after spot: w* = 8, feedback 7
    assert optimal_window(trainer_late, 2) == pytest.approx(8.0)
    assert next_window(trainer_late, 2) == pytest.approx(7.0)


def test_seeding_window_follows_the_spot_count_within_a_step() -> None:
    assert retarget(SeedingState(spot_count=8), 2) is None  # nothing measured: nothing to move
    state = _measured()
    assert retarget(state, 8) is None
    fewer, more = retarget(state, 2), retarget(state, 16)
    assert fewer is not None and more is not None
    assert fewer > optimal_window(state, 8) > more


def test_simulated_window_moves_when_capacity_drops_inside_it() -> None:
    # 4 spot instances up when step 1 starts, 3 of them gone a quarter into its window: the
    # window the step ran with is longer than the one it started with.
    cluster = Cluster(reserved_gpus=2, spot_times=[0.0], spot_counts=[4])
    sim = Simulator(WORK, COSTS, cluster, RLBOOST)
    sim.manual = True
    sim.start_trace()
    sim.begin_step(0)
    sim.clock.run_until(math.inf, lambda: len(sim.records) > 0)
    sim.begin_step(1)
    assert sim.step is not None and sim.step.window > 0
    chosen = sim.step.window
    sim.clock.after(chosen / 4, partial(sim.fleet.set_spot, 1))
    sim.clock.run_until(math.inf, lambda: len(sim.records) > 1)
    assert sim.records[1]["seeding_window_s"] > chosen


def test_the_check_reads_the_engines_host_time_by_kind(tmp_path: Path) -> None:
    """bench-sim-check's reading of the emulated engines' host-time lines: per kind of
    instance, weighted by steps, other services' logs ignored."""
    from benchmarks.sim_check import measured_host

    logs = tmp_path / "logs"
    logs.mkdir()
    line = "2026-12-02 01:00:00,000 rollout INFO rollout.emu: emu host time {} ms per " \
           "decode step over {} steps\n"
    (logs / "reserved.log").write_text(line.format("2.000", 200) + line.format("4.000", 200))
    (logs / "spot-t1.log").write_text(line.format("6.000", 100))
    (logs / "spot-t2.log").write_text(line.format("9.000", 200))
    (logs / "manager.log").write_text(line.format("99.0", 999))  # not an engine
    assert measured_host(logs) == {"reserved": pytest.approx(0.003),
                                   "spot": pytest.approx(0.008)}


def test_a_response_leased_again_before_its_delivery_joins_the_batch_once() -> None:
    # Taken back and leased to the same instance again within the control plane's delay, a
    # response has two deliveries on their way; running it twice would decode it at double
    # speed and finish it twice.
    sim = Simulator(WORK, COSTS, Cluster(reserved_gpus=1, spot_counts=[0]), RESERVED_ONLY)
    inst = sim.fleet.instances[0]
    r = sim._open_step(0).responses[0]
    r.owner = inst
    inst.held.append(r)
    sim._deliver(inst, [r])
    sim._deliver(inst, [r])
    assert [x for x in [*inst.queue, *inst.active] if x is r] == [r]
