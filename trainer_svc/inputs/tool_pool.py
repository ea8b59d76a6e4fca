"""The tool pool: an environment's episodes in worker processes, each call with a timeout.

Where tools run, and why: on the reserved side, in worker processes beside the reward
workers on the trainer's host, never on a rollout instance. A spot instance is less trusted
(the manager already fences and checks its tokens); an observation it produced could be
forged, and it may vanish mid-call. Here observations are produced on the trusted side,
where the commit path writes them into the trajectory.

Contract:

- ``EnvPool(spec, dirs=..., tool_s=..., workers=..., max_turns=..., max_observation_tokens=...,
  fit=..., registry=..., pass_env=...)``: ``spec`` is the run's ``env``
  (:mod:`trainer_svc.inputs.envs`), ``dirs`` the reward path, ``tool_s`` the run's
  ``max_tool_s``. ``await start()`` starts the workers and resolves the factory in each: a
  spec that names nothing raises :class:`~trainer_svc.inputs.envs.EnvNameError` there.
- ``await open(request_id, prompt, answer, seed)`` starts an episode on the least busy worker;
  ``await step(request_id, turn, action)`` runs its turn ``turn`` (0-based) with
  ``call_id = shared.names.call_id(request_id, turn)``; ``await end(request_id)`` drops it.
  ``open`` returns None, or a failed :class:`Outcome` when the factory raised; ``step``
  always returns an :class:`Outcome` and never raises for what the environment does.
- ``holds(request_id)``: whether the episode is open here and its worker still has it.
  ``await restore(request_id, turn, history)`` hands a reopened episode (this process
  restarted, or the episode's worker was killed) its committed turns, through the
  environment's optional ``restore(history)`` (docs/agentic.md): None, or a failed Outcome
  (reason ``restore``) with turn ``turn``'s call id.
- Concurrency: one call at a time per worker, so ``workers`` bounds the calls running at once;
  an episode stays on its worker (its state lives there).
- Failures (``Outcome.error``): ``factory`` (the factory raised), ``raised`` (step raised),
  ``invalid`` (a value outside the contract: not a dict, a non-string observation, a reward
  that is not a finite number, ...), ``timeout`` (no answer within ``tool_s``: the worker is
  killed, SIGKILL to its process group), ``crashed`` (the worker died), ``lost`` (the episode's
  worker was killed for another episode's call), ``restore`` (its ``restore`` raised),
  ``max_turns`` (a turn past the run's ``max_turns``). Each ends the episode: ``done`` True,
  ``reward`` 0.0, ``observation`` None, the cause in ``detail``. Each is counted
  (``rlboost_env_call_failures_total{reason}``; timeouts also in
  ``rlboost_env_call_timeouts_total``) and the first of each reason is logged with its
  detail, later ones only counted. The run goes on.
- Limits that cut rather than fail: an observation over ``max_observation_tokens`` (by
  ``fit``: the run's tokenizer, see :func:`tokenizer_fit`; without one, UTF-8 bytes, a bound
  no tokenizer's count exceeds) is cut to the budget, ``truncated`` set and counted
  (``rlboost_env_observations_truncated_total``); a step at the last allowed turn that is not
  done is made done, its observation dropped (the model has no turn left to read it).
- Counters: ``rlboost_env_calls_total`` (steps sent to an environment, failures included).
  ``rlboost_env_calls_committed_total`` is the commit path's to count, by :meth:`committed`,
  once per observation written into a trajectory: a call executed twice (a fault between
  executing and committing) counts twice in the first and once in the second.
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from shared.names import call_id
from trainer_svc.inputs.envs import EnvNameError, check_spec
from trainer_svc.inputs.workers import Worker, worker_env

Fit = Callable[[str, int], "tuple[str, bool]"]
DEFAULT_WORKERS = 4
DEFAULT_START_TIMEOUT_S = 60.0
FAILED_REWARD = 0.0
_MODULE = "trainer_svc.inputs.env_worker"
# A failure's reason, by the worker's or the caller's word for it.
_REASONS = {"factory": "factory", "raised": "raised", "invalid": "invalid",
            "timeouts": "timeout", "crashed": "crashed", "lost": "lost", "max_turns": "max_turns",
            "restore": "restore"}
log = logging.getLogger(__name__)


def byte_fit(text: str, budget: int) -> tuple[str, bool]:
    """``text`` cut to ``budget`` UTF-8 bytes (a character never split), and whether it was."""
    data = text.encode()
    if len(data) <= budget:
        return text, False
    return data[:budget].decode(errors="ignore"), True


def tokenizer_fit(tokenizer: Any) -> Fit:
    """A :data:`Fit` counting the run's tokenizer's tokens (an HF tokenizer)."""
    def fit(text: str, budget: int) -> tuple[str, bool]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= budget:
            return text, False
        return str(tokenizer.decode(ids[:budget])), True
    return fit


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one step gave: the contract's three fields, plus how it went."""

    call_id: str
    observation: str | None
    reward: float | None
    done: bool
    error: str | None = None  # the failure's reason (module doc); None: the step ran
    detail: str = ""  # the failure's traceback or cause
    truncated: bool = False  # the observation was cut to the token budget


