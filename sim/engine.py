"""A simulated rollout instance: the emu engine's continuous batching, in segments.

SIMULATION. The emu engine (:mod:`rollout_svc.engines.emu`) sleeps, per decode step,
``prefill_s_per_token * (prompt + committed tokens of the requests that joined) + decode_s_base
+ decode_s_per_seq * batch`` and emits one token per running response. Between two changes of
the batch every step costs the same, so the simulator does not walk tokens: a *segment* runs
until the first running response finishes (one event), and an outside change (an assignment
into a free slot, a revoke, a preemption) cuts the segment at the next decode-step boundary.
With ``context_aware`` a sequence's KV read is charged at its true context, not a 4k constant.
An agentic response's model turn ends a segment like a response's end does (``Response.stop``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from rollout_svc.engines.emu_models import CONTEXT_TOKENS
from sim.config import Costs


@dataclass(eq=False)
class Response:
    prompt: int
    sample: int
    length: int  # tokens it will have (EOS included), within the budget
    prompt_tokens: int
    index: int = 0  # position in its step
    committed: int = 0  # tokens the manager holds (survive a move)
    generated: int = 0  # tokens generated, regenerations included
    owner: Instance | None = None
    done: bool = False
    moves: int = 0
    # Agentic responses (sim.turns): where each model turn ends (the last: ``length``), the
    # tool call's seconds after each turn but the last, the tokens of each observation.
    stops: tuple[int, ...] = ()
    tool_s: tuple[float, ...] = ()
    observation_tokens: int = 0
    turn: int = 0  # the model turn it is in
    step: int = 0  # the step it belongs to
    # (first token index, weight version) at each change of version: the run's
    # ``response_versions``; one entry in a synchronous run.
    versions: list[tuple[int, int]] = field(default_factory=list)

    @property
    def stop(self) -> int:
        """Where the current model turn ends: the response's end for a single turn."""
        return self.stops[self.turn] if self.stops else self.length

    @property
    def turn_start(self) -> int:
        """Where the current model turn starts: after the last committed observation."""
        return self.stops[self.turn - 1] + self.observation_tokens if self.turn else 0

    @property
    def observed(self) -> int:
        """Observation tokens in the whole response (masked out of the loss)."""
        return self.observation_tokens * max(0, len(self.stops) - 1)

    @property
    def left(self) -> int:
        return self.stop - self.committed


@dataclass(eq=False)
class Instance:
    id: str
    kind: str  # reserved | spot
    capacity: int
    joined_at: float
    state: str = "booting"  # booting | loading | ready | draining | gone
    version: int = -1
    held: list[Response] = field(default_factory=list)  # assigned, not finished
    active: list[Response] = field(default_factory=list)  # in the running batch
    queue: deque[Response] = field(default_factory=deque)
    seg_start: float = 0.0
    seg_prefill: float = 0.0
    seg_dt: float = 0.0
    seg_steps: int = 0
    seg_serial: int = 0  # a segment's end event carries it; a cut segment's event is stale
    busy_s: float = 0.0
    billed_from: float = 0.0
    billed_to: float | None = None
    speed: float = 1.0  # relative to the serving model's instance: another GPU type's

    def row(self) -> dict[str, object]:
        """What :mod:`manager_svc.placement` reads of an instance (a registry row)."""
        return {"id": self.id, "kind": self.kind, "state": self.state,
                "held": len(self.held), "capacity": self.capacity, "joined_at": self.joined_at,
                "obj": self}


def step_seconds(costs: Costs, batch: list[Response]) -> float:
    """One decode step of ``batch``."""
    s = costs.serving
    if not costs.context_aware:
        return s.decode_s_base + s.decode_s_per_seq * len(batch) + costs.host_step_s
    per_token = s.decode_s_per_seq / CONTEXT_TOKENS
    context = sum(r.prompt_tokens + r.committed for r in batch)
    return s.decode_s_base + per_token * context + costs.host_step_s


def start_segment(inst: Instance, costs: Costs, now: float) -> float | None:
    """Admit queued work into free slots and start the next segment; returns its end time."""
    prefill = 0
    while inst.queue and len(inst.active) < inst.capacity:
        r = inst.queue.popleft()
        prefill += r.prompt_tokens + r.committed  # re-prefill at the true context
        inst.active.append(r)
    if not inst.active:
        inst.seg_steps = 0
        return None
    inst.seg_start = now
    inst.seg_prefill = costs.serving.prefill_s_per_token * prefill / inst.speed
    # Context grows as the segment runs: charge it at the segment's midpoint.
    steps = min(r.left for r in inst.active)
    if steps <= 0:  # a response admitted at its turn's end would spin the clock in place
        raise RuntimeError(f"{inst.id}: admitted a response with no tokens left in its turn")
    dt = step_seconds(costs, inst.active)
    if costs.context_aware:
        dt += costs.serving.decode_s_per_seq / CONTEXT_TOKENS * len(inst.active) * steps / 2
    dt /= inst.speed
    inst.seg_dt, inst.seg_steps = dt, steps
    inst.seg_serial += 1
    return now + inst.seg_prefill + steps * dt


def advance(inst: Instance, now: float, cut: bool) -> tuple[list[Response], int]:
    """Account the running segment up to ``now``; returns the responses that finished (or
    finished a model turn: ``committed < length``) and the tokens generated.

    ``cut``: an outside change. The segment stops at the decode-step boundary at or after
    ``now`` (the engine takes changes between steps), so ``now`` moves there; the caller reads
    the time back from :func:`boundary`.
    """
    if inst.seg_steps == 0:
        return [], 0
    elapsed = now - inst.seg_start - inst.seg_prefill
    steps = inst.seg_steps if not cut else \
        min(inst.seg_steps, max(0, math.ceil(elapsed / inst.seg_dt - 1e-9)))
    inst.busy_s += inst.seg_prefill + steps * inst.seg_dt
    finished = []
    for r in inst.active:
        r.committed += steps
        r.generated += steps
        if r.committed >= r.stop:  # the response's end, or its model turn's
            finished.append(r)
    inst.active = [r for r in inst.active if r.committed < r.stop]
    inst.seg_steps = 0
    inst.seg_serial += 1
    return finished, steps * (len(inst.active) + len(finished))


def boundary(inst: Instance, now: float) -> float:
    """The decode-step boundary at or after ``now`` of the running segment."""
    if inst.seg_steps == 0:
        return now
    elapsed = now - inst.seg_start - inst.seg_prefill
    steps = min(inst.seg_steps, max(0, math.ceil(elapsed / inst.seg_dt - 1e-9)))
    return max(now, inst.seg_start + inst.seg_prefill + steps * inst.seg_dt)
