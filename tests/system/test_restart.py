"""No state lives only in a process's memory: services SIGKILLed mid-run and restarted resume.

The run must still finish with invariants 1-3 intact after the manager, the trainer and a
rollout instance are each killed with SIGKILL (no chance to clean up) in the middle of a step
and started again with the same environment.
"""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from rlboost.launcher import Child, Cluster
from tests.support.cluster import wait_run
from tests.support.invariants import check_run

pytestmark = pytest.mark.slow

SPEC = {"steps": 5, "prompts_per_step": 4, "samples_per_prompt": 4, "seed": 5,
        "max_new_tokens": 8}


def child(cluster: Cluster, name: str) -> Child:
    return next(c for c in cluster.children if c.name == name)


def wait_step(client: httpx.Client, run_id: str, step: int, timeout_s: float = 120) -> None:
    """Wait until step ``step`` is under way (its rollout has started)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        run = client.get(f"/v1/runs/{run_id}").json()
        if run["step"] > step or (run["step"] == step and run.get("progress")):
            return
        time.sleep(0.1)
    raise AssertionError(f"step {step} never started")


def kill_and_restart(proc: Child, pause_s: float = 0.5) -> None:
    proc.signal(signal.SIGKILL)
    assert proc.proc is not None
    proc.proc.wait(timeout=10)
    time.sleep(pause_s)
    proc.start()


def test_services_killed_mid_run_resume(cluster: Cluster) -> None:
    url = cluster.env["RLBOOST_MANAGER_URL"]
    with httpx.Client(base_url=url, timeout=10) as client:
        run_id = client.post("/v1/runs", json=SPEC).json()["id"]
        wait_step(client, run_id, 1)
        kill_and_restart(child(cluster, "manager"))
        cluster.wait_http(url)
        wait_step(client, run_id, 2)
        kill_and_restart(child(cluster, "trainer"))
        wait_step(client, run_id, 3)
        kill_and_restart(child(cluster, "spot-0"))
        final = wait_run(client, run_id, timeout_s=240, cluster=cluster)
        assert final["state"] == "succeeded", final
        check_run(client, run_id, SPEC)
