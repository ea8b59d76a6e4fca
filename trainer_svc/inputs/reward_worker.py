"""The reward worker process: resolves one reward function and scores samples on request.

Contract (the only peer is :class:`trainer_svc.inputs.scorer.RewardScorer`):

- Started by :class:`trainer_svc.inputs.workers.Worker` (a socket pair of length-framed
  pickles; a reward function that prints cannot corrupt the channel).
- First message ``("init", spec, reward_path)``; the reply is ``("ready", "")`` or
  ``("init_error", cause)`` (then it exits). Each later message is one sample
  ``(prompt, response, answer)``; the reply is ``("ok", float)``, ``("raised", traceback)``
  or ``("invalid", message)`` for a value that is not a finite real number (a bool counts
  as 1.0 or 0.0). ``None`` or a
  closed channel ends the worker.
- The function runs on this process's main thread (so math-verify's ``signal.alarm``
  timeouts work); an ``async def`` one runs to completion on an event loop the worker keeps.
  The caller enforces the per-call timeout by killing the process: nothing here needs to
  be interruptible.
- A worker whose parent dies exits within a second, even mid-call, rather than spin on
  (:func:`trainer_svc.inputs.workers.worker_main`).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

from trainer_svc.inputs.rewards import RewardFn, RewardNameError, resolve_reward
from trainer_svc.inputs.workers import worker_main


def _score(fn: RewardFn, loop: asyncio.AbstractEventLoop, item: Any) -> tuple[str, Any]:
    prompt, response, answer = item
    try:
        value: Any = fn(prompt, response, answer)
        if inspect.isawaitable(value):
            value = loop.run_until_complete(value)
    except Exception:
        return "raised", traceback.format_exc()
    # bool is a Real: True/False score 1.0/0.0, as verify()-style functions return them.
    if not isinstance(value, numbers.Real):
        return "invalid", f"returned {type(value).__name__} {value!r}, not a float"
    number = float(value)
    if not math.isfinite(number):
        return "invalid", f"returned {number!r}, not a finite float"
    return "ok", number


def serve(conn: Connection) -> None:
    """Answer one init message, then samples, until told to stop."""
    kind, spec, reward_path = conn.recv()
    if kind != "init":
        raise RuntimeError(f"expected init, got {kind!r}")
    try:
        fn = resolve_reward(spec, reward_path)
    except RewardNameError as exc:
        conn.send(("init_error", exc.cause))
        return
    conn.send(("ready", ""))
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                item = conn.recv()
            except EOFError:
                return
            if item is None:
                return
            conn.send(_score(fn, loop, item))
    finally:
        loop.close()


def main(argv: list[str]) -> None:
    worker_main(argv, serve)


if __name__ == "__main__":
    main(sys.argv[1:])
