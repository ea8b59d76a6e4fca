"""The best step time any scheduler could reach on the same work and capacity.

SIMULATION, analytic. Two lower bounds per step; the ideal is the larger:

* Work bound. Rollout needs ``W / rate`` instance-seconds, ``rate`` being one instance's
  tokens/s at its fullest batch (the cost model's best). The reserved instances also train
  (``T_train`` of the whole cluster) and nothing useful runs during the optimizer step and the
  publish (``T_fixed``: the next rollout needs the new weights). With ``n_r`` reserved and
  ``n_s`` spot instances (the trace's mean): ``X >= (Wi + n_r * T_train) / (n_r + n_s)`` and
  ``X >= T_train``, step = ``T_fixed + X``.
* Critical path. The longest response decodes its tokens one after another, at best at batch
  one (``decode_s_base + decode_s_per_seq``), after its prompt's prefill; its group then trains
  and the version is published: ``L_max * t_token + group train + T_fixed``.

Both ignore what no scheduler avoids anyway but the real protocol pays (weight pulls, boot),
so a policy's fraction of the ideal is a conservative measure of what is left to win.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.config import Costs, Workload
from sim.turns import length


@dataclass(frozen=True)
class Bound:
    work_s: float
    critical_s: float

    @property
    def step_s(self) -> float:
        return max(self.work_s, self.critical_s)


def instance_rate(costs: Costs) -> float:
    """Tokens/s of one instance at its fullest batch (mean context for the context-aware
    model, whose per-sequence figure is taken at the emulation's 4k context)."""
    b = costs.max_batch
    return b / (costs.serving.decode_s_base + costs.serving.decode_s_per_seq * b
                + costs.host_step_s)


def step_bound(workload: Workload, costs: Costs, step: int, reserved: int,
               spot_mean: float) -> Bound:
    w = workload
    lengths = [[length(w, step, p, s) for s in range(w.samples)] for p in range(w.prompts)]
    spt = costs.compute.seconds_per_token
    tokens = sum(map(sum, lengths))
    t_train = (tokens + w.prompt_tokens * w.prompts * w.samples) * spt
    t_fixed = costs.compute.optimizer_step_s + costs.publish_s
    work = tokens / instance_rate(costs)
    x = max(t_train, (work + reserved * t_train) / (reserved + spot_mean))
    longest = max(range(w.prompts), key=lambda p: max(lengths[p]))
    t_token = costs.serving.decode_s_base + costs.serving.decode_s_per_seq + costs.host_step_s
    group = (sum(lengths[longest]) + w.prompt_tokens * w.samples) * spt
    critical = (max(lengths[longest]) * t_token + w.prompt_tokens
                * costs.serving.prefill_s_per_token + group + t_fixed)
    return Bound(t_fixed + x, critical)
