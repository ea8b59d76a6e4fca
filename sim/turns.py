"""A step's responses, single-turn or agentic: their lengths, turn ends and tool times.

SIMULATION. A single-turn response has the emu engine's length
(:func:`rollout_svc.engines.emu_models.response_length`, keyed by the step's version as the
engine keys it, so both draw the same lengths). An agentic one (:class:`sim.config.Turns`) has
model turns whose lengths are drawn the same way, each keyed by its start as the emu engine
keys a turn (the first turn's key is the single-turn key), and between two turns a tool call
and an observation. Turn counts and tool times come from their own coordinates of
:func:`shared.sampling.uniform`, far from any that a length or a token takes, so adding turns
changes no other draw.
"""

from __future__ import annotations

import math
from dataclasses import replace
from statistics import NormalDist

from rollout_svc.engines.emu_models import response_length
from shared.sampling import uniform
from sim.config import Turns, Workload
from sim.engine import Response

# The emu engine's turn key (rollout_svc.engines.emu._TURN_KEY): a turn's start folded into the
# length key's version coordinate.
TURN_KEY = 1 << 24
# Position coordinates of the turn-count and tool-time draws: below every length key
# (-1 - start * TURN_KEY >= -(14336 << 24) > -(1 << 40)) and every token position (>= 0).
_COUNT_KEY = -(1 << 41)
_TOOL_KEY = -(1 << 40)
_PROMPT_KEY = -(1 << 42)  # a prompt's own length draw (sample -1, never a real sample)
_NORMAL = NormalDist()


def length(w: Workload, step: int, prompt: int, sample: int, start: int = 0,
           mean: float | None = None) -> int:
    """A response's (or a model turn's from ``start``) length: the emu engine's draw keyed by
    the step's version (a synchronous step runs on version ``step``), so a simulated and an
    emulated step have the same lengths. With ``Workload.prompt_share`` or ``growth`` the
    simulator's own model: a prompt's draw carries that share of the log-variance, the mean
    grows by ``growth`` a step; the response's own draw is the engine's."""
    mean = w.mean_tokens if mean is None else mean
    key = step + start * TURN_KEY
    if w.prompt_share == 0.0 and w.growth == 0.0:
        return response_length(w.seed, step, prompt, sample, key, mean, w.sigma,
                               w.max_new_tokens)
    mean *= (1.0 + w.growth) ** step
    z = _z(uniform(w.seed, step, prompt, sample, -1 - key))
    if w.prompt_share > 0.0:
        zp = _z(uniform(w.seed, step, prompt, -1, _PROMPT_KEY - start))
        z = math.sqrt(w.prompt_share) * zp + math.sqrt(1.0 - w.prompt_share) * z
    mu = math.log(max(mean, 1.0)) - w.sigma**2 / 2  # E[length] = mean before the cap
    return min(max(1, round(math.exp(mu + w.sigma * z))), w.max_new_tokens)


def _z(u: float) -> float:
    return _NORMAL.inv_cdf(min(max(u, 1e-12), 1 - 1e-12))


def turn_count(turns: Turns, seed: int, step: int, prompt: int, sample: int) -> int:
    """1 + Binomial(max_turns - 1, turn_p): one draw per possible extra turn."""
    return 1 + sum(uniform(seed, step, prompt, sample, _COUNT_KEY - k) < turns.turn_p
                   for k in range(turns.max_turns - 1))


def tool_seconds(turns: Turns, seed: int, step: int, prompt: int, sample: int,
                 call: int) -> float:
    """The ``call``-th tool call's latency: lognormal around the median, cut at max_tool_s."""
    if turns.tool_median_s <= 0:
        return 0.0
    u = uniform(seed, step, prompt, sample, _TOOL_KEY - call)
    z = _NORMAL.inv_cdf(min(max(u, 1e-12), 1 - 1e-12))
    return min(turns.max_tool_s, turns.tool_median_s * math.exp(turns.tool_sigma * z))


def make_response(w: Workload, step: int, prompt: int, sample: int, index: int) -> Response:
    """Response ``(prompt, sample)`` of step ``step``, at ``index`` in its step."""
    if w.turns is None:
        return Response(prompt, sample, length(w, step, prompt, sample), w.prompt_tokens,
                        index)
    t = w.turns
    mean = w.mean_tokens / t.mean_turns
    stops: list[int] = []
    tools: list[float] = []
    start = 0
    for k in range(turn_count(t, w.seed, step, prompt, sample)):
        turn = length(replace(w, max_new_tokens=1 << 30), step, prompt, sample, start, mean)
        stops.append(min(start + turn, w.max_new_tokens))
        start = stops[-1] + t.observation_tokens
        if start >= w.max_new_tokens:
            break  # the budget is spent: no room for an observation and another turn
        tools.append(tool_seconds(t, w.seed, step, prompt, sample, k))
    tools = tools[:len(stops) - 1]  # a call only between two model turns
    return Response(prompt, sample, stops[-1], w.prompt_tokens, index, stops=tuple(stops),
                    tool_s=tuple(tools), observation_tokens=t.observation_tokens)
