"""An ended run leaves Redis whole after its retention time, its place in the runs index too,
and is still read and listed (from its archive), on a real manager process."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import redis

from rlboost.stack import Stack
from shared.names import Keys
from tests.integration.test_run_queue import page_through
from tests.support.manager import running_manager

RETENTION_S = 1.0
FIELDS = ("id", "state", "step", "steps", "spec", "created_at", "error")


def ended_run(client: httpx.Client) -> dict[str, object]:
    run_id = client.post("/v1/runs", json={"steps": 1}).json()["id"]
    run = client.post(f"/v1/runs/{run_id}/cancel").json()
    assert run["state"] == "cancelled", run
    return {k: run[k] for k in FIELDS}


def test_expired_run_leaves_the_index_and_is_served_from_its_archive(
        brokers: Stack, tmp_path: Path) -> None:
    r = redis.Redis.from_url(brokers.env()["RLBOOST_REDIS_URL"], decode_responses=True)
    with running_manager(brokers, tmp_path, {"RLBOOST_RETENTION_S": str(RETENTION_S)}) as client:
        # Oldest first: ended, live, ended, live: pages must interleave the two sources.
        first = ended_run(client)
        live_a = client.post("/v1/runs", json={"steps": 1}).json()["id"]
        second = ended_run(client)
        live_b = client.post("/v1/runs", json={"steps": 1}).json()["id"]
        ended = [first, second]
        end = time.monotonic() + 10 * RETENTION_S + 10
        while any(r.zscore(Keys.runs, str(run["id"])) is not None for run in ended):
            assert time.monotonic() < end, "an expired run stayed in the runs index"
            time.sleep(0.1)
        for run in ended:
            keys = list(r.scan_iter(match=f"*{run['id']}*", count=1000))
            assert keys == [], keys
            assert r.zscore(Keys.expiring, str(run["id"])) is None
            got = client.get(f"/v1/runs/{run['id']}")
            assert got.status_code == 200, got.text
            assert {k: got.json()[k] for k in FIELDS} == run
        assert r.zscore(Keys.runs, live_a) is not None  # live runs are not pruned
        ids = [live_b, second["id"], live_a, first["id"]]
        assert [i for p in page_through(client, 3) for i in p] == ids
        assert [i for p in page_through(client, 1) for i in p] == ids
        listed = {x["id"]: x for x in client.get("/v1/runs").json()}
        assert listed[str(first["id"])]["state"] == "cancelled"
    # A restarted manager lists them still (the archive's index is on disk).
    with running_manager(brokers, tmp_path, {"RLBOOST_RETENTION_S": str(RETENTION_S)}) as client:
        assert [i for p in page_through(client, 2) for i in p] == ids
    r.close()
