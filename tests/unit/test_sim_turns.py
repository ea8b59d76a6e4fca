"""The simulator's agentic responses: model turns, tool calls off the GPU, observations."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest

from rollout_svc.engines.emu_models import response_length
from sim.config import RESERVED_ONLY, RLBOOST, Cluster, Costs, Policy, Turns, Workload
from sim.outcome import simulate
from sim.simulator import Simulator
from sim.turns import make_response, tool_seconds, turn_count

WORK = Workload(prompts=16, samples=4, max_new_tokens=64, mean_tokens=16.0, seed=3)
COSTS = Costs.emulation("emu-8b", max_batch=8, grace_s=5.0)
CHURN = Cluster(reserved_gpus=2, spot_times=[0.0, 3.0, 9.0, 15.0],
                spot_counts=[3, 1, 4, 0], trace_length_s=20.0)
# Every response has exactly two model turns, one call between them taking ``tool_median_s``.
TWO = Turns(max_turns=2, turn_p=1.0, tool_sigma=0.0, observation_tokens=4)


def test_one_turn_without_tools_is_the_single_turn_model_exactly() -> None:
    single = Turns(max_turns=1, tool_median_s=0.0, observation_tokens=0)
    never = Turns(max_turns=4, turn_p=0.0)  # up to four turns, but each extra one never comes
    for policy in (RLBOOST, RESERVED_ONLY):
        base = simulate(policy, WORK, COSTS, CHURN, 60.0)
        for turns in (single, never):
            agentic = simulate(policy, replace(WORK, turns=turns), COSTS, CHURN, 60.0)
            assert agentic.steps == base.steps, (policy.name, turns)
            assert agentic.tokens == base.tokens > 0
    for p in range(WORK.prompts):
        plain = make_response(WORK, 2, p, 1, 0)
        one = make_response(replace(WORK, turns=single), 2, p, 1, 0)
        assert one.stops == (plain.length,) and one.tool_s == () and one.observed == 0


def test_a_tool_call_frees_its_slot_for_other_work() -> None:
    # One instance with one slot, two responses of two turns each. A tool call that held the
    # slot would put both calls on the step's path (+2T); handed back, the second response's
    # first turn decodes during the first one's call, so less than T is added.
    work = Workload(prompts=1, samples=2, max_new_tokens=64, mean_tokens=16.0, seed=5)
    costs = Costs.emulation("emu-8b", max_batch=1)
    cluster = Cluster(reserved_gpus=1, spot_counts=[0])
    rollout: dict[float, float] = {}
    busy: dict[float, float] = {}
    for tool_s in (0.0, 50.0):
        turns = replace(TWO, tool_median_s=tool_s, max_tool_s=100.0)
        sim = Simulator(replace(work, turns=turns), costs, cluster, RESERVED_ONLY)
        sim.run(0.0, warmup_steps=1)
        [record] = sim.records
        assert record["tool_calls"] == 2 and record["tool_s"] == pytest.approx(2 * tool_s)
        rollout[tool_s] = record["rollout_s"]
        # The GPU was busy only decoding and prefilling: never while a call ran.
        busy[tool_s] = sim.fleet.instances[0].busy_s
    assert 50.0 < rollout[50.0] < rollout[0.0] + 50.0
    assert busy[50.0] == pytest.approx(busy[0.0])


def test_turns_and_tool_time_lengthen_a_step() -> None:
    # Every response waits one 3 s call between its turns: its step is longer than with
    # instant tools, by less than the call (other turns decode meanwhile, in smaller batches)
    # but never by less than the part of it the last response waits past every decode.
    cluster = Cluster(reserved_gpus=2, spot_counts=[0])
    fast = simulate(RESERVED_ONLY, replace(WORK, turns=replace(TWO, tool_median_s=0.0)), COSTS,
                    cluster, 1000.0, steps=2)
    slow = simulate(RESERVED_ONLY, replace(WORK, turns=replace(TWO, tool_median_s=3.0)), COSTS,
                    cluster, 1000.0, steps=2)
    for f, s in zip(fast.steps, slow.steps, strict=True):
        assert f["rollout_s"] + 1.0 < s["rollout_s"] < f["rollout_s"] + 3.0 + 1e-9
        assert s["rollout_s"] > 3.0
        assert s["step_s"] > f["step_s"] + 1.0
        # A call between the two turns of every response whose first turn left room for one.
        calls = sum(len(make_response(replace(WORK, turns=TWO), f["step"], p, n, 0).tool_s)
                    for p in range(WORK.prompts) for n in range(WORK.samples))
        assert s["tool_calls"] == f["tool_calls"] == calls > WORK.prompts * WORK.samples // 2
        assert s["tokens"] == f["tokens"]
    assert slow.tokens_per_s < fast.tokens_per_s


def test_trained_tokens_leave_observations_out_and_the_trainer_pays_for_them() -> None:
    work = replace(WORK, turns=replace(TWO, tool_median_s=0.5))
    sim = Simulator(work, COSTS, Cluster(reserved_gpus=2, spot_counts=[0]), RESERVED_ONLY)
    sim.run(0.0, warmup_steps=1)
    [record] = sim.records
    responses = [make_response(work, 0, p, s, 0) for p in range(work.prompts)
                 for s in range(work.samples)]
    observed = sum(r.observed for r in responses)
    assert observed > 0
    assert record["tokens"] == sum(r.length for r in responses) - observed
    per_token = COSTS.compute.seconds_per_token
    trained = sum(r.length + r.prompt_tokens for r in responses) * per_token
    assert record["train_s"] == pytest.approx(trained + COSTS.compute.optimizer_step_s)


def test_every_turn_completes_once_and_every_call_runs_once_through_preemptions() -> None:
    work = replace(WORK, turns=Turns(max_turns=3, tool_median_s=0.5, observation_tokens=4))
    calls: dict[tuple[str, int], int] = {}
    for policy in (RLBOOST, Policy("seeding off", seeding="off")):
        sim = Simulator(work, COSTS, CHURN, policy, audit=True)
        sim.run(60.0)
        assert sim.audit is not None and len(sim.records) >= 2, policy.name
        assert sum(rec["migrations"] for rec in sim.records) > 0, "the drops moved nothing"
        for rec in sim.records:
            responses = [make_response(work, rec["step"], p, s, 0)
                         for p in range(work.prompts) for s in range(work.samples)]
            # Token-level moves keep committed turns: no call runs again.
            assert rec["tool_calls"] == sum(len(r.stops) - 1 for r in responses)
            calls[policy.name, rec["step"]] = rec["tool_calls"]
        done = [a for a in sim.audit if a[0] in {rec["step"] for rec in sim.records}]
        assert len({a[:3] for a in done}) == len(done) and all(a[3] == 0 for a in done)
    assert calls["rlboost", 0] == calls["seeding off", 0] > 0


def test_the_stated_distributions_hold_within_the_budget() -> None:
    turns = Turns()
    work = Workload.agentic(prompts=64, samples=8)
    responses = [make_response(work, 1, p, s, 0) for p in range(64) for s in range(8)]
    counts = [turn_count(turns, 0, 1, p, s) for p in range(64) for s in range(8)]
    assert set(counts) == {1, 2, 3, 4}
    assert statistics.mean(counts) == pytest.approx(turns.mean_turns, abs=0.1)
    assert all(0 < r.stops[-1] == r.length <= work.max_new_tokens for r in responses)
    assert all(len(r.tool_s) == len(r.stops) - 1 for r in responses)
    # Model tokens average a single-turn response's (the turn mean is scaled down).
    model = statistics.mean(r.length - r.observed for r in responses)
    assert model == pytest.approx(work.mean_tokens, rel=0.15)
    # The turn's start keys its length, as the emu engine keys it: the first turn's is the
    # single-turn key (step 1's version) at the turn mean.
    first = response_length(0, 1, 5, 2, 1, work.mean_tokens / turns.mean_turns, 1.0)
    assert make_response(work, 1, 5, 2, 0).stops[0] == min(first, work.max_new_tokens)
    tools = [tool_seconds(turns, 0, 1, p, s, k) for p in range(64) for s in range(8)
             for k in range(3)]
    assert statistics.median(tools) == pytest.approx(turns.tool_median_s, rel=0.15)
    assert max(tools) == turns.max_tool_s  # the tail past the timeout is cut there


def test_a_bad_turns_configuration_is_refused() -> None:
    with pytest.raises(ValueError, match="max_turns"):
        Turns(max_turns=0)
    with pytest.raises(ValueError, match="turn_p"):
        Turns(turn_p=1.5)
    with pytest.raises(ValueError, match=">= 0"):
        Turns(tool_median_s=-1.0)
