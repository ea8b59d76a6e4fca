"""The seeding controller against the best window in hindsight, step by step.

SIMULATION. The run is stepped by hand. Before each step the whole simulated system is copied
(a deterministic simulator makes the copy an exact fork) and every window of a sweep is tried on
its own copy of that one step; the shortest is the step's hindsight-best window for the
capacity it met. Then the real run takes the controller's window (:mod:`manager_svc.seeding`)
and goes on from there. The loss is the controller's step time over the best's.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from sim.config import RLBOOST, Cluster, Costs, Policy, Workload
from sim.simulator import Simulator


@dataclass(frozen=True)
class StepCompare:
    step: int
    spot: int  # spot instances alive when the window was chosen
    window: float  # the controller's
    step_s: float  # with the controller's window
    best_window: float
    best_step_s: float

    @property
    def loss(self) -> float:
        return self.step_s / self.best_step_s - 1


def _one_step(sim: Simulator, index: int, window: float | None) -> Simulator:
    fork = copy.deepcopy(sim) if window is not None else sim
    fork.force_window = window
    fork.begin_step(index)
    fork.clock.run_until(math.inf, lambda: len(fork.records) > index)
    fork.force_window = None
    return fork


def compare(workload: Workload, costs: Costs, cluster: Cluster, steps: int,
            windows: list[float], policy: Policy = RLBOOST, skew: int = 8,
            refine: int = 4) -> list[StepCompare]:
    """Per step: the controller's window and step time, and the best of ``windows`` (refined
    ``refine`` times by halving the grid spacing around the best so far)."""
    sim = Simulator(workload, costs, cluster, policy, rebalance_skew=skew)
    sim.manual = True
    sim.start_trace()
    out = []
    for index in range(steps):
        tried: dict[float, float] = {}
        for w in windows:
            tried[w] = _one_step(sim, index, w).records[index]["step_s"]
        spacing = (max(windows) - min(windows)) / max(1, len(windows) - 1)
        for _ in range(refine):
            best = min(tried, key=lambda w: (tried[w], w))
            spacing /= 2
            for w in (best - spacing, best + spacing):
                if w >= 0 and w not in tried:
                    tried[w] = _one_step(sim, index, w).records[index]["step_s"]
        spot = sum(1 for i in sim.fleet.spot() if i.state in ("loading", "ready"))
        _one_step(sim, index, None)
        record = sim.records[index]
        tried.setdefault(record["seeding_window_s"], record["step_s"])
        best = min(tried, key=lambda w: (tried[w], w))
        out.append(StepCompare(index, spot, record["seeding_window_s"], record["step_s"], best,
                               tried[best]))
    return out
