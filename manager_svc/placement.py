"""Dispatch policy as pure functions: who may take work, how much each gets, what moves.

Contract: no I/O and no clock. The dispatcher (:mod:`manager_svc.dispatcher`) reads Redis,
calls these, and carries out the result; the discrete-event simulator (:mod:`sim`) calls the
same functions on its simulated cluster, so a policy change shows in both. An instance here is
any mapping with the fields of a :meth:`~manager_svc.registry.Registry.instances` row that the
function names (``id``, ``kind``, ``state``, ``held``, ``capacity``, ``joined_at``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

Instance = TypeVar("Instance", bound=Mapping[str, Any])

# Do not move work off the same instance more often than this: moved work needs a moment to land.
REBALANCE_COOLDOWN_S = 2.0
REBALANCE_IDLE_S = 1.0  # an instance must have been idle this long before work moves to it


def joined_in_time(everyone: Sequence[Instance], started_at: float) -> list[Instance]:
    """Ablation "no mid-step join": who joined after the step began sits it out, as if it could
    only get weights at the next step boundary; it does not count as spot capacity either."""
    return [i for i in everyone if i["kind"] == "reserved" or i["joined_at"] <= started_at]


def spot_count(everyone: Sequence[Mapping[str, Any]]) -> int:
    """The spot capacity a step plans for: spot instances registered and neither draining
    (one that got its preemption notice is leaving) nor quarantined. The seeding window is
    chosen, and followed mid-window, on this count, by the manager and the simulator alike."""
    return sum(1 for i in everyone
               if i["kind"] == "spot" and i["state"] not in ("draining", "quarantined"))


def spot_alive(everyone: Sequence[Mapping[str, Any]]) -> bool:
    return spot_count(everyone) > 0


def takers(ready: Sequence[Instance], in_window: bool, any_spot: bool) -> list[Instance]:
    """Who may take work: during the seeding window everyone ready; after it (or with seeding
    off) spot instances only, unless no spot instance is alive, when the reserved side
    generates everything (co-located)."""
    if in_window or not any_spot:
        return list(ready)
    return [i for i in ready if i["kind"] == "spot"]


def lease_plan(pending: int, ready: Sequence[Instance]) -> list[tuple[Instance, int]]:
    """How many of ``pending`` responses each ready instance gets, in lease order: reserved
    first (the design's seeding order), then the least loaded, each up to a fair share of all
    outstanding work so one fast joiner does not take it all, and never over its capacity."""
    if not ready:
        return []
    outstanding = pending + sum(int(i["held"]) for i in ready)
    share = math.ceil(outstanding / len(ready))
    order = sorted(ready, key=lambda i: (i["kind"] != "reserved", i["held"]))
    plan = []
    for inst in order:
        room = min(int(inst["capacity"]), share) - int(inst["held"])
        if room > 0:
            plan.append((inst, room))
    return plan


def idle_marks(ready: Sequence[Mapping[str, Any]], idle_since: dict[str, float],
               now: float) -> None:
    """Record when each instance went idle (held nothing), forget it once it holds work."""
    for inst in ready:
        if inst["held"] == 0:
            idle_since.setdefault(inst["id"], now)
        else:
            idle_since.pop(inst["id"], None)


def rebalance_move(ready: Sequence[Instance], idle_since: Mapping[str, float],
                   rebalanced: Mapping[str, float], now: float, skew: int
                   ) -> tuple[Instance, Instance, int] | None:
    """Token-level load balancing: (busiest, idlest, how many to move) or None.

    Moves half the difference when the busiest holds more than ``skew`` over the idlest, the
    idlest has been idle REBALANCE_IDLE_S (short responses finish before a move pays for its
    re-prefill; moving them anyway just churns leases) and the busiest was not drained within
    REBALANCE_COOLDOWN_S."""
    if len(ready) < 2 or skew <= 0:
        return None
    order = sorted(ready, key=lambda i: i["held"])
    idle, busy = order[0], order[-1]
    if now - idle_since.get(idle["id"], now) < REBALANCE_IDLE_S or \
            busy["held"] - idle["held"] <= skew or \
            now - rebalanced.get(busy["id"], -math.inf) < REBALANCE_COOLDOWN_S:
        return None
    return busy, idle, (int(busy["held"]) - int(idle["held"])) // 2


def least_advanced(held: Sequence[tuple[str, int]], count: int) -> list[str]:
    """The ``count`` responses with the fewest committed tokens (cheapest to re-prefill)."""
    return [rid for rid, _ in sorted(held, key=lambda h: (h[1], h[0]))[:count]]
