"""A finished run leaves Redis after its retention time, and its archive serves it unchanged.

A 50-step emu run with RLBOOST_RETENTION_S of a few seconds: while it runs, each finished step's
samples are read (from Redis, or from the archive once the next step has dropped them); after
it ends, the run, its steps, every step's samples and its events are read again, and once more
after the retention time, when Redis holds (almost) nothing of the run. Every answer must be
the same bytes each time, and the archived run must still satisfy invariants 1-3.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from rlboost.ha_stack import redis_client
from rlboost.launcher import Cluster
from rlboost.stack import Stack
from tests.support.cluster import start_cluster, wait_run
from tests.support.invariants import check_run
from tests.system.test_faults import REWARD

pytestmark = pytest.mark.slow

STEPS, RETENTION_S = 50, 4.0
SPEC = {"model": "emu", "steps": STEPS, "prompts_per_step": 2, "samples_per_prompt": 2,
        "max_new_tokens": 8, "seed": 9, "seeding": {"mode": "off"}}
KEYS_LEFT_MAX = 3  # the "at most a few"; none is expected


@pytest.fixture
def cluster(brokers: Stack, tmp_path: Path) -> Iterator[Cluster]:
    c = start_cluster(tmp_path, brokers, spot=2, reserved=0, engine="emu", env={
        "RLBOOST_EMU_TIME_SCALE": "0.05", "RLBOOST_RETENTION_S": str(RETENTION_S)})
    try:
        yield c
    finally:
        c.stop()


def run_keys(r: redis.Redis | redis.RedisCluster, run_id: str) -> list[str]:
    return sorted(str(k) for k in r.scan_iter(match=f"*{run_id}*", count=1000))


def snapshot(client: httpx.Client, run_id: str) -> dict[str, bytes]:
    """Every read of the run the REST API offers, as the bytes it answered."""
    paths = [f"/v1/runs/{run_id}/steps", f"/v1/runs/{run_id}/events",
             f"/v1/runs/{run_id}/checkpoints",
             *(f"/v1/runs/{run_id}/steps/{n}/samples" for n in range(STEPS))]
    out = {}
    for path in paths:
        resp = client.get(path)
        assert resp.status_code == 200, (path, resp.text)
        out[path] = resp.content
    run = client.get(f"/v1/runs/{run_id}").json()
    out["run"] = repr({k: run[k] for k in ("id", "state", "step", "steps", "spec", "error")})
    return out


def test_finished_run_leaves_redis_and_is_served_from_its_archive(
        cluster: Cluster, brokers: Stack, tmp_path: Path) -> None:
    r = redis_client(brokers.env()["RLBOOST_REDIS_URL"])
    url = cluster.env["RLBOOST_MANAGER_URL"]
    with httpx.Client(base_url=url, timeout=10) as client:
        run_id = client.post("/v1/runs", json=SPEC).json()["id"]
        during: dict[int, bytes] = {}  # a step's samples read while the run went on
        end = time.monotonic() + 300
        while time.monotonic() < end:
            run = client.get(f"/v1/runs/{run_id}").json()
            if run["step"] > 0 and run["step"] - 1 not in during:
                resp = client.get(f"/v1/runs/{run_id}/steps/{run['step'] - 1}/samples")
                during[run["step"] - 1] = resp.content
            if run["state"] != "running" and run["state"] != "queued":
                break
            time.sleep(0.05)
        assert wait_run(client, run_id, 60, cluster)["state"] == "succeeded"
        ended = snapshot(client, run_id)
        keys_at_end = run_keys(r, run_id)
        time.sleep(RETENTION_S + 1.0)
        left = run_keys(r, run_id)
        print(f"Redis keys of the run: {len(keys_at_end)} when it ended, {len(left)} after "
              f"its retention time ({left}); {len(during)} steps read while it ran")
        assert len(left) <= KEYS_LEFT_MAX, left
        assert len(keys_at_end) > len(left)  # the count can fail: something did expire
        archived = snapshot(client, run_id)
        assert archived == ended
        for step, content in during.items():
            assert content == archived[f"/v1/runs/{run_id}/steps/{step}/samples"], step
        assert len(during) >= STEPS // 4, "too few steps seen while running to compare"
        check_run(client, run_id, SPEC, REWARD)
        files = sorted((tmp_path / "data" / "archive" / run_id).glob("step-*.json.gz"))
        assert len(files) == STEPS
    r.close()
