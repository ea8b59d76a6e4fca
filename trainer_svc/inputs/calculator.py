"""The ``calculator`` environment: arithmetic on request, for the word-problem task.

Contract (one episode per sample; env ``"calculator"``):

- A turn that holds a final answer in the task's form, ``#### <answer>`` (GSM8K's marker, as
  the shipped word problems' answers end), ends the episode: ``done``, and ``reward`` is the
  task's reward, ``math`` (:func:`trainer_svc.inputs.rewards.math_reward` of the turn against
  the sample's answer). No observation.
- Otherwise a turn that holds a tool call ``<calc>EXPRESSION</calc>`` gets the value of the
  first one as its observation (``<calc>2*(3+4)</calc>`` -> ``14``; an integral value is
  written without a decimal point, any other to 10 significant digits), or ``error: <why>``
  for an expression it cannot evaluate; the episode goes on.
- A turn with neither ends the episode with reward 0.0: the model stopped without an answer.
- An expression is at most :data:`MAX_EXPRESSION` characters of numbers, ``+ - * / // % **``
  and parentheses, evaluated by ``simpleeval`` (no names, no calls, no attributes); a power's
  exponent is at most :data:`MAX_EXPONENT` in size, so no call runs long.

Deterministic: the seed is unused, the same turns give the same observations and reward.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

# Imported here, when an env worker resolves the factory, not inside a first call's timeout
# (math-verify pulls in sympy: ~1-2 s).
import math_verify  # noqa: F401
import simpleeval

from trainer_svc.inputs.rewards import math_reward

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
FINAL = re.compile(r"####\s*\S")
MAX_EXPRESSION = 200
MAX_EXPONENT = 64


def _power(base: Any, exponent: Any) -> Any:
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"exponent {exponent} is over {MAX_EXPONENT}")
    return operator.pow(base, exponent)


_OPERATORS: dict[type, Any] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: _power, ast.USub: operator.neg, ast.UAdd: operator.pos,
}


def evaluate(expression: str) -> str:
    """The observation for one ``<calc>`` call: its value as text, or ``error: ...``."""
    expression = expression.strip()
    if not expression:
        return "error: empty expression"
    if len(expression) > MAX_EXPRESSION:
        return f"error: expression longer than {MAX_EXPRESSION} characters"
    evaluator = simpleeval.SimpleEval(operators=_OPERATORS, functions={}, names={})
    try:
        value = evaluator.eval(expression)
    except Exception as exc:  # any expression the model writes: its error is the observation
        return f"error: {type(exc).__name__}: {exc}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"error: not a number: {type(value).__name__}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.10g}"


class CalculatorEnv:
    """One episode of the calculator environment (see the module doc)."""

    def __init__(self, prompt: str, answer: str | None, seed: int) -> None:
        self.prompt = prompt
        self.answer = answer

    def step(self, action: str, call_id: str) -> dict[str, Any]:
        if FINAL.search(action):
            # The task's reward; an answer it cannot parse raises, a data fault to count.
            reward = math_reward(self.prompt, action, self.answer)
            return {"observation": None, "reward": reward, "done": True}
        call = CALL.search(action)
        if call is None:
            return {"observation": None, "reward": 0.0, "done": True}
        return {"observation": evaluate(call.group(1)), "reward": None, "done": False}
