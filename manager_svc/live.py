"""A run as it happens: the server-sent-event feed behind ``GET /v1/runs/{id}/stream``.

Contract: :func:`run_stream` yields SSE frames (``event: NAME`` + one ``data:`` JSON line)
until the run has ended and everything about it has been sent, the client goes away or the
manager stops. Frames: ``run`` (the run with its current step's progress, whenever it
changes), ``steps`` (step records not sent yet, in order, with their step index), ``events``
(instance events after the last one sent) and a final ``end``. The client says where it
already is (``steps_from``, ``events_after``), so a reconnect resumes without a gap or a
repeat. The feed polls Redis every :data:`POLL_S` rather than blocking on it: a blocked read
would hold one connection of the manager's pool per open page. Everything sent is read from
Redis, so any manager replica serves the same feed.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio

from manager_svc.events import InstanceEvents
from manager_svc.runs import TERMINAL, RunStore

POLL_S = 0.5
PING_S = 15.0  # a comment line now and then keeps proxies from closing an idle stream
STEPS_PAGE = 500  # records per frame at most; a late joiner catches up over a few frames


def frame(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def run_stream(runs: RunStore, events: InstanceEvents, run_id: str, steps_from: int,
                     events_after: str | None, gone: Callable[[], Awaitable[bool]],
                     stopping: Callable[[], bool]) -> AsyncIterator[bytes]:
    last_run: dict[str, Any] | None = None
    sent_steps, last_event = max(0, steps_from), events_after
    pinged = time.monotonic()
    while not stopping() and not await gone():
        run = await runs.get(run_id)
        if run is None:
            yield frame("end", {"reason": "the run is gone"})
            return
        run["progress"] = await runs.step_progress(run_id, run["step"])
        run["warnings"] = await runs.warnings(run_id)
        if run != last_run:
            yield frame("run", run)
            last_run = run
        records = await runs.step_records(run_id, sent_steps, sent_steps + STEPS_PAGE - 1)
        if records:
            yield frame("steps", {"from": sent_steps, "records": records})
            sent_steps += len(records)
        new = await events.read(run_id, last_event)
        if new:
            yield frame("events", new)
            last_event = new[-1]["id"]
        caught_up = len(records) < STEPS_PAGE and not new
        if run["state"] in TERMINAL and caught_up:
            yield frame("end", {"state": run["state"]})
            return
        if time.monotonic() - pinged > PING_S:
            yield b": ping\n\n"
            pinged = time.monotonic()
        if caught_up:
            await anyio.sleep(POLL_S)
