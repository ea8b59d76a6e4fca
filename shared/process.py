"""Process hygiene for services started by a launcher (``rlboost up``, tests).

A launcher that dies must not leave its services running. The kernel's parent-death signal is
no good here: it fires when the *thread* that forked the child exits, and launchers (fault
injectors in particular) spawn from threads. So the launcher passes its pid in
RLBOOST_PARENT_PID, and :func:`die_with_parent` watches it from a daemon thread: once the
launcher is gone the service gets SIGTERM, its ordinary graceful-shutdown path. That path
must always end: :func:`wait_event` is the wait a service's loops use, and
:func:`cancel_and_wait` how they are stopped, so that no stop can be lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from typing import Any

CHECK_S = 1.0


def exit_on_sigterm() -> None:
    """For launchers: SIGTERM raises SystemExit, so ``finally`` blocks stop the children (and
    the brokers, which are not Python and cannot watch their parent) instead of orphaning them."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def die_with_parent() -> None:
    parent = os.environ.get("RLBOOST_PARENT_PID")
    if not parent or not parent.isdigit():
        return
    pid = int(parent)

    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(CHECK_S)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # a service that ignores SIGTERM too long is not left behind
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``event``; return whether it is set.

    Not ``asyncio.wait_for(event.wait(), timeout)``: on Python 3.11 a cancel that arrives as the
    event fires is swallowed (wait_for returns the result instead; CPython gh-86296), so a loop
    built on it runs on after its task was cancelled and a service stopping at that moment hung
    on SIGTERM. ``asyncio.timeout`` keeps a cancel from outside distinct from its own expiry.
    """
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()
    return event.is_set()


RECANCEL_S = 1.0  # how often cancel_and_wait repeats its cancel


async def cancel_and_wait(task: asyncio.Task[Any], timeout: float | None = None) -> bool:
    """Cancel ``task`` and wait for it to end; return whether it did within ``timeout``.

    The cancel is repeated every ``RECANCEL_S``: code built on 3.11's ``asyncio.wait_for``
    (nats-py's request among it) can drop one, and a loop around it then runs on. A task's own
    clean-up after a cancel has that long before the next one lands."""
    end = None if timeout is None else time.monotonic() + timeout
    while not task.done():
        task.cancel()
        wait = RECANCEL_S if end is None else min(RECANCEL_S, end - time.monotonic())
        if wait <= 0:
            break
        await asyncio.wait([task], timeout=wait)
    return task.done()