@dataclass(frozen=True, slots=True)
class EnvCounters:
    """The pool's counters, made once per registry: a trainer opens a pool per run."""

    calls: Counter
    failures: Counter
    timeouts: Counter
    truncated: Counter
    committed: Counter

    @staticmethod
    def of(registry: CollectorRegistry) -> EnvCounters:
        made = _COUNTERS.get(registry)
        if made is None:
            made = _COUNTERS[registry] = EnvCounters(
                Counter("rlboost_env_calls_total", "Environment steps executed",
                        registry=registry),
                Counter("rlboost_env_call_failures_total", "Environment calls that failed, by "
                        "reason (the episode ended)", ["reason"], registry=registry),
                Counter("rlboost_env_call_timeouts_total", "Environment calls killed past "
                        "max_tool_s", registry=registry),
                Counter("rlboost_env_observations_truncated_total", "Observations cut to "
                        "max_observation_tokens", registry=registry),
                Counter("rlboost_env_calls_committed_total", "Observations committed into "
                        "trajectories", registry=registry))
        return made


_COUNTERS: weakref.WeakKeyDictionary[CollectorRegistry, EnvCounters] = (
    weakref.WeakKeyDictionary())


@dataclass(slots=True)
class _Slot:
    worker: Worker
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    episodes: set[str] = field(default_factory=set)


