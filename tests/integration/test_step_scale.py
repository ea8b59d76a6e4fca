"""A big step is created in awaited batches: the manager keeps answering while it is written.

One real manager process on real brokers; the test plays the trainer on the bus (poll, then
start a step of 100,000 responses) while a thread calls ``/healthz`` back to back. Before the
batches, the whole step went to Redis in one pipeline built on the event loop: 32,768
responses stalled ``/healthz`` 1.39 s. The bound asserted here is generous (a loaded CI
machine); the figure measured is printed for the record.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest

from rlboost.stack import Stack
from shared import names
from shared.bus import request
from shared.protocol import Ack, ActiveRun, StepStart, TrainerPoll
from tests.support.manager import running_manager

PROMPTS, SAMPLES = 1000, 100  # 100,000 responses
HEALTHZ_BOUND_S = 0.5  # generous: the point is no stall of seconds, as before


@pytest.fixture
def manager(brokers: Stack, tmp_path: Path) -> Iterator[httpx.Client]:
    with running_manager(brokers, tmp_path) as client:
        yield client


def test_over_cap_spec_is_422_naming_the_setting(manager: httpx.Client) -> None:
    resp = manager.post("/v1/runs", json={"prompts_per_step": 4096, "samples_per_prompt": 512})
    assert resp.status_code == 422, resp.text
    assert "RLBOOST_MAX_STEP_RESPONSES" in resp.json()["detail"]


async def start_step(nats_url: str, run_id: str) -> Ack:
    nc = await nats.connect(nats_url)
    try:
        active = await request(nc, names.TRAINER_POLL, TrainerPoll(trainer_id="t"), ActiveRun)
        assert active.run_id == run_id, active
        prompts = [[3 + (p % 50), 4, 5, 6, 7, 8, 9, 10] for p in range(PROMPTS)]
        return await request(nc, names.TRAINER_START, StepStart(
            run_id=run_id, step=0, weight_version=0, prompt_token_ids=prompts,
            eos_token_id=2), Ack, 120.0)
    finally:
        await nc.close()


def test_healthz_answers_while_a_100k_step_is_created(manager: httpx.Client,
                                                      brokers: Stack) -> None:
    run = manager.post("/v1/runs", json={"model": "emu", "steps": 1, "prompts_per_step": PROMPTS,
                                         "samples_per_prompt": SAMPLES}).json()
    latencies: list[float] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=str(manager.base_url), timeout=30) as client:
            while not done.is_set():
                began = time.perf_counter()
                assert client.get("/healthz").status_code == 200
                latencies.append(time.perf_counter() - began)
                time.sleep(0.005)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    began = time.perf_counter()
    try:
        ack = asyncio.run(start_step(brokers.env()["RLBOOST_NATS_URL"], run["id"]))
    finally:
        done.set()
        prober.join(timeout=30)
    took = time.perf_counter() - began
    assert ack.ok, ack.detail
    progress = manager.get(f"/v1/runs/{run['id']}").json()["progress"]
    assert progress["responses_total"] == PROMPTS * SAMPLES
    assert len(latencies) > 10, latencies
    print(f"created {PROMPTS * SAMPLES} responses in {took:.1f}s; /healthz max "
          f"{max(latencies) * 1000:.0f} ms over {len(latencies)} probes")
    assert max(latencies) < HEALTHZ_BOUND_S
