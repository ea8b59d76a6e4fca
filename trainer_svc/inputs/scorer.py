"""Scoring responses safely: reward functions in worker processes, with a timeout per call.

Contract:

- ``RewardScorer(spec, reward_path=..., timeout_s=..., workers=..., pass_env=...)`` runs the reward
  named by ``spec`` (see :mod:`trainer_svc.inputs.rewards`) in ``workers`` child processes
  (:mod:`trainer_svc.inputs.reward_worker`). ``reward_path`` and ``timeout_s`` are passed in by the
  caller (the trainer reads ``RLBOOST_REWARD_PATH`` and ``RLBOOST_REWARD_TIMEOUT_S`` into its
  config); this module reads no settings.
- A worker's environment is :func:`~trainer_svc.inputs.workers.worker_env` of the trainer's:
  only the variables on its list, and the ``pass_env`` names the caller adds
  (RLBOOST_REWARD_ENV). The trainer's tokens and passwords (weights write token, NATS
  password, API token) stay out of reach of the user code a reward runs.
- ``await start()`` starts every worker and resolves the function in each; a spec that names
  nothing importable raises :class:`~trainer_svc.inputs.rewards.RewardNameError` here, naming the
  function and the cause, before any sample is scored.
- ``await score_many([(prompt, response, answer), ...])`` returns ``(rewards, errors)``: one
  reward per item in order, and how many of them failed. A call that raises, returns a
  non-number, runs past ``timeout_s`` or kills its worker scores 0.0 and is counted in
  ``counts`` by kind; the first failure of each kind is logged with its traceback or cause,
  later ones only counted. Nothing a reward function does stops the caller.
- The caller's event loop never blocks: each call waits in a thread of the scorer's own
  pool. A timed-out worker is killed (SIGKILL: a reward stuck in C code cannot be
  interrupted any other way) and replaced before its next call.
- ``await close()`` ends every worker; it is idempotent. ``async with`` does start/close.

Why processes, not threads: a thread that hangs cannot be stopped and keeps its core, and
math-verify refuses to run its ``signal.alarm`` timeouts off a process's main thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from trainer_svc.inputs.rewards import RewardNameError, check_spec
from trainer_svc.inputs.workers import Worker, WorkerStartError, worker_env

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_WORKERS = 2
DEFAULT_START_TIMEOUT_S = 60.0
Item = tuple[str, str, "str | None"]
_MODULE = "trainer_svc.inputs.reward_worker"
log = logging.getLogger(__name__)
_FAILURE_WORDS = {
    "raised": "raised an exception",
    "timeouts": "timed out",
    "invalid": "returned a value that is not a finite number",
    "crashed": "lost its worker process",
}


# The name callers catch: a worker that could not start is not the reward's own failure.
RewardWorkerError = WorkerStartError


@dataclass(slots=True)
class RewardErrorCounts:
    """Failed reward calls since the scorer started, by kind."""

    raised: int = 0  # the function raised
    timeouts: int = 0  # ran past timeout_s; its worker was killed
    invalid: int = 0  # returned something that is not a finite number
    crashed: int = 0  # the worker died mid-call (e.g. the function called os._exit)

    @property
    def total(self) -> int:
        return self.raised + self.timeouts + self.invalid + self.crashed


class RewardScorer:
    """Scores (prompt, response, answer) items with one reward function; see module doc."""

    def __init__(
        self,
        spec: str,
        *,
        reward_path: Sequence[str | Path] = (),
        timeout_s: float = DEFAULT_TIMEOUT_S,
        workers: int = DEFAULT_WORKERS,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        logger: logging.Logger | None = None,
        pass_env: Sequence[str] = (),
    ) -> None:
        """``pass_env``: names of variables the workers get beyond :data:`WORKER_ENV`."""
        check_spec(spec)
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.spec = spec
        self.timeout_s = timeout_s
        self.counts = RewardErrorCounts()
        self._log = logger or log
        self._logged: set[str] = set()
        env = worker_env(os.environ, pass_env)
        init = ("init", spec, [str(p) for p in reward_path])
        self._workers = [Worker(_MODULE, init, start_timeout_s, env, RewardNameError)
                         for _ in range(workers)]
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="reward")
        self._idle: asyncio.Queue[Worker] | None = None
        self._closed = False

    async def start(self) -> None:
        """Start every worker; raises RewardNameError if the function does not resolve."""
        if self._closed:
            raise RuntimeError("scorer is closed")
        if self._idle is not None:
            return
        loop = asyncio.get_running_loop()
        try:
            await asyncio.gather(
                *(loop.run_in_executor(self._threads, w.ensure_started) for w in self._workers)
            )
        except BaseException:
            await self.close()
            raise
        self._idle = asyncio.Queue()
        for w in self._workers:
            self._idle.put_nowait(w)

    async def score_many(self, items: Sequence[Item]) -> tuple[list[float], int]:
        """One reward per item, in order, and the number of failed calls among them."""
        if self._idle is None:
            raise RuntimeError("call start() first")
        results = await asyncio.gather(*(self._score_one(item) for item in items))
        rewards = [value for value, _ in results]
        return rewards, sum(1 for _, failed in results if failed)

    async def _score_one(self, item: Item) -> tuple[float, bool]:
        assert self._idle is not None
        idle = self._idle
        worker = await idle.get()
        fut = asyncio.get_running_loop().run_in_executor(
            self._threads, worker.call, item, self.timeout_s
        )
        try:
            kind, detail = await asyncio.shield(fut)
        finally:
            # A cancelled caller must not hand out a worker its thread is still using.
            if fut.done():
                idle.put_nowait(worker)
            else:
                fut.add_done_callback(lambda _: idle.put_nowait(worker))
        if kind == "ok":
            return float(detail), False
        self._count(kind, str(detail))
        return 0.0, True

    def _count(self, kind: str, detail: str) -> None:
        field = kind if kind in ("raised", "timeouts", "invalid", "crashed") else "crashed"
        setattr(self.counts, field, getattr(self.counts, field) + 1)
        if field not in self._logged:
            self._logged.add(field)
            self._log.error(
                "reward %s %s; the sample scores 0, and later calls that fail this way are "
                "counted, not logged:\n%s", self.spec, _FAILURE_WORDS[field], detail.rstrip(),
            )

    async def close(self) -> None:
        """End every worker (idempotent). Not run on the scorer's pool, whose threads may
        all be waiting on calls that closing the channels ends."""
        if self._closed:
            return
        self._closed = True
        await asyncio.gather(
            *(asyncio.to_thread(w.close) for w in self._workers), return_exceptions=True
        )
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> RewardScorer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
