"""The simulator's bounded staleness (issue 39): steps that roll out while earlier ones train."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sim.config import RESERVED_ONLY, RLBOOST, Cluster, Costs, Policy, Turns, Workload
from sim.outcome import simulate
from sim.simulator import Simulator

WORK = Workload(prompts=16, samples=4, max_new_tokens=64, mean_tokens=16.0, seed=3)
COSTS = Costs.emulation("emu-8b", max_batch=8, grace_s=5.0)
CHURN = Cluster(reserved_gpus=2, spot_times=[0.0, 3.0, 9.0, 15.0],
                spot_counts=[3, 1, 4, 0], trace_length_s=20.0)
# Weights that take seconds to pull over a shared link: spot instances serve old versions for
# a while after each publish.
PULLED = replace(COSTS, weight_bytes=4e9, egress_bytes_s=4e9, peer_bytes_s=0.0)
# RLBOOST on CHURN for 30 s, from the synchronous simulator whose lengths are keyed by the
# step's version as the emu engine keys them (before, every step drew version 0's key, and
# this model's ends were those of commit ad3f591): each step's end and its migrations.
# Staleness 0 must reproduce them bit for bit; regenerate them only for a deliberate change of
# the synchronous model.
SYNC_ENDS = [0.7278466633953066, 3.4654435567963335, 5.019571402006119, 7.799255144199782,
             9.230281352652355, 11.295871304921898, 13.638247528238773, 15.872773659517605,
             17.208096417908255, 18.770495073105483, 20.53874907627339, 22.17945026382475,
             23.716571636352928, 25.851961288228058, 27.9061941765924, 29.394390541275392]
SYNC_MIGRATIONS = [0, 14, 0, 15, 0, 2, 3, 4, 0, 0, 0, 0, 0, 1, 1, 0]


def stale(k: int, policy: Policy = RLBOOST) -> Policy:
    return replace(policy, name=f"{policy.name}, staleness {k}", staleness=k)


def test_staleness_zero_is_the_synchronous_simulator_bit_for_bit() -> None:
    sim = Simulator(WORK, COSTS, CHURN, stale(0), audit=True)
    sim.run(30.0)
    assert [r["finished_at"] for r in sim.records] == SYNC_ENDS
    assert [r["migrations"] for r in sim.records] == SYNC_MIGRATIONS
    assert all(r["opened_at"] == r["started_at"] for r in sim.records)
    assert all(r["tokens_off_policy"] == r["tokens_reprefilled"] == 0 for r in sim.records)
    # Every response of a synchronous step is one version's: its step's.
    assert sim.audit and all(a[4] == ((0, a[0]),) for a in sim.audit)


@pytest.mark.parametrize("k", [1, 2])
def test_no_trained_token_is_older_than_the_staleness_bound(k: int) -> None:
    # Preemptions move responses mid-flight and spot instances swap versions under them: each
    # response's version changes still lie in [step - k, step], start at its first token, and
    # every response of every trained step completes once with exactly its tokens.
    work = replace(WORK, prompts=32)  # enough work that spot instances are busy at a swap
    for policy in (stale(k), stale(k, replace(RLBOOST, migration="request"))):
        sim = Simulator(work, PULLED, CHURN, policy, audit=True)
        sim.run(60.0)
        trained = {r["step"] for r in sim.records}
        assert sim.audit is not None and len(trained) >= 5
        done = [a for a in sim.audit if a[0] in trained]
        keys = [a[:3] for a in done]
        assert len(keys) == len(set(keys)) == work.prompts * work.samples * len(trained)
        assert all(a[3] == 0 for a in done)
        for step, _, _, _, versions in done:
            assert versions[0][0] == 0, versions
            assert [i for i, _ in versions] == sorted({i for i, _ in versions})
            assert all(step - k <= v <= step for _, v in versions), (step, versions)
        # The bound is reached, and responses continue across a new version (partial rollout).
        assert any(v == step - k for step, _, _, _, vs in done for _, v in vs)
        assert any(len(vs) > 1 for *_, vs in done)
        assert min(r["oldest_version"] - r["step"] for r in sim.records) == -k
        assert all(0 <= r["tokens_off_policy"] <= r["tokens"] for r in sim.records)
        assert sum(r["tokens_off_policy"] for r in sim.records) > 0
        assert sum(r["tokens_reprefilled"] for r in sim.records) > 0  # swaps were charged


def test_agentic_responses_keep_the_bound_across_tool_calls() -> None:
    work = replace(WORK, turns=Turns(max_turns=3, turn_p=1.0, tool_median_s=0.3,
                                     observation_tokens=4))
    sim = Simulator(work, COSTS, CHURN, stale(1), audit=True)
    sim.run(60.0)
    assert sim.audit is not None and len(sim.records) >= 3
    assert all(a[0] - 1 <= v <= a[0] for a in sim.audit for _, v in a[4])
    assert sum(r["tool_calls"] for r in sim.records) > 0


def test_more_staleness_never_lowers_throughput_where_rollout_and_training_overlap() -> None:
    # Steady spot capacity (no preemption to reshuffle the schedule) and a trainer that takes
    # a real share of the step. Synchronously, spot instances idle through the step's tail
    # (the last, longest responses), its training, the publish and their pull; each unit of
    # staleness gives them one more step's responses to generate then, and it takes nothing
    # away: the oldest step's responses are leased first, so the trainer's step is never
    # queued behind younger work. So trained tokens/s rise (or stay) from 0 to 1 to 2.
    work = Workload(prompts=32, samples=8, max_new_tokens=256, mean_tokens=64.0, seed=3)
    costs = replace(COSTS, publish_s=0.5)
    cluster = Cluster(reserved_gpus=2, spot_counts=[4])
    rates = [simulate(stale(k), work, costs, cluster, 120.0).tokens_per_s for k in (0, 1, 2)]
    assert rates[0] <= rates[1] <= rates[2]
    assert rates[2] > 1.05 * rates[0]  # and the overlap is worth something here


def test_with_nothing_to_overlap_staleness_one_is_the_synchronous_run() -> None:
    # One reserved instance that holds a whole step, every response the same length (sigma 0),
    # no spot: every response of a step ends at the same decode step, the trainer takes the
    # reserved GPUs at that instant, so the next step's responses cannot start before its
    # version is out. Nothing can overlap, and staleness 1 must change nothing: steps end
    # when they ended synchronously and every token is its own step's version.
    work = Workload(prompts=4, samples=4, max_new_tokens=64, mean_tokens=16.0, sigma=0.0,
                    seed=3)
    costs = replace(COSTS, max_batch=16, publish_s=0.2)
    cluster = Cluster(reserved_gpus=1, spot_counts=[0])
    runs = []
    for k in (0, 1):
        sim = Simulator(work, costs, cluster, stale(k, RESERVED_ONLY), audit=True)
        sim.run(20.0)
        runs.append(sim)
    sync, async_ = runs
    assert len(sync.records) >= 5

    def timing(sim: Simulator) -> list[tuple[float, float, int]]:
        return [(r["started_at"], r["finished_at"], r["tokens"]) for r in sim.records]

    assert timing(async_) == timing(sync)
    assert async_.audit is not None and all(a[4] == ((0, a[0]),) for a in async_.audit)
    assert any(r["opened_at"] < r["started_at"] for r in async_.records)  # it was open early
