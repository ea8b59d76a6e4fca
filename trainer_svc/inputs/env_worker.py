"""The env worker process: resolves one environment factory and runs its episodes' steps.

Contract (the only peer is :class:`trainer_svc.inputs.tool_pool.EnvPool`):

- Started by :class:`trainer_svc.inputs.workers.Worker`. First message
  ``("init", spec, dirs, tool_s)``; the reply is ``("ready", "")`` or ``("init_error", cause)``.
- ``("open", key, prompt, answer, seed)`` calls the factory and keeps the episode under
  ``key``: ``("ok", None)`` or ``("raised", traceback)``.
- ``("step", key, action, call_id)``: ``("ok", (observation, reward, done))`` with the value
  held to the contract (:func:`trainer_svc.inputs.envs.check_step_result`), ``("raised",
  traceback)``, ``("invalid", why)``, or ``("lost", why)`` for a key this process does not
  hold (it was never opened here, or this process replaced one that was killed). An episode
  that is done, raised or broke the contract is dropped.
- ``("restore", key, history)`` hands an episode rebuilt after its state was lost the turns
  it had committed (``history``: a list of ``{"call_id", "action", "observation"}`` dicts,
  oldest first), when its environment has a ``restore`` method: ``("ok", None)``, or
  ``("restore", traceback)`` if it raised (the episode is dropped), or ``("lost", why)``.
- ``("close", key)`` drops an episode: ``("ok", None)``. ``None`` or a closed channel ends the
  worker.
- Calls run one at a time on the main thread; the caller's timeout kills the process.
"""

from __future__ import annotations

import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

from trainer_svc.inputs.envs import (
    Env,
    EnvFactory,
    EnvNameError,
    InvalidStep,
    check_step_result,
    resolve_env,
)
from trainer_svc.inputs.workers import worker_main

# An observation is cut to this many characters here, before it crosses the channel; the pool
# then fits it to the run's token budget (32,768 tokens at most, rarely 32 characters each).
MAX_OBSERVATION_CHARS = 1 << 20


class Episodes:
    """The episodes this worker holds, by key, and the calls on them."""

    def __init__(self, factory: EnvFactory) -> None:
        self.factory = factory
        self.held: dict[str, Env] = {}

    def handle(self, message: tuple[Any, ...]) -> tuple[str, Any]:
        verb, key = message[0], message[1]
        if verb == "open":
            _, _, prompt, answer, seed = message
            try:
                self.held[key] = self.factory(prompt, answer, seed)
            except Exception:
                return "raised", traceback.format_exc()
            return "ok", None
        if verb == "close":
            self.held.pop(key, None)
            return "ok", None
        if verb == "step":
            return self._step(key, message[2], message[3])
        if verb == "restore":
            return self._restore(key, message[2])
        return "invalid", f"unknown message {verb!r}"

    def _restore(self, key: str, history: list[dict[str, str]]) -> tuple[str, Any]:
        env = self.held.get(key)
        if env is None:
            return "lost", f"episode {key} is not held by this worker (its worker was replaced)"
        restore = getattr(env, "restore", None)
        if restore is None:  # an environment without it keeps no state between calls
            return "ok", None
        try:
            restore(history)
        except Exception:
            del self.held[key]
            return "restore", traceback.format_exc()
        return "ok", None

    def _step(self, key: str, action: str, call_id: str) -> tuple[str, Any]:
        env = self.held.get(key)
        if env is None:
            return "lost", f"episode {key} is not held by this worker (its worker was replaced)"
        try:
            value = env.step(action, call_id)
        except Exception:
            del self.held[key]
            return "raised", traceback.format_exc()
        try:
            result = check_step_result(value)
        except InvalidStep as exc:
            del self.held[key]
            return "invalid", str(exc)
        if result.done:
            del self.held[key]
        observation = result.observation
        if observation is not None:
            observation = observation[:MAX_OBSERVATION_CHARS]
        return "ok", (observation, result.reward, result.done)


def serve(conn: Connection) -> None:
    """Answer one init message, then calls, until told to stop."""
    kind, spec, dirs, tool_s = conn.recv()
    if kind != "init":
        raise RuntimeError(f"expected init, got {kind!r}")
    try:
        episodes = Episodes(resolve_env(spec, dirs, tool_s))
    except EnvNameError as exc:
        conn.send(("init_error", exc.cause))
        return
    conn.send(("ready", ""))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        conn.send(episodes.handle(message))


def main(argv: list[str]) -> None:
    worker_main(argv, serve)


if __name__ == "__main__":
    main(sys.argv[1:])
