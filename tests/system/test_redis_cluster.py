"""A whole run on a 3-node Redis Cluster: every script reaches one slot, nothing is lost.

The services get one node's address in RLBOOST_REDIS_URL, as a deployment would give them,
and find the cluster themselves. Two manager replicas (the dispatch lease, the run queue and
the instance registry on the control slot) serve a run with emulated rollout instances while
a second run waits queued and is cancelled. The run must finish with invariants 1-3 and every
response equal to a fault-free instance's (invariant 5), each script execution on every node
must have reached exactly one slot (tests.support.redis_cluster.SlotAudit: the servers would
not say so themselves), and the run's keys must all sit on the node serving its tag. Then,
with a replica for each primary, the primary serving a run's slot is SIGKILLed mid-step: its
replica takes over and the run finishes with the same invariants.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rlboost.stack import Stack
from shared.names import Keys, tag
from tests.support.cluster import start_cluster, wait_run
from tests.support.invariants import check_run
from tests.support.redis_cluster import RedisClusterNodes, SlotAudit
from tests.system.test_faults import REWARD, oracle
from tests.system.test_manager_replicas import wait_mid_step

pytestmark = pytest.mark.slow

SPEC: dict[str, Any] = {"model": "emu", "steps": 3, "prompts_per_step": 8, "samples_per_prompt": 4,
                        "max_new_tokens": 64, "seed": 31}


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisClusterNodes]:
    with RedisClusterNodes(tmp_path / "redis-cluster") as nodes:
        yield nodes


def test_a_run_on_a_redis_cluster(brokers: Stack, redis_cluster: RedisClusterNodes,
                                  tmp_path: Path) -> None:
    audit = SlotAudit(redis_cluster.ports)
    audit.start()
    # No replicas to wait for (the brokers' own settings may ask for one: make test-ha).
    cluster = start_cluster(tmp_path, brokers, env={"RLBOOST_REDIS_URL": redis_cluster.url,
                                                    "RLBOOST_REDIS_REPLICA_ACKS": "0"},
                            spot=2, reserved=1, engine="emu", managers=2)
    try:
        with httpx.Client(base_url=cluster.manager_urls[1], timeout=10) as client:
            run_id = client.post("/v1/runs", json=SPEC).json()["id"]
            waiting = client.post("/v1/runs", json=SPEC).json()["id"]
            assert client.get(f"/v1/runs/{waiting}").json()["state"] == "queued"
            cancelled = client.post(f"/v1/runs/{waiting}/cancel").json()
            assert cancelled["state"] == "cancelled", cancelled
            final = wait_run(client, run_id, timeout_s=300, cluster=cluster)
            assert final["state"] == "succeeded", final
            by_step = check_run(client, run_id, SPEC, REWARD)
            # The cancelled run never ran: the queue moved past it.
            assert client.get(f"/v1/runs/{waiting}").json()["state"] == "cancelled"
        for step, samples in by_step.items():
            for sample in samples:
                assert sample["response_token_ids"] == oracle(SPEC, sample, step), sample
        managers = [c for c in cluster.children if c.name.startswith("manager")]
        assert all("is a cluster of 3 nodes" in c.tail(2000) for c in managers), \
            managers[0].tail(40)
    finally:
        cluster.stop()
        audit.stop()

    scripts, commands, bad = audit.violations()
    # Enough to mean something: every commit, lease, heartbeat and step change is a script.
    assert scripts > 200 and commands > 2000, (scripts, commands)
    assert not bad, [(port, slots, [b" ".join(c[:2]) for c in run[:6]])
                     for port, slots, run in bad[:5]]
    # Every key of the run is on the node serving its tag, and on no other.
    home = redis_cluster.node_of(Keys.run(run_id))
    for port in redis_cluster.ports:
        found = list(redis_cluster.client(port).scan_iter(match=f"*{tag(run_id)}*", count=1000))
        if port == home:
            # At least the last step's responses (the run keeps it and the one before)
            last_step = SPEC["prompts_per_step"] * SPEC["samples_per_prompt"]
            assert Keys.run(run_id) in found and len(found) > last_step, len(found)
        else:
            assert found == [], (port, found[:5])


@pytest.fixture
def replicated(tmp_path: Path) -> Iterator[RedisClusterNodes]:
    with RedisClusterNodes(tmp_path / "redis-replicated", replicas=1) as nodes:
        yield nodes


def test_a_run_survives_its_primary_failing_over(brokers: Stack, replicated: RedisClusterNodes,
                                                 tmp_path: Path) -> None:
    spec = {**SPEC, "steps": 5, "max_new_tokens": 96}
    # Commits acked once the replica holds them: the one that takes over has every one.
    cluster = start_cluster(tmp_path, brokers, env={"RLBOOST_REDIS_URL": replicated.url,
                                                    "RLBOOST_REDIS_REPLICA_ACKS": "1"},
                            spot=2, reserved=1, engine="emu")
    try:
        with httpx.Client(base_url=cluster.manager_urls[0], timeout=10) as client:
            run_id = client.post("/v1/runs", json=spec).json()["id"]
            wait_mid_step(client, run_id, 1)
            home = replicated.primary_of(Keys.run(run_id))
            victim = replicated.procs[replicated.ports.index(home)]
            assert victim.poll() is None, "the primary is not alive: the kill would hit nothing"
            victim.kill()
            victim.wait(timeout=10)
            # Its replica takes over; with no replica of its own it holds commits back
            # (RLBOOST_REDIS_REPLICA_ACKS) until the dead node is back, as its replica.
            end = time.monotonic() + 30
            while replicated.primary_of(Keys.run(run_id)) == home:
                assert time.monotonic() < end, "no replica took the slot over"
                time.sleep(0.2)
            replicated.restart(home)
            final = wait_run(client, run_id, timeout_s=300, cluster=cluster)
            assert final["state"] == "succeeded", final
            by_step = check_run(client, run_id, spec, REWARD)
        # The replica serves the run's slot still, the old primary replicating it.
        assert replicated.primary_of(Keys.run(run_id)) != home
        assert replicated.client(home).info("replication")["role"] == "slave"
        for step, samples in by_step.items():
            for sample in samples:
                assert sample["response_token_ids"] == oracle(spec, sample, step), sample
    finally:
        cluster.stop()