class EnvPool:
    """Episodes of one environment in worker processes; see the module doc."""

    def __init__(self, spec: str, *, dirs: Sequence[str | Path] = (), tool_s: float = 10.0,
                 workers: int = DEFAULT_WORKERS, max_turns: int = 1,
                 max_observation_tokens: int = 256, fit: Fit = byte_fit,
                 registry: CollectorRegistry | None = None, pass_env: Sequence[str] = (),
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
                 logger: logging.Logger | None = None) -> None:
        check_spec(spec)
        if workers < 1 or tool_s <= 0 or max_turns < 1 or max_observation_tokens < 1:
            raise ValueError(f"env pool: workers {workers}, tool_s {tool_s}, max_turns "
                             f"{max_turns}, max_observation_tokens {max_observation_tokens}: "
                             "each must be positive")
        self.spec, self.tool_s, self.max_turns = spec, tool_s, max_turns
        self.workers = workers  # calls that can run at once
        self.budget, self.fit = max_observation_tokens, fit
        self._log = logger or log
        self._logged: set[str] = set()
        init = ("init", spec, [str(d) for d in dirs], tool_s)
        env = worker_env(os.environ, pass_env)
        self._slots = [_Slot(Worker(_MODULE, init, start_timeout_s, env, EnvNameError))
                       for _ in range(workers)]
        self._where: dict[str, _Slot] = {}
        self._lost: set[str] = set()
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="env")
        self._started = self._closed = False
        counters = EnvCounters.of(registry if registry is not None else CollectorRegistry())
        self.calls, self.failures = counters.calls, counters.failures
        self.timeouts, self.truncated = counters.timeouts, counters.truncated
        self.committed_calls = counters.committed

    async def start(self) -> None:
        """Start every worker; raises EnvNameError if the factory does not resolve."""
        if self._closed:
            raise RuntimeError("env pool is closed")
        if self._started:
            return
        loop = asyncio.get_running_loop()
        try:
            await asyncio.gather(*(loop.run_in_executor(self._threads, s.worker.ensure_started)
                                   for s in self._slots))
        except BaseException:
            await self.close()
            raise
        self._started = True

    async def open(self, request_id: str, prompt: str, answer: str | None,
                   seed: int) -> Outcome | None:
        """Start an episode; a failed Outcome (turn 0's call id) when the factory raised."""
        slot = min(self._slots, key=lambda s: len(s.episodes))
        self._where[request_id] = slot
        slot.episodes.add(request_id)
        self._lost.discard(request_id)
        kind, detail = await self._call(slot, ("open", request_id, prompt, answer, seed))
        if kind == "ok":
            return None
        self._forget(request_id)
        return self._failed(call_id(request_id, 0), "factory" if kind == "raised" else kind,
                            str(detail))

    def holds(self, request_id: str) -> bool:
        """Whether the episode is open and its worker still has its state."""
        return request_id in self._where and request_id not in self._lost

    async def restore(self, request_id: str, turn: int,
                      history: Sequence[dict[str, str]]) -> Outcome | None:
        """Hand a reopened episode its committed turns (module doc); None when it took them."""
        slot = self._where.get(request_id)
        cid = call_id(request_id, turn)
        if slot is None or request_id in self._lost:
            self._forget(request_id)
            return self._failed(cid, "lost", f"episode {request_id} is not open")
        kind, detail = await self._call(slot, ("restore", request_id, list(history)))
        if kind == "ok":
            return None
        self._forget(request_id)
        return self._failed(cid, kind, str(detail))

    async def step(self, request_id: str, turn: int, action: str) -> Outcome:
        """Run turn ``turn`` of an open episode; never raises for the environment."""
        cid = call_id(request_id, turn)
        slot = self._where.get(request_id)
        if turn >= self.max_turns:
            self._forget(request_id)
            return self._failed(cid, "max_turns", f"turn {turn} is past max_turns "
                                f"{self.max_turns}")
        if slot is None or request_id in self._lost:
            self._forget(request_id)
            return self._failed(cid, "lost", f"episode {request_id} is not open (never "
                                "opened, ended, or its worker was killed)")
        self.calls.inc()
        kind, detail = await self._call(slot, ("step", request_id, action, cid))
        if kind != "ok":
            self._forget(request_id)
            return self._failed(cid, kind, str(detail))
        observation, reward, done = detail
        return self._fitted(request_id, turn, Outcome(cid, observation, reward, done))

    async def end(self, request_id: str) -> None:
        """Drop an episode (idempotent); its worker forgets it too."""
        slot = self._where.get(request_id)
        lost = request_id in self._lost
        self._forget(request_id)
        if slot is not None and not lost:
            await self._call(slot, ("close", request_id))

    def committed(self, calls: int = 1) -> None:
        """The commit path's hook: ``calls`` observations were written into trajectories."""
        self.committed_calls.inc(calls)

    def _fitted(self, request_id: str, turn: int, out: Outcome) -> Outcome:
        if not out.done and turn == self.max_turns - 1:
            self._forget(request_id)
            return Outcome(out.call_id, None, out.reward, True)
        if out.done:
            self._forget(request_id)
        if out.observation is None:
            return out
        text, cut = self.fit(out.observation, self.budget)
        if cut:
            self.truncated.inc()
        return Outcome(out.call_id, text, out.reward, out.done, truncated=cut)

    async def _call(self, slot: _Slot, message: tuple[Any, ...]) -> tuple[str, Any]:
        if not self._started:
            raise RuntimeError("call start() first")
        async with slot.lock:
            was_alive = slot.worker.alive
            fut = asyncio.get_running_loop().run_in_executor(
                self._threads, slot.worker.call, message, self.tool_s)
            kind, detail = await asyncio.shield(fut)
            if was_alive and not slot.worker.alive:
                # Killed or dead: every other episode it held went with it.
                self._lost |= slot.episodes - {message[1]}
                slot.episodes &= {message[1]}
        return kind, detail

    def _failed(self, cid: str, reason: str, detail: str) -> Outcome:
        reason = _REASONS.get(reason, "crashed")
        self.failures.labels(reason).inc()
        if reason == "timeout":
            self.timeouts.inc()
        if reason not in self._logged:
            self._logged.add(reason)
            self._log.error("env %s: call %s failed (%s); the episode ends with reward 0, and "
                            "later failures of this kind are counted, not logged:\n%s",
                            self.spec, cid, reason, detail.rstrip())
        return Outcome(cid, None, FAILED_REWARD, True, error=reason, detail=detail)

    def _forget(self, request_id: str) -> None:
        slot = self._where.pop(request_id, None)
        if slot is not None:
            slot.episodes.discard(request_id)
        self._lost.discard(request_id)

    async def close(self) -> None:
        """End every worker (idempotent)."""
        if self._closed:
            return
        self._closed = True
        await asyncio.gather(*(asyncio.to_thread(s.worker.close) for s in self._slots),
                             return_exceptions=True)
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> EnvPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
