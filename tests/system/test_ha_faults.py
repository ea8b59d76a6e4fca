"""The fault campaign on clustered brokers: Redis primaries fail over, NATS nodes die, and every
sample equals the fault-free run's.

The brokers are :class:`rlboost.ha_stack.HaStack` (``rlboost up --ha``): a 3-node NATS
JetStream cluster with the chunk stream at R3, and a Redis Cluster of 3 primaries with a
replica each, commits acked once a replica holds them (RLBOOST_REDIS_REPLICA_ACKS=1). Two
manager replicas serve emulated rollout instances. A fault-free run, then runs under
:class:`tests.support.chaos_ha.HaInjector`'s faults (rollout SIGKILL/SIGTERM, a manager replica
SIGKILLed, the Redis primary of the run's or the control slot SIGKILLed until its replica
serves the slot, a NATS node SIGKILLed for 1-3 s) until HA_FAULTS_MIN have hit live processes,
with at least HA_KIND_MIN failovers and NATS node kills among them. Every faulted run must
hold invariants 1-3 and equal the fault-free run and the engine's oracle token for token
(invariant 5), behaviour log-probs included. A campaign on one server (with link and engine
faults) is tests/system/test_faults.py.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rlboost.ha_stack import HaStack
from rlboost.launcher import Cluster
from shared.ports import wait_port
from tests.support.chaos_ha import HaInjector
from tests.support.cluster import running, start_cluster, wait_run
from tests.system.test_faults import (
    FAST,
    PROGRESS_TIMEOUT_S,
    assert_equals_clean,
    fault_free,
    run_under_faults,
)

pytestmark = pytest.mark.slow

SPEC = {"model": "emu", "steps": 8, "prompts_per_step": 8, "samples_per_prompt": 4,
        "seeding": {"mode": "fixed", "window_s": 0.5}, "max_new_tokens": 96, "seed": 23}
HA_FAULTS_MIN = int(os.environ.get("RLBOOST_CHAOS_HA_FAULTS", "14"))
HA_KIND_MIN = max(2, HA_FAULTS_MIN // 7)  # Redis failovers, and NATS node kills, each
MAX_FAULTED_RUNS = max(4, HA_FAULTS_MIN // 3)


@pytest.fixture
def ha(tmp_path: Path) -> Iterator[HaStack]:
    yield from running(HaStack.create(tmp_path / "ha"))


@pytest.fixture
def cluster(ha: HaStack, tmp_path: Path) -> Iterator[Cluster]:
    c = start_cluster(tmp_path, ha, env={**FAST,
                                         "RLBOOST_PROGRESS_TIMEOUT_S": str(PROGRESS_TIMEOUT_S)},
                      spot=3, reserved=1, engine="emu", managers=2)
    try:
        yield c
    finally:
        c.stop()


def enough(injector: HaInjector, ended: dict[str, float]) -> bool:
    counted = injector.counted(ended | {injector.run_id: float("inf")})
    return (counted.total() >= HA_FAULTS_MIN and counted["redis_failover"] >= HA_KIND_MIN
            and counted["nats_node_kill"] >= HA_KIND_MIN)


def test_faulted_runs_on_clustered_brokers_equal_the_fault_free_run(
        cluster: Cluster, ha: HaStack) -> None:
    url = cluster.env["RLBOOST_MANAGER_URL"]
    port = int(url.rsplit(":", 1)[1])
    with httpx.Client(base_url=url, timeout=10) as client:
        _, clean = fault_free(client, cluster, SPEC)

        injector = HaInjector(cluster, ha, seed=11, interval_s=1.5)
        injector.start()
        faulted_ids: list[str] = []
        ended: dict[str, float] = {}
        try:
            while not enough(injector, ended) and len(faulted_ids) < MAX_FAULTED_RUNS:
                with injector.paused():
                    wait_port(port, 30)
                    faulted_ids.append(client.post("/v1/runs", json=SPEC).json()["id"])
                run_under_faults(client, injector, faulted_ids[-1], most=10**6)
                final = wait_run(client, faulted_ids[-1], 240, cluster)
                ended[faulted_ids[-1]] = final["updated_at"]
        finally:
            injector.stop()
        assert not injector.errors, injector.errors
        counted = injector.counted(ended)
        print(f"clustered campaign over {len(faulted_ids)} runs: {counted.total()} faults on "
              f"live processes during runs, by kind {dict(sorted(counted.items()))}; "
              f"{injector.joins} joins; no live process for {dict(injector.missed)}; Redis "
              f"failovers took {statistics.median(injector.failovers or [0]):.1f}s (median), "
              f"{max(injector.failovers or [0]):.1f}s at worst from the kill to the replica "
              f"serving the slot")
        assert counted.total() >= HA_FAULTS_MIN, counted
        assert counted["redis_failover"] >= HA_KIND_MIN, counted
        assert counted["nats_node_kill"] >= HA_KIND_MIN, counted
        for faulted_id in faulted_ids:
            final = wait_run(client, faulted_id, 120, cluster)
            assert final["state"] == "succeeded", final
            assert_equals_clean(client, faulted_id, SPEC, clean)
