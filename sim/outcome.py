"""One policy's result over a measured span of simulated time, and running one.

Measured like ``make bench-paper`` measures the services: step 0 (start-up) is left out, and a
policy is measured on the steps that finished inside the span, from the first measured step's
start to the last one's end; spot GPU time is billed over the same interval.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sim.config import ON_DEMAND_GPU_H, SPOT_GPU_H, Cluster, Costs, Policy, Workload
from sim.simulator import Simulator


@dataclass
class Outcome:
    """What one policy achieved over its measured span; ``make bench-paper`` measures the
    services' emulated runs into the same shape, so both are priced and tabled alike."""

    policy: str
    steps: list[dict[str, Any]]  # step records inside the span
    window_s: float  # from the first measured step's start to the last one's end
    reserved_gpu_s: float
    spot_gpu_s: float
    spot_history: list[tuple[float, int]] = field(default_factory=list)  # (t, spot count)
    events: int = 0  # simulator events processed (0 for an emulated run)

    @property
    def tokens(self) -> int:
        return sum(int(s["tokens"]) for s in self.steps)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.window_s if self.window_s > 0 else 0.0

    @property
    def step_s(self) -> float:
        return sum(s["step_s"] for s in self.steps) / len(self.steps) if self.steps else 0.0

    def dollars(self, on_demand_gpu_h: float = ON_DEMAND_GPU_H,
                spot_gpu_h: float = SPOT_GPU_H) -> float:
        return (self.reserved_gpu_s * on_demand_gpu_h + self.spot_gpu_s * spot_gpu_h) / 3600

    def tokens_per_dollar(self, on_demand_gpu_h: float = ON_DEMAND_GPU_H,
                          spot_gpu_h: float = SPOT_GPU_H) -> float:
        cost = self.dollars(on_demand_gpu_h, spot_gpu_h)
        return self.tokens / cost if cost > 0 else 0.0

    def total(self, key: str) -> float:
        return sum(float(s.get(key, 0.0)) for s in self.steps)

    def mean(self, key: str) -> float:
        return self.total(key) / len(self.steps) if self.steps else 0.0

    @property
    def trainer_idle_pct(self) -> float:
        busy = self.total("step_s")
        return 100 * self.total("trainer_idle_s") / busy if busy else 0.0


@dataclass
class Result:
    """An outcome with its configuration and its ideal step time (:mod:`sim.ideal`)."""

    model: str
    trace: str
    ratio: float
    outcome: Outcome
    ideal_step_s: float
    spot_mean: float

    @property
    def of_ideal(self) -> float:
        return self.ideal_step_s / self.outcome.step_s


def simulate(policy: Policy, workload: Workload, costs: Costs, cluster: Cluster,
             span_s: float, skew: int = 8, warmup_steps: int = 1,
             steps: int | None = None) -> Outcome:
    """Run ``policy`` for ``span_s`` simulated seconds after its warm-up steps; measure the
    steps that finished inside the span, or with ``steps`` the first that many after the
    warm-up however long they take (to compare step for step with a run that had them: a
    span holds whole steps only, so two ~22 s steps in 50 s become one at 26 s)."""
    sim = Simulator(workload, costs, cluster, policy, rebalance_skew=skew)
    t0, deadline = sim.run(span_s, warmup_steps, steps)
    measured = [r for r in sim.records[warmup_steps:] if r["finished_at"] <= deadline]
    if not measured:
        raise RuntimeError(f"{policy.name}: no step finished inside {span_s:.0f}s")
    start, end = measured[0]["started_at"], measured[-1]["finished_at"]
    reserved, spot = sim.gpu_seconds(start, end)
    history = [(t0 + t - start, c) for t, c in zip(cluster.spot_times, cluster.spot_counts,
                                                    strict=True)] if policy.spot else []
    return Outcome(policy.name, measured, end - start, reserved, spot, history,
                   sim.clock.processed)
