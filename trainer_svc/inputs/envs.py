"""Environments of agentic runs: the contract, the built-ins, loading ``python:`` factories.

Contract (the run spec's ``env``; docs/your-data.md, "Environments"):

- ``env`` is ``""`` (none), a built-in name (:data:`BUILTIN_FACTORIES`: ``calculator``,
  ``python``) or ``"python:<module>:<factory>"``, found like a ``python:`` reward
  (:mod:`trainer_svc.inputs.user_code`: RLBOOST_REWARD_PATH only).
- ``factory(prompt: str, answer: str | None, seed: int)`` returns one episode's environment,
  an object whose ``step(action: str, call_id: str)`` returns ``{"observation": str | None,
  "reward": float | None, "done": bool}``. ``action`` is the model's turn as text;
  ``call_id`` (:func:`shared.names.call_id`) is the same whenever this turn of this sample is
  run again after a fault, for a tool with side effects to dedupe on. ``observation`` is what
  the model reads next (None: nothing); ``reward``, when not None, is the episode's reward
  (it replaces the run's reward function); ``done`` ends the episode.
- :func:`check_step_result` holds a step's value to that shape (:class:`StepResult`) or
  raises :class:`InvalidStep` saying what is wrong; a bool reward counts as 1.0 or 0.0.
- :func:`resolve_env(spec, dirs, tool_s)` returns the factory or raises :class:`EnvNameError`
  (unknown name, a module outside the reward path, import failure, no such attribute). Like
  reward resolution it imports user code: it runs in an env worker, never in the trainer.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from shared.spec import BUILTIN_ENVS
from trainer_svc.inputs.user_code import PYTHON_PREFIX, UserCodeError, load_attr, split_spec


class Env(Protocol):
    def step(self, action: str, call_id: str) -> Mapping[str, Any]: ...


EnvFactory = Callable[[str, "str | None", int], Env]
# The built-ins, by name: module and factory. Each takes the contract's three arguments; the
# python one also its sandbox limits, which resolve_env fits to the run's max_tool_s.
BUILTIN_FACTORIES = {
    "calculator": ("trainer_svc.inputs.calculator", "CalculatorEnv"),
    "python": ("trainer_svc.inputs.python_env", "PythonEnv"),
}
assert tuple(BUILTIN_FACTORIES) == BUILTIN_ENVS, "shared.spec.BUILTIN_ENVS names these"
BUILTIN_MODULES = tuple(module for module, _ in BUILTIN_FACTORIES.values())
# A sandboxed run gets this share of max_tool_s: the rest is the worker's own round trip, so
# the sandbox's wall limit ends the code before the pool's timeout kills the worker.
SANDBOX_SHARE = 0.8


class EnvNameError(UserCodeError):
    """An env spec that names no factory; ``spec`` and ``cause`` say what and why."""

    kind = "env"
    attr_word = "factory"


class InvalidStep(ValueError):
    """A step returned something the contract does not allow."""


@dataclass(frozen=True, slots=True)
class StepResult:
    observation: str | None
    reward: float | None
    done: bool


def check_spec(spec: str) -> None:
    """Raise EnvNameError unless ``spec`` is well formed; imports nothing."""
    if spec in BUILTIN_FACTORIES:
        return
    if not spec.startswith(PYTHON_PREFIX):
        raise EnvNameError(spec, f"unknown env; use one of {', '.join(BUILTIN_FACTORIES)} "
                           "or python:<module>:<factory>")
    split_spec(spec, EnvNameError)


def resolve_env(spec: str, dirs: Sequence[str] = (), tool_s: float = 10.0) -> EnvFactory:
    """The factory ``spec`` names; ``tool_s`` (max_tool_s) bounds the python built-in."""
    check_spec(spec)
    if spec in BUILTIN_FACTORIES:
        module, attr = BUILTIN_FACTORIES[spec]
        factory: Any = load_attr(f"{PYTHON_PREFIX}{module}:{attr}", (), BUILTIN_MODULES,
                                 EnvNameError)
        if spec == "python":
            from trainer_svc.inputs.sandbox import SandboxLimits, isolation

            isolation()  # probed at worker start, not inside a first call's timeout
            wall = tool_s * SANDBOX_SHARE
            limits = SandboxLimits(wall_s=wall, cpu_s=max(1, math.ceil(wall)))
            factory = functools.partial(factory, limits=limits)
        result: EnvFactory = factory
        return result
    user: EnvFactory = load_attr(spec, dirs, (), EnvNameError)
    return user


def check_step_result(value: Any) -> StepResult:
    """``value`` as a :class:`StepResult`, or InvalidStep naming what breaks the contract."""
    if not isinstance(value, Mapping):
        raise InvalidStep(f"step returned {type(value).__name__}, not a dict with "
                          "observation, reward and done")
    unknown = set(value) - {"observation", "reward", "done"}
    if unknown or "done" not in value:
        raise InvalidStep(f"step returned keys {sorted(map(str, value))}; expected "
                          "observation, reward and done (done required)")
    observation, reward, done = value.get("observation"), value.get("reward"), value["done"]
    if observation is not None and not isinstance(observation, str):
        raise InvalidStep(f"observation is {type(observation).__name__}, not a string or None")
    if reward is not None:
        if not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
            raise InvalidStep(f"reward {reward!r} is not a finite number or None")
        reward = float(reward)
    if not isinstance(done, bool):
        raise InvalidStep(f"done is {type(done).__name__}, not a bool")
    return StepResult(observation, reward, done)
