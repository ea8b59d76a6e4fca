"""An open adaptive seeding window follows the spot count inside the step, in the manager.

One real manager process on real brokers; the test plays the trainer (poll, start a step) and
two spot instances (heartbeats). The run's controller state is written as if earlier steps had
measured it, so the step's window is long (tens of seconds) and known. One spot instance then
drains inside that window: the dispatcher must choose the window again for one instance
(:func:`manager_svc.seeding.retarget`, which gives a longer one: less spot capacity, more
reserved generation), in the step's hash (what the dispatch and the step record read) and in
the controller's state, with the window's end moved to match.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest
import redis

from manager_svc.seeding import SeedingState, next_window, retarget
from rlboost.stack import Stack
from shared import names
from shared.bus import request
from shared.names import Keys
from shared.protocol import (
    Ack,
    ActiveRun,
    Heartbeat,
    HeartbeatReply,
    InstanceState,
    StepStart,
    TrainerPoll,
)
from tests.support.manager import running_manager

MEASURED = SeedingState(window_s=60.0, tokens=400_000.0, reserved_rate=4000.0,
                        spot_rate_each=1000.0, spot_ready_s=5.0, train_s_per_token=2e-5,
                        spot_count=2, scale=1.1)


@pytest.fixture
def manager(brokers: Stack, tmp_path: Path) -> Iterator[httpx.Client]:
    with running_manager(brokers, tmp_path) as client:
        yield client


def beat(instance_id: str, state: InstanceState) -> Heartbeat:
    return Heartbeat(instance_id=instance_id, kind="spot", engine="emu", state=state,
                     session="s", capacity=4)


async def start_step(nats_url: str, run_id: str) -> None:
    for spot in ("spot-1", "spot-2"):
        await beat_once(nats_url, spot, "ready")
    nc = await nats.connect(nats_url)
    try:
        active = await request(nc, names.TRAINER_POLL, TrainerPoll(trainer_id="t"), ActiveRun)
        assert active.run_id == run_id, active
        ack = await request(nc, names.TRAINER_START, StepStart(
            run_id=run_id, step=0, weight_version=0,
            prompt_token_ids=[[3, 4, 5, 6]] * 4, eos_token_id=2), Ack, 60.0)
        assert ack.ok, ack.detail
    finally:
        await nc.close()


async def beat_once(nats_url: str, instance_id: str, state: InstanceState) -> None:
    """One heartbeat of ``instance_id`` in ``state``, answered on its own inbox."""
    nc = await nats.connect(nats_url, inbox_prefix=names.inbox_prefix(instance_id))
    try:
        await request(nc, names.heartbeat_subject(instance_id), beat(instance_id, state),
                      HeartbeatReply)
    finally:
        await nc.close()


def test_window_is_chosen_again_when_a_spot_instance_drains_inside_it(
        manager: httpx.Client, brokers: Stack) -> None:
    run = manager.post("/v1/runs", json={"model": "emu", "steps": 2, "prompts_per_step": 4,
                                         "samples_per_prompt": 2,
                                         "seeding": {"mode": "adaptive"}}).json()
    r = redis.Redis.from_url(brokers.env()["RLBOOST_REDIS_URL"], decode_responses=True)
    r.hset(Keys.seeding(run["id"]), mapping=MEASURED.dump())
    nats_url = brokers.env()["RLBOOST_NATS_URL"]
    asyncio.run(start_step(nats_url, run["id"]))
    step_key = Keys.step(run["id"], 0)
    started = r.hgetall(step_key)
    chosen = next_window(MEASURED, 2)
    assert started["spot_count"] == "2"
    assert float(started["window_s"]) == pytest.approx(chosen)
    assert chosen > 10.0  # the window is still open when the drain arrives

    asyncio.run(beat_once(nats_url, "spot-2", "draining"))
    deadline = time.monotonic() + 15
    while r.hget(step_key, "spot_count") != "1" and time.monotonic() < deadline:
        time.sleep(0.1)
    moved = r.hgetall(step_key)
    expected = retarget(MEASURED, 1)
    assert expected is not None and expected > chosen
    assert moved["spot_count"] == "1", moved
    assert float(moved["window_s"]) == pytest.approx(expected)
    assert float(moved["window_end"]) == pytest.approx(float(moved["started_at"]) + expected)
    state = SeedingState.load(r.hgetall(Keys.seeding(run["id"])))
    assert state.window_s == pytest.approx(expected)
    assert state.spot_count == 1
