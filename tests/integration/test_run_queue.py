"""The run queue is bounded and GET /v1/runs pages, on a real manager process."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from rlboost.stack import Stack
from tests.support.manager import running_manager

LIMIT = 3
RACERS = 16  # concurrent POSTs against a queue with room for LIMIT


def start_first_run(client: httpx.Client) -> None:
    """The manager makes the first run the running one at once; no trainer ever starts its
    step, so it runs on and every later run stays queued."""
    first = client.post("/v1/runs", json={"steps": 1}).json()["id"]
    end = time.monotonic() + 10
    while client.get(f"/v1/runs/{first}").json()["state"] != "running":
        assert time.monotonic() < end, "the first run never started"
        time.sleep(0.05)


def test_queue_past_its_limit_is_429_naming_the_setting(brokers: Stack, tmp_path: Path) -> None:
    env = {"RLBOOST_MAX_QUEUED_RUNS": str(LIMIT)}
    with running_manager(brokers, tmp_path, env) as client:
        start_first_run(client)
        queued = [client.post("/v1/runs", json={"steps": 1}) for _ in range(LIMIT)]
        assert [r.status_code for r in queued] == [201] * LIMIT
        refused = client.post("/v1/runs", json={"steps": 1})
        assert refused.status_code == 429, refused.text
        assert "RLBOOST_MAX_QUEUED_RUNS" in refused.json()["detail"]
        # A cancelled run leaves the queue: there is room again.
        client.post(f"/v1/runs/{queued[0].json()['id']}/cancel")
        assert client.post("/v1/runs", json={"steps": 1}).status_code == 201


async def post_at_once(base_url: str, count: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        return list(await asyncio.gather(
            *(client.post("/v1/runs", json={"steps": 1}) for _ in range(count))))


def test_concurrent_posts_never_queue_past_the_limit(brokers: Stack, tmp_path: Path) -> None:
    """The check and the enqueue are one step: POSTs in flight together still queue LIMIT
    runs at most, and every other one is a 429 naming the setting."""
    env = {"RLBOOST_MAX_QUEUED_RUNS": str(LIMIT)}
    with running_manager(brokers, tmp_path, env) as client:
        start_first_run(client)
        answers = asyncio.run(post_at_once(str(client.base_url), RACERS))
        codes = sorted(r.status_code for r in answers)
        assert codes == [201] * LIMIT + [429] * (RACERS - LIMIT), codes
        for refused in (r for r in answers if r.status_code == 429):
            assert "RLBOOST_MAX_QUEUED_RUNS" in refused.json()["detail"]
        states = [r["state"] for r in client.get("/v1/runs").json()]
        assert states.count("queued") == LIMIT, states
        assert len(states) == LIMIT + 1  # a refused POST leaves no run behind


def page_through(client: httpx.Client, limit: int) -> list[list[str]]:
    pages, cursor = [], None
    while True:
        params: dict[str, str | int] = {"limit": limit}
        if cursor is not None:
            params["cursor"] = cursor
        resp = client.get("/v1/runs", params=params)
        assert resp.status_code == 200, resp.text
        pages.append([r["id"] for r in resp.json()])
        cursor = resp.headers.get("X-Next-Cursor")
        if cursor is None:
            return pages


def test_runs_are_paged_newest_first_without_gaps(brokers: Stack, tmp_path: Path) -> None:
    with running_manager(brokers, tmp_path) as client:
        made = [client.post("/v1/runs", json={"steps": 1}).json()["id"] for _ in range(7)]
        pages = page_through(client, 3)
        assert [len(p) for p in pages] == [3, 3, 1]
        assert [i for p in pages for i in p] == made[::-1]
        listed = client.get("/v1/runs").json()  # no parameters: as before, with every field
        assert [r["id"] for r in listed] == made[::-1]
        assert {"id", "state", "step", "steps"} <= set(listed[0])
        assert client.get("/v1/runs", params={"limit": 0}).status_code == 422
        for bad in ("nan", "inf", "-inf", "soon"):  # a cursor is a finite creation time
            resp = client.get("/v1/runs", params={"cursor": bad})
            assert resp.status_code == 422 and resp.json()["detail"], (bad, resp.text)
