"""Two manager replicas on one Redis and one NATS: either may die mid-step, nothing is lost.

Both replicas serve REST and answer the bus (one NATS queue group); one holds the dispatch
lease (manager_svc.leader) and one the chunk stream's pin (manager_svc.ingest), not
necessarily the same. During a run, the replica holding the dispatch lease is SIGKILLed
mid-step and started again (it comes back as a standby); later the one holding the ingest
pin is SIGKILLed mid-step and left dead. Each kill must hit a live replica that held the role
at that moment (read from its own /metrics), the survivor must take that role over, and the
run must finish with invariants 1-3 on every step, read through the surviving replica, and
every response equal to the one a fault-free emu instance generates (invariant 5).
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rlboost.launcher import Child, Cluster
from rlboost.stack import Stack
from tests.support.cluster import start_cluster, wait_run
from tests.support.invariants import check_run
from tests.system.test_faults import REWARD, oracle

pytestmark = pytest.mark.slow

# Emulated engines: steps long enough (~1-2 s of rollout) to be caught mid-step, and tokens
# with an oracle (the response a fault-free instance generates), so nothing can hide.
SPEC: dict[str, Any] = {"model": "emu", "steps": 6, "prompts_per_step": 8, "samples_per_prompt": 4,
                        "max_new_tokens": 96, "seed": 23}
LEADER = "rlboost_manager_dispatch_leader"
PINNED = "rlboost_manager_ingest_active"


@pytest.fixture
def cluster(brokers: Stack, tmp_path: Path) -> Iterator[Cluster]:
    c = start_cluster(tmp_path, brokers, spot=2, reserved=1, engine="emu", managers=2)
    try:
        yield c
    finally:
        c.stop()


def replicas(cluster: Cluster) -> list[tuple[Child, str]]:
    procs = [c for c in cluster.children if c.name.startswith("manager")]
    return list(zip(procs, cluster.manager_urls, strict=True))


def gauge(url: str, name: str) -> float | None:
    """A gauge of one replica's /metrics; None if the replica does not answer."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.TransportError:
        return None
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


def holder(cluster: Cluster, name: str, timeout_s: float = 30) -> tuple[Child, str]:
    """The one live replica whose ``name`` gauge is 1 (exactly one must say so)."""
    end = time.monotonic() + timeout_s
    said: list[float | None] = []
    while time.monotonic() < end:
        live = [(c, u) for c, u in replicas(cluster) if c.alive()]
        said = [gauge(u, name) for _, u in live]
        if said.count(1.0) == 1:
            return live[said.index(1.0)]
        time.sleep(0.2)
    raise AssertionError(f"no single replica holds {name}: {said}")


def wait_mid_step(client: httpx.Client, run_id: str, first: int, timeout_s: float = 180) -> int:
    """The first step from ``first`` on seen with tokens committed and its rollout still
    going (mid-step); tiny steps can pass between two looks, so a later one may be it."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            run = client.get(f"/v1/runs/{run_id}").json()
        except httpx.TransportError:
            time.sleep(0.2)
            continue
        progress = run.get("progress") or {}
        if (run["step"] >= first and progress.get("state") == "rollout"
                and progress.get("tokens", 0) > 0):
            assert run["step"] < SPEC["steps"] - 1, f"no step left after this one: {run}"
            return int(run["step"])
        time.sleep(0.05)
    raise AssertionError(f"no step from {first} on was seen mid-step")


def kill(victim: Child) -> None:
    assert victim.alive(), f"{victim.name} is not alive: the kill would hit nothing"
    victim.signal(signal.SIGKILL)
    assert victim.proc is not None
    victim.proc.wait(timeout=10)


def test_a_replica_killed_mid_step_loses_nothing(cluster: Cluster) -> None:
    first, second = cluster.manager_urls
    assert gauge(first, LEADER) is not None and gauge(second, LEADER) is not None
    with httpx.Client(base_url=second, timeout=10) as client:
        run_id = client.post("/v1/runs", json=SPEC).json()["id"]
        # Every replica serves the same runs: the one it was not posted to knows it too.
        assert httpx.get(f"{first}/v1/runs/{run_id}", timeout=10).json()["id"] == run_id

        killed_at = wait_mid_step(client, run_id, 1)
        leader, leader_url = holder(cluster, LEADER)
        kill(leader)
        survivor, survivor_url = next((c, u) for c, u in replicas(cluster) if c is not leader)
        assert holder(cluster, LEADER) == (survivor, survivor_url), "the lead did not move"
        leader.start()  # back, as a standby: the survivor keeps the lead
        cluster.wait_http(leader_url)

        with httpx.Client(base_url=survivor_url, timeout=10) as alive:
            wait_mid_step(alive, run_id, killed_at + 1)
        pinned, _ = holder(cluster, PINNED)
        kill(pinned)
        last, last_url = next((c, u) for c, u in replicas(cluster) if c is not pinned)
        with httpx.Client(base_url=last_url, timeout=10) as alive:
            final = wait_run(alive, run_id, timeout_s=300)
            assert final["state"] == "succeeded", final
            by_step = check_run(alive, run_id, SPEC, REWARD)
        for step, samples in by_step.items():
            for sample in samples:
                assert sample["response_token_ids"] == oracle(SPEC, sample, step), sample
        # The last replica standing holds both roles, and says so.
        assert gauge(last_url, PINNED) == 1.0 and gauge(last_url, LEADER) == 1.0
        assert not pinned.alive() and last.alive()
