"""Stopping always ends.

A service's loops wait on events with timeouts. On Python 3.11 ``asyncio.wait_for`` drops a
cancel that arrives as the awaited event fires, and a manager stopped at that moment hung on
SIGTERM (its loop ran on and ``stop()`` awaited it forever). These tests pin the three guards:
the wait itself passes the cancel on, the manager's loops also end on ``soft.stopping`` alone,
and ``stop()`` does not wait without bound for a loop that misses its cancel. Real brokers, the
manager in this process. A trainer told to stop mid-step: tests/system/test_trainer_stop.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from manager_svc.service import STOP_WAIT_S, ManagerService
from rlboost.stack import Stack
from shared import process
from shared.config import ManagerConfig
from shared.ports import free_port
from shared.process import wait_event


async def test_a_cancel_that_lands_as_the_event_fires_still_ends_the_loop() -> None:
    event, turns = asyncio.Event(), 0

    async def loop() -> None:
        nonlocal turns
        while True:
            await wait_event(event, 10.0)
            turns += 1
            event.clear()

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)  # the loop is now waiting
    event.set()  # wakes the waiter in the same turn of the event loop as the cancel below
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=2.0)
    try:
        assert done, f"the cancel was lost: the loop went on ({turns} turns)"
        assert task.cancelled()
    finally:
        task.cancel()


async def test_cancel_and_wait_ends_a_task_that_drops_a_cancel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(process, "RECANCEL_S", 0.1)

    async def drops_one() -> None:
        with contextlib.suppress(asyncio.CancelledError):  # as nats-py's request can, on 3.11
            await asyncio.sleep(10.0)
        await asyncio.sleep(10.0)  # the repeated cancel lands here

    task = asyncio.create_task(drops_one())
    await asyncio.sleep(0)
    try:
        assert await asyncio.wait_for(process.cancel_and_wait(task), 5.0)
        assert task.cancelled()
    finally:
        task.cancel()


async def test_wait_event_reports_set_or_timed_out() -> None:
    event = asyncio.Event()
    assert not await wait_event(event, 0.01)
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_event(event, 5.0)


@pytest.fixture
async def service(brokers: Stack, tmp_path: Path) -> AsyncIterator[ManagerService]:
    cfg = ManagerConfig.from_env({
        **brokers.env(), "RLBOOST_MANAGER_URL": f"http://127.0.0.1:{free_port()}",
        "RLBOOST_DATA_DIR": str(tmp_path / "data"),
    })
    svc = ManagerService(cfg)
    await svc.start()
    yield svc
    svc.soft.stopping = False  # let stop() run its closing steps whatever the test left
    await asyncio.wait_for(svc.stop(), 30.0)


async def test_manager_loops_end_on_stopping_even_without_a_cancel(
    service: ManagerService,
) -> None:
    assert len(service._tasks) == 3 and not any(t.done() for t in service._tasks)
    service.soft.wake.set()
    service.soft.stopping = True
    _, running = await asyncio.wait(service._tasks, timeout=5.0)
    assert not running, f"still running after soft.stopping: {running}"
    assert all(t.exception() is None for t in service._tasks)


async def test_stop_returns_when_a_loop_ignores_its_cancel(service: ManagerService) -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            # In effect what a loop hit by the wait_for bug does: it carries on.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(10.0)

    task = asyncio.create_task(stubborn(), name="stubborn")
    service._tasks.append(task)
    try:
        await asyncio.wait_for(service.stop(), STOP_WAIT_S + 10.0)
        assert all(t.done() for t in service._tasks if t is not task)
        assert service.nc.is_closed
    finally:
        release.set()
        task.cancel()
        await asyncio.wait([task], timeout=20.0)
