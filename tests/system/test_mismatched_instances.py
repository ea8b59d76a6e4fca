"""A rollout instance that cannot serve the run's model, as real processes on real brokers.

An ``emu`` engine beside healthy ``torch`` instances on a run of the ``tiny`` model: the emu
instance is quarantined and named (``GET /v1/instances`` and the run's warnings), generates
nothing the run keeps, and the run succeeds with every invariant. With only emu instances the
same run fails, its error naming the mismatch, within RLBOOST_UNSERVED_FAIL_S of its first step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rlboost.launcher import Cluster
from rlboost.stack import Stack
from tests.support.cluster import start_cluster, wait_run
from tests.support.invariants import check_run

pytestmark = pytest.mark.slow

SPEC = {"model": "tiny", "steps": 2, "prompts_per_step": 4, "samples_per_prompt": 4,
        "seed": 3, "max_new_tokens": 8}
WHY = "engine emu cannot serve model tiny"
FAIL_S = 3.0  # RLBOOST_UNSERVED_FAIL_S of the emu-only cluster: short, so the test is quick


@pytest.fixture
def mixed(brokers: Stack, tmp_path: Path) -> Iterator[Cluster]:
    """The default cluster's torch instances (one reserved, one spot) and one emu instance."""
    c = start_cluster(tmp_path, brokers, spot=1, reserved=1)
    try:
        c.add_instance("spot", "emu-0", {"RLBOOST_ENGINE": "emu"})
        yield c
    finally:
        c.stop()


@pytest.fixture
def emu_only(brokers: Stack, tmp_path: Path) -> Iterator[Cluster]:
    c = start_cluster(tmp_path, brokers, env={"RLBOOST_UNSERVED_FAIL_S": str(FAIL_S)},
                      spot=0, reserved=0)
    try:
        for i in range(2):
            c.add_instance("spot", f"emu-{i}", {"RLBOOST_ENGINE": "emu"})
        yield c
    finally:
        c.stop()


def quarantined(client: httpx.Client, timeout_s: float) -> dict[str, Any]:
    """emu-0's row once the instance list shows it quarantined (it does while the run is on)."""
    end = time.monotonic() + timeout_s
    rows: dict[str, dict[str, Any]] = {}
    while time.monotonic() < end:
        rows = {i["id"]: i for i in client.get("/v1/instances").json()}
        row: dict[str, Any] = rows.get("emu-0", {})
        if row.get("state") == "quarantined":
            return row
        time.sleep(0.2)
    raise AssertionError(f"emu-0 was not quarantined in {timeout_s}s: {rows}")


def test_a_mismatched_instance_is_quarantined_and_the_run_succeeds(mixed: Cluster) -> None:
    with httpx.Client(base_url=mixed.env["RLBOOST_MANAGER_URL"], timeout=10) as client:
        run = client.post("/v1/runs", json=SPEC).json()
        row = quarantined(client, 180)
        assert row["reason"] == WHY and row["engine"] == "emu" and row["held"] == 0
        final = wait_run(client, run["id"], timeout_s=300, cluster=mixed)
        assert final["state"] == "succeeded", final
        assert f"instance emu-0 quarantined: {WHY}" in final["warnings"]
        by_step = check_run(client, run["id"], SPEC)
        producers = {i for samples in by_step.values() for s in samples for i in s["instances"]}
        assert producers and "emu-0" not in producers, producers
        metrics = client.get("/metrics").text
        assert 'rlboost_instances_quarantined_total{cause="mismatch"} 1.0' in metrics


def test_a_run_only_mismatched_instances_could_serve_fails_naming_it(emu_only: Cluster
                                                                     ) -> None:
    with httpx.Client(base_url=emu_only.env["RLBOOST_MANAGER_URL"], timeout=10) as client:
        run = client.post("/v1/runs", json=SPEC).json()
        end = time.monotonic() + 180
        while time.monotonic() < end:  # until step 0 exists: from then on it has work pending
            now = client.get(f"/v1/runs/{run['id']}").json()
            if now["state"] == "failed" or now.get("progress", {}).get("state") == "rollout":
                break
            time.sleep(0.1)
        pending_since = time.monotonic()
        final = wait_run(client, run["id"], timeout_s=60, cluster=emu_only)
        waited = time.monotonic() - pending_since
        assert final["state"] == "failed", final
        assert WHY in final["error"] and "emu-0" in final["error"], final["error"]
        assert f"instance emu-0 quarantined: {WHY}" in final["warnings"]
        assert "no instance can serve this run: every live one is quarantined" in \
            final["warnings"]
        # Bounded: FAIL_S after its first step had work, plus polling and a loaded machine.
        assert waited <= FAIL_S + 10, waited
        print(f"failed {waited:.1f}s after step 0 was created (bound {FAIL_S:g}s)")
