"""The real services as processes on given brokers, and waiting for a run through REST."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx

from rlboost.ha_stack import HaStack
from rlboost.launcher import Cluster
from rlboost.stack import Stack
from shared.ports import free_port

# RLBOOST_TEST_BROKERS=ha (make test-ha): the ``brokers`` fixture is the clustered stack (3 NATS
# nodes, 3 Redis shards with a replica each: rlboost.ha_stack), to run the tiers against it.
HA = os.environ.get("RLBOOST_TEST_BROKERS", "") == "ha"


S = TypeVar("S", Stack, HaStack)


def running(stack: S) -> Iterator[S]:
    """A fixture's body: ``stack`` started, yielded, and stopped however the test ends."""
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def start_cluster(root: Path, stack: Stack | HaStack, env: dict[str, str] | None = None,
                  **kwargs: Any) -> Cluster:
    """The manager, weight service, trainer and rollout instances as real processes."""
    # A free port of its own: the launcher prefers 8000 when it looks free, and every test
    # taking that one port raced the last test's manager letting go of it ("address already
    # in use", seen once in CI).
    base = {**stack.env(), "RLBOOST_DATA_DIR": str(root / "data"), "RLBOOST_TORCH_THREADS": "1",
            "RLBOOST_MANAGER_URL": f"http://127.0.0.1:{free_port()}", **(env or {})}
    cluster = Cluster(root, base_env=base, role_env=stack.role_env(), **kwargs)
    cluster.start()
    return cluster


def wait_run(client: httpx.Client, run_id: str, timeout_s: float, cluster: Cluster | None = None
             ) -> dict[str, Any]:
    end = time.monotonic() + timeout_s
    run: dict[str, Any] = {}
    while time.monotonic() < end:
        try:
            resp = client.get(f"/v1/runs/{run_id}")
        except httpx.TransportError:  # a manager restarting (fault tests) answers nothing
            time.sleep(0.3)
            continue
        if resp.status_code == 200:
            run = resp.json()
            if run["state"] in ("succeeded", "failed", "cancelled"):
                return run
        if cluster is not None:
            dead = [c for c in cluster.dead() if c.name in ("manager", "trainer", "weights")]
            assert not dead, f"{dead[0].name} died:\n{dead[0].tail(40)}"
        time.sleep(0.3)
    # What the trainer was doing is the first thing a reader of a CI failure needs.
    trainer = [c.tail(60) for c in (cluster.children if cluster else []) if c.name == "trainer"]
    raise AssertionError(f"run {run_id} did not finish in {timeout_s}s: {run}\n"
                         f"trainer log:\n{trainer[0] if trainer else '(no cluster given)'}")
