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
w* is a model: it takes every rate as constant over the step, but the reserved batch drains
as the window goes on, the spot side ends on a few long responses decoding at latency-bound
speed, and training can only follow groups as they complete. So a longer window shortens
spot rollout by less than the model's r/s per second, and in the simulator the step time is
lowest at windows 10-20 % above w*. The window is therefore corrected by the imbalance the
last step showed, E = (spot rollout end) - (window + training): its feedback window is
w + GAIN * E, where the model's own step would be only s/(s + r) * E (0.1-0.4 in the
simulator). The loop is stable for GAIN < 2 / |dE/dw|; dE/dw measured -1.6 to -2.7, so 0.5
keeps a margin and settles in 2-3 steps. The ratio of the feedback window to that step's w*
(``scale``) carries to the next step's w*, so a capacity change still moves the window at
once, by the model, with the learnt correction.
Before both sides were measured: the mean of the last window and w*, or w* at once
when the spot count changed. Within a step, while the window is open, a change of the spot
count chooses the step's window again for the new count (:func:`retarget`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

DEFAULT_WINDOW_S = 1.0  # first step of an adaptive run, before anything is measured
GAIN = 0.5  # feedback gain (module doc)
COUNTS = ("spot_count", "reserved_count")  # the state's integer fields


@dataclass(slots=True)
class SeedingState:
    window_s: float = DEFAULT_WINDOW_S
    tokens: float = 0.0  # W of the last step
    reserved_rate: float = 0.0  # r, tokens/s; 0 = not yet measured
    spot_rate_each: float = 0.0  # per spot instance, tokens/s; 0 = not yet measured
    spot_ready_s: float = 0.0  # a
    train_s_per_token: float = 0.0  # c
    spot_count: int = 0  # spot instances alive when the window was chosen
    scale: float = 0.0  # feedback window / w* of the last step; 0 = not measured yet
    reserved_count: int = 0  # reserved instances at the last step's end; 0 = not known

    @classmethod
    def load(cls, raw: dict[str, str]) -> SeedingState:
        state = cls()
        for key, value in raw.items():
            if hasattr(state, key):
                setattr(state, key, int(value) if key in COUNTS else float(value))
        return state

    def dump(self) -> dict[str, Any]:
        return asdict(self)


def optimal_window(state: SeedingState, spot_count: float) -> float:
    """w* of the module docstring for ``spot_count`` live spot instances."""
    W, r, c, a = state.tokens, state.reserved_rate, state.train_s_per_token, state.spot_ready_s
    each = state.spot_rate_each
    if each <= 0 and r > 0 and state.reserved_count > 0:
        # Unmeasured (no spot instance generated yet): assume one is like a reserved one.
        # Taking none (co-located, W/r) gave a step with 11 spot instances, after a warm-up
        # they came too late for, a 21.6 s window where 3.1 s was best (bench-sim-check, (c3)).
        each = r / state.reserved_count
    s = each * spot_count
    if W <= 0 or (r <= 0 and s <= 0):
        return state.window_s  # nothing measured yet: keep the current guess
    if r <= 0:
        r = state.spot_rate_each  # unmeasured: assume one reserved instance is like one spot
    longest = W / r
    if s <= 0:
        return longest
    return min(max((a * s + W - c * W * s) / (s + r), 0.0), longest)


def _target(state: SeedingState, spot_count: int) -> float:
    target = optimal_window(state, spot_count)
    if state.scale > 0 and state.reserved_rate > 0:
        # The feedback is damped already (GAIN); the model moves it to the new capacity.
        return min(target * state.scale, state.tokens / state.reserved_rate)
    return target


def next_window(state: SeedingState, spot_count: int) -> float:
    """The window of the step that starts now, with ``spot_count`` spot instances alive."""
    target = _target(state, spot_count)
    if state.scale > 0 or spot_count != state.spot_count:
        return target  # corrected already, or the capacity changed: at once
    return 0.5 * (state.window_s + target)


def retarget(state: SeedingState, spot_count: int) -> float | None:
    """Mid-window: the spot count is no longer the one this step's window was chosen for;
    the window (from the step's start) to use now, or None when there is nothing to change.

    The window follows capacity within a step, not only at the next one: a step chosen for 8
    spot instances that drops to 2 in its window would otherwise hand most of its work to
    2 instances (measured in the simulator: 862 s where 502 s was best). The caller records
    the new window and count in the state (and ends the window at once if it is past).
    """
    if spot_count == state.spot_count or state.tokens <= 0:
        return None
    return _target(state, spot_count)


def _working_spot(state: SeedingState, step: dict[str, Any]) -> float:
    """How many spot instances generated, on average, over the span spot rollout took.

    With ``spot_joined`` (each spot instance registered at the step's end: when it joined,
    in seconds from the step's start) an instance counts for the part of the span it was
    there, so ten instances that joined for the last fifth of a step count as two, not as
    the five that the mean of the counts at both ends would give (measured in the simulator:
    the next window 235 s where 139 s was best). Instances gone by the end left at unknown
    times: each counts half. Without it: the mean of the counts at both ends.
    """
    start = float(step["spot_ready_s"])
    span = float(step["spot_busy_s"])
    joined = step.get("spot_joined")
    if joined is None or span <= 0:
        return (state.spot_count + step["spot_count"]) / 2 if state.spot_count > 0 \
            else float(step["spot_count"])
    present = sum(1 for j in joined if j <= start)
    stayed = sum(min(1.0, (start + span - max(start, float(j))) / span) for j in joined)
    return stayed + 0.5 * max(0, state.spot_count - present)


def observe(state: SeedingState, step: dict[str, Any]) -> None:
    """Fold the measurements of one finished step into ``state``.

    ``step`` holds: tokens, tokens_reserved, tokens_spot, window_s, train_s, spot_ready_s,
    spot_busy_s (wall time spot instances spent generating), spot_count (at the step's end)
    and optionally publish_s (the part of train_s spent publishing the new version),
    spot_joined (:func:`_working_spot`) and reserved_count (instances, for the prior of
    :func:`optimal_window`).

    The spot instances that did the step's work are :func:`_working_spot`: with the end's
    count alone, a step that ran on 8 instances and ended on 2 read as 4x the rate per
    instance (measured in the simulator: a window of 150 s where 310 s was best). The
    publish is left out of ``c``: it follows the barrier whatever the window, so it cannot be
    overlapped.
    """
    if step["tokens"] <= 0:
        return
    state.tokens = float(step["tokens"])
    if step["tokens_reserved"] > 0 and step["window_s"] > 0:
        state.reserved_rate = step["tokens_reserved"] / step["window_s"]
    count = _working_spot(state, step)
    if step["tokens_spot"] > 0 and step["spot_busy_s"] > 0 and count > 0:
        state.spot_rate_each = step["tokens_spot"] / step["spot_busy_s"] / count
    if "reserved_count" in step:
        state.reserved_count = int(step["reserved_count"])
    spot_worked = step["tokens_spot"] > 0
    if spot_worked:  # else no spot token came: the time to one is not measured
        state.spot_ready_s = max(0.0, float(step["spot_ready_s"]))
    train = float(step["train_s"]) - float(step.get("publish_s", 0.0))
    state.train_s_per_token = max(0.0, train) / state.tokens
    if spot_worked and state.reserved_rate > 0 and state.spot_rate_each > 0 and count > 0:
        window = float(step["window_s"])
        imbalance = state.spot_ready_s + float(step["spot_busy_s"]) - window - max(0.0, train)
        model = optimal_window(state, count)
        if model > 0:
            state.scale = max((window + GAIN * imbalance) / model, 1e-3)
