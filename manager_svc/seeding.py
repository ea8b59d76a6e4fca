"""Adaptive partial-response seeding: how long the reserved side generates at a step's start.

At the start of step n the reserved instances already hold version n (they trained it), while
spot instances still have to pull it. So the reserved side generates for a *seeding window* w,
then hands its unfinished responses to the spot instances (token-level migration) and switches
to training on groups as they complete. Too short a window leaves the trainer idle waiting for
spot rollout; too long leaves spot instances idle waiting for training.

The rule (no per-model constants; every input is measured on the last step):
    W  tokens in a step             r  reserved generation rate during the window (tokens/s)
    s  spot generation rate, per-instance rate x instances alive now (tokens/s)
    a  time from step start until spot instances produce their first token (weight pull)
    c  training time per token on the reserved side (s/token)
  Spot rollout ends at  a + (W - r*w) / s ; the reserved side is busy until  w + c*W.
  Equal finish times give  w* = (a*s + W - c*W*s) / (s + r),  clamped to [0, W/r]
  (W/r: the reserved side alone generates everything, i.e. co-located when no spot exists).
The next window is the mean of the last window and w* (damping noise in the measurements),
except when the spot instance count changed since the last step: then w* is taken at once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

DEFAULT_WINDOW_S = 1.0  # first step of an adaptive run, before anything is measured


@dataclass(slots=True)
class SeedingState:
    window_s: float = DEFAULT_WINDOW_S
    tokens: float = 0.0  # W of the last step
    reserved_rate: float = 0.0  # r, tokens/s; 0 = not yet measured
    spot_rate_each: float = 0.0  # per spot instance, tokens/s; 0 = not yet measured
    spot_ready_s: float = 0.0  # a
    train_s_per_token: float = 0.0  # c
    spot_count: int = 0  # spot instances alive when the window was chosen

    @classmethod
    def load(cls, raw: dict[str, str]) -> SeedingState:
        state = cls()
        for key, value in raw.items():
            if hasattr(state, key):
                setattr(state, key, int(value) if key == "spot_count" else float(value))
        return state

    def dump(self) -> dict[str, Any]:
        return asdict(self)


def optimal_window(state: SeedingState, spot_count: int) -> float:
    """w* of the module docstring for ``spot_count`` live spot instances."""
    W, r, c, a = state.tokens, state.reserved_rate, state.train_s_per_token, state.spot_ready_s
    s = state.spot_rate_each * spot_count
    if W <= 0 or (r <= 0 and s <= 0):
        return state.window_s  # nothing measured yet: keep the current guess
    if r <= 0:
        r = state.spot_rate_each  # unmeasured: assume one reserved instance is like one spot
    longest = W / r
    if s <= 0:
        return longest
    return min(max((a * s + W - c * W * s) / (s + r), 0.0), longest)


def next_window(state: SeedingState, spot_count: int) -> float:
    target = optimal_window(state, spot_count)
    if spot_count != state.spot_count:
        return target  # the capacity changed: react at once, do not average with the past
    return 0.5 * (state.window_s + target)


def observe(state: SeedingState, step: dict[str, Any]) -> None:
    """Fold the measurements of one finished step into ``state``.

    ``step`` holds: tokens, tokens_reserved, tokens_spot, window_s, train_s, spot_ready_s,
    spot_busy_s (wall time spot instances spent generating), spot_count (at the step's end)
    and optionally publish_s (the part of train_s spent publishing the new version).

    The spot instances that did the step's work are taken as the mean of the count when its
    window was chosen (``state.spot_count``) and the count at its end: with the end's count
    alone, a step that ran on 8 instances and ended on 2 read as 4x the rate per instance
    (measured in the simulator: a window of 150 s where 310 s was best). The publish is left
    out of ``c``: it follows the barrier whatever the window, so it cannot be overlapped.
    """
    if step["tokens"] <= 0:
        return
    state.tokens = float(step["tokens"])
    if step["tokens_reserved"] > 0 and step["window_s"] > 0:
        state.reserved_rate = step["tokens_reserved"] / step["window_s"]
    count = (state.spot_count + step["spot_count"]) / 2 if state.spot_count > 0 \
        else step["spot_count"]
    if step["tokens_spot"] > 0 and step["spot_busy_s"] > 0 and count > 0:
        state.spot_rate_each = step["tokens_spot"] / step["spot_busy_s"] / count
    state.spot_ready_s = max(0.0, float(step["spot_ready_s"]))
    train = float(step["train_s"]) - float(step.get("publish_s", 0.0))
    state.train_s_per_token = max(0.0, train) / state.tokens
