"""Fixtures: real brokers on free ports, and the real services as processes.

No fakes: ``brokers`` starts ``nats-server -js`` and ``redis-server`` from the venv for each
test that asks (about 0.2 s), so fault tests may kill and restart them freely.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rlboost.launcher import Cluster
from shared.stack import Stack


@pytest.fixture
def brokers(tmp_path: Path) -> Iterator[Stack]:
    stack = Stack.create(tmp_path / "brokers")
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def start_cluster(root: Path, stack: Stack, env: dict[str, str] | None = None,
                  **kwargs: Any) -> Cluster:
    """The manager, weight service, trainer and rollout instances as real processes."""
    base = {**stack.env(), "RLBOOST_DATA_DIR": str(root / "data"), "RLBOOST_TORCH_THREADS": "1",
            **(env or {})}
    cluster = Cluster(root, base_env=base, **kwargs)
    cluster.start()
    return cluster


@pytest.fixture
def cluster(brokers: Stack, tmp_path: Path) -> Iterator[Cluster]:
    """The default small cluster: 2 spot and 1 reserved rollout instances, torch engine.
    Test modules that need another shape define their own ``cluster``."""
    c = start_cluster(tmp_path, brokers, spot=2, reserved=1)
    try:
        yield c
    finally:
        c.stop()


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
    raise AssertionError(f"run {run_id} did not finish in {timeout_s}s: {run}")
