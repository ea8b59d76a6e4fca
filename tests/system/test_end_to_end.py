"""End to end: all four services as real processes on real brokers, a run through REST.

Checks the design's invariants 1-3 on what the samples endpoint says the trainer trained on:
exactly one complete response per (prompt, sample), every token from the step's weight version,
and a barrier digest the trainer verified (a mismatch fails the run).
"""

from __future__ import annotations

import httpx
import pytest

from rlboost.launcher import Cluster
from tests.support.cluster import wait_run
from tests.support.invariants import check_run, step_records

pytestmark = pytest.mark.slow

SPEC = {"steps": 3, "prompts_per_step": 4, "samples_per_prompt": 4, "seed": 11,
        "max_new_tokens": 8}


def test_three_step_run_keeps_invariants(cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], timeout=10) as client:
        run = client.post("/v1/runs", json=SPEC).json()
        final = wait_run(client, run["id"], timeout_s=240, cluster=cluster)
        assert final["state"] == "succeeded", final
        assert final["step"] == SPEC["steps"]
        check_run(client, run["id"], SPEC)
        for record in step_records(client, run["id"]):
            assert record["duplicate_chunks_dropped"] == 0
            assert record["stale_chunks_rejected"] == 0
        instances = client.get("/v1/instances").json()
        assert {i["kind"] for i in instances} == {"reserved", "spot"}
        assert all(i["engine"] == "torch" for i in instances)
        metrics = client.get("/metrics").text
        assert "rlboost_tokens_committed_total" in metrics
