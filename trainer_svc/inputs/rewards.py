"""Reward functions by name: the built-in ``"math"`` and ``"exact"``, and user ``python:`` ones.

Contract:

- Every reward function is ``fn(prompt: str, response: str, answer: str | None) -> float``,
  plain or ``async def``. ``prompt`` is the dataset's string before any chat template,
  ``response`` the decoded response (special tokens skipped), ``answer`` the dataset's answer
  or None.
- ``"math"``: final-answer equivalence by ``math-verify``. The gold is the answer's text after
  its last ``####`` when it has one (GSM8K), else the whole answer; the response is likewise
  cut after its last ``####`` when it has one, else ``math-verify`` extracts its final answer
  (``\\boxed{}``, LaTeX, or the last number). 1.0 when equivalent (``\\boxed{3/4}`` = ``0.75``),
  else 0.0. A missing answer, or one math-verify cannot parse, raises: that is a data fault
  to count and log, not a wrong response.
- ``"exact"``: 1.0 when ``normalize(response) == normalize(answer)``, else 0.0, where both
  sides are first cut after their last ``####`` when they have one, then stripped, lower-cased,
  whitespace runs collapsed to one space and one trailing period dropped.
- ``"python:<module>:<function>"``: ``<module>`` must be found in a directory of the reward
  path (RLBOOST_REWARD_PATH) and load from there, or be one of :data:`BUILTIN_MODULES`; an
  installed package or a standard-library module (``os:system``) is refused before it is
  imported, and so is a reward-path file that an already imported module of the same name
  shadows. ``<function>`` must be a callable attribute of it. :func:`resolve_reward` raises
  :class:`RewardNameError` naming the spec and the cause (unknown name, a module outside the
  reward path, import failure with its message, missing attribute).

Resolution imports user code and may touch ``sys.path``: it is meant to run in a reward
worker process (:mod:`trainer_svc.inputs.reward_worker`), never in the trainer's own.
math-verify's own timeouts use ``signal.alarm``, which works only on a process's main thread;
the workers call rewards on theirs, so those timeouts stay on.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence

from trainer_svc.inputs.user_code import PYTHON_PREFIX, UserCodeError, load_attr, split_spec

RewardFn = Callable[[str, str, "str | None"], "float | Awaitable[float]"]

BUILTIN_REWARDS = ("math", "exact")
# Modules of the package a python: reward may name without being on the reward path.
BUILTIN_MODULES = ("trainer_svc.inputs.rewards", "trainer_svc.inputs.code_reward")


class RewardNameError(UserCodeError):
    """A reward spec that names nothing callable; ``spec`` and ``cause`` say what and why."""

    kind = "reward"
    attr_word = "function"


def final_answer_text(text: str) -> str:
    """The text after the last ``####`` (GSM8K's final-answer marker), or all of it."""
    return text.rsplit("####", 1)[1] if "####" in text else text


_SPACE = re.compile(r"\s+")


def normalize(text: str) -> str:
    """The ``"exact"`` reward's normal form (see the module docstring)."""
    out = _SPACE.sub(" ", final_answer_text(text).strip().lower())
    return out[:-1].rstrip() if out.endswith(".") else out


def exact_reward(prompt: str, response: str, answer: str | None) -> float:
    if answer is None:
        raise ValueError("the exact reward needs an answer, and this sample has none")
    return 1.0 if normalize(response) == normalize(answer) else 0.0


def math_reward(prompt: str, response: str, answer: str | None) -> float:
    # Imported here: math-verify pulls in sympy (~1 s), needed only by workers that use it.
    from math_verify import parse, verify

    if answer is None:
        raise ValueError("the math reward needs an answer, and this sample has none")
    gold = parse(final_answer_text(answer))
    if not gold:
        raise ValueError(f"math-verify cannot parse the answer {answer!r}")
    guess = parse(final_answer_text(response))
    return 1.0 if guess and verify(gold, guess) else 0.0


def check_spec(spec: str) -> None:
    """Raise RewardNameError unless ``spec`` is well formed; imports nothing.

    For submit-time validation: whether a ``python:`` module imports is only known where the
    reward path is (the trainer's workers).
    """
    if spec in BUILTIN_REWARDS:
        return
    if not spec.startswith(PYTHON_PREFIX):
        raise RewardNameError(
            spec, f"unknown reward; use one of {', '.join(BUILTIN_REWARDS)} "
            "or python:<module>:<function>"
        )
    split_spec(spec, RewardNameError)


def resolve_reward(spec: str, reward_path: Sequence[str] = ()) -> RewardFn:
    """The function a reward spec names; user modules are searched on ``reward_path`` first."""
    check_spec(spec)
    if spec == "math":
        # Paid here, at worker start, not inside the first call's timeout (sympy: ~1-2 s).
        import math_verify  # noqa: F401

        return math_reward
    if spec == "exact":
        return exact_reward
    result: RewardFn = load_attr(spec, reward_path, BUILTIN_MODULES, RewardNameError)
    return result
