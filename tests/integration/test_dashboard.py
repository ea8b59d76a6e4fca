"""The dashboard at /ui in real headless Chromium, on a real manager with a long synthetic run.

One run of 1,000 steps and 100 instances (100,000 instance events) is written into Redis as
the manager would have written it (tests/support/synthetic.py); the page must load it with a
bounded DOM, then take 10 more steps from the live stream as incremental updates (no chart
rebuilt, no new rows beyond the bounded tables). The run list, the login, a refused token and
the cancel button are driven as a person would. The REST routes behind the page (events,
stream, warnings) are checked directly too.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from rlboost.launcher import Child
from rlboost.stack import Stack
from shared.names import Keys
from shared.ports import free_port
from tests.support.browser import chromium, log_in, page_errors
from tests.support.synthetic import fill_run

TOKEN = "dash-s3cret"
STEPS, INSTANCES = 1000, 100
DOM_MAX = 2500  # elements on the run page, whatever the run's length


@pytest.fixture
def manager(brokers: Stack, tmp_path: Path) -> Iterator[tuple[str, httpx.Client]]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    child = Child("manager", [sys.executable, "-m", "manager_svc"], {
        **brokers.env(), "RLBOOST_MANAGER_URL": base, "RLBOOST_DATA_DIR": str(tmp_path / "data"),
        "RLBOOST_API_TOKEN": TOKEN}, tmp_path / "manager.log")
    child.start()
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"},
                      timeout=30) as client:
        for _ in range(300):
            try:
                if client.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        else:
            pytest.fail(f"manager did not start:\n{child.tail()}")
        yield base, client
    child.signal(15)
    assert child.proc is not None
    child.proc.wait(timeout=15)


def running_run(client: httpx.Client, r: redis.Redis, steps: int) -> str:
    """A run the manager shows as running at ``steps``, with no trainer behind it."""
    run_id: str = client.post("/v1/runs", json={"steps": steps + 100}).json()["id"]
    r.lrem(Keys.queue, 0, run_id)
    r.delete(Keys.active)
    r.hset(Keys.run(run_id), "state", "running")
    return run_id


def test_events_stream_and_warnings_routes(manager: tuple[str, httpx.Client],
                                           brokers: Stack) -> None:
    base, client = manager
    r = redis.Redis.from_url(brokers.env()["RLBOOST_REDIS_URL"], decode_responses=True)
    run_id = running_run(client, r, 0)
    t0 = time.time() - 100
    fill_run(r, run_id, 0, 30, 4, t0=t0)
    first = client.get(f"/v1/runs/{run_id}/events", params={"limit": 10}).json()
    assert len(first) == 10 and first[0]["type"] == "join" and first[0]["t"] == pytest.approx(
        t0, abs=0.01)
    rest = client.get(f"/v1/runs/{run_id}/events", params={"after": first[-1]["id"]}).json()
    assert len(first) + len(rest) == r.xlen(Keys.events(run_id))
    assert {e["id"] for e in first}.isdisjoint(e["id"] for e in rest)
    assert client.get(f"/v1/runs/{run_id}/events", params={"after": "x"}).status_code == 422
    assert client.get("/v1/runs/run-nope/events").status_code == 404
    assert httpx.get(f"{base}/v1/runs/{run_id}/events").status_code == 401
    assert httpx.get(f"{base}/v1/runs/{run_id}/stream").status_code == 401

    r.rpush(Keys.run_warnings(run_id), "tracker wandb did not start: ImportError")
    assert client.get(f"/v1/runs/{run_id}").json()["warnings"] == [
        "tracker wandb did not start: ImportError"]

    # The stream: the run, then the records after steps_from and the events after the id
    # given, then (the run ended) an end frame.
    r.hset(Keys.run(run_id), "state", "cancelled")
    frames: list[tuple[str, Any]] = []
    with client.stream("GET", f"/v1/runs/{run_id}/stream",
                       params={"steps_from": 25, "events_after": rest[-3]["id"]}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        event = ""
        for line in resp.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                frames.append((event, json.loads(line[6:])))
    kinds = [k for k, _ in frames]
    assert kinds == ["run", "steps", "events", "end"], kinds
    assert frames[0][1]["state"] == "cancelled"
    assert [s["step"] for s in frames[1][1]["records"]] == [25, 26, 27, 28, 29]
    assert [e["id"] for e in frames[2][1]] == [e["id"] for e in rest[-2:]]


def test_dashboard_stays_bounded_and_incremental_with_1000_steps_and_100_instances(
        manager: tuple[str, httpx.Client], brokers: Stack, tmp_path: Path) -> None:
    base, client = manager
    r = redis.Redis.from_url(brokers.env()["RLBOOST_REDIS_URL"], decode_responses=True)
    run_id = running_run(client, r, STEPS)
    t0 = time.time() - 2.0 * STEPS - 30
    fill_run(r, run_id, 0, STEPS, INSTANCES, t0=t0)
    with chromium() as browser:
        page = browser.new_page()
        errors = page_errors(page)
        log_in(page, base, TOKEN)
        assert page.locator(f"#runs-body tr[data-run='{run_id}']").count() == 1
        started = time.monotonic()
        page.click(f"#runs-body tr[data-run='{run_id}'] a")
        page.wait_for_function("window.rlboost.ready && window.rlboost.charts.reward")
        loaded_s = time.monotonic() - started
        points = page.evaluate("window.rlboost.charts.reward.plot.data[0].length")
        assert points == STEPS
        assert page.locator("#inst-body tr").count() == INSTANCES
        preempted = sum(1 for i in range(INSTANCES // 4, INSTANCES) if i % 10 == 0)
        assert page.locator("#inst-body tr[data-fate='preempted']").count() == preempted
        dom = page.evaluate("document.getElementsByTagName('*').length")
        assert dom < DOM_MAX, dom
        full = page.evaluate("window.rlboost.renders.full")

        fill_run(r, run_id, STEPS, STEPS + 10, INSTANCES, t0=t0)  # the live stream's turn
        page.wait_for_function(
            f"window.rlboost.charts.reward.plot.data[0].length === {STEPS + 10}", timeout=15000)
        assert page.evaluate("window.rlboost.renders.full") == full  # nothing rebuilt
        assert page.evaluate("window.rlboost.renders.incremental") > 0
        grown = page.evaluate("document.getElementsByTagName('*').length") - dom
        assert grown <= 0, f"the DOM grew by {grown} elements for 10 steps"
        assert "step 1010/1100" in page.inner_text("#run-progress")
        page.screenshot(path=str(tmp_path / "long-run.png"), full_page=True)
        print(f"1,000 steps x 100 instances: page ready in {loaded_s:.2f}s, {dom} elements")
        assert errors == []


def test_login_refusal_and_cancel(manager: tuple[str, httpx.Client], brokers: Stack) -> None:
    base, client = manager
    r = redis.Redis.from_url(brokers.env()["RLBOOST_REDIS_URL"], decode_responses=True)
    run_id = running_run(client, r, 0)
    with chromium() as browser:
        page = browser.new_page()
        errors = page_errors(page)
        page.goto(f"{base}/ui/")
        page.fill("#token", "wrong")
        page.click("#login button")
        page.wait_for_function("document.querySelector('#login-error').textContent.length > 0")
        assert "refused" in page.inner_text("#login-error")
        assert page.evaluate("sessionStorage.getItem('rlboost.token')") == "wrong"
        page.fill("#token", TOKEN)
        page.click("#login button")
        page.wait_for_selector(f"#runs-body tr[data-run='{run_id}']")
        page.goto(f"{base}/ui/#/runs/{run_id}")  # a reload keeps the token (this tab only)
        page.wait_for_function("window.rlboost.ready && window.rlboost.view === 'run'")
        page.once("dialog", lambda d: d.accept())
        page.click("#cancel")
        page.wait_for_function("document.querySelector('#run-state').textContent === 'cancelled'")
        assert client.get(f"/v1/runs/{run_id}").json()["state"] == "cancelled"
        # 401s are the refused token above, which the page handles: filter the browser's own
        # "Failed to load resource" lines for them, and nothing else may appear.
        assert [e for e in errors if "401" not in e] == []
