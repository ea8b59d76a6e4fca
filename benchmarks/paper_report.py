"""Cost model, table and plot for ``make bench-paper``.

Prices are per GPU-hour, named settings whose defaults (and their sources) are the simulator's,
:data:`sim.config.ON_DEMAND_GPU_H` and :data:`sim.config.SPOT_GPU_H`, so emulation and
simulation price alike: ``RLBOOST_PRICE_ON_DEMAND_GPU_H``, ``RLBOOST_PRICE_SPOT_GPU_H``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from benchmarks import provenance
from sim.config import ON_DEMAND_GPU_H, SPOT_GPU_H
from sim.outcome import Outcome


@dataclass(frozen=True)
class Prices:
    on_demand_gpu_h: float = ON_DEMAND_GPU_H
    spot_gpu_h: float = SPOT_GPU_H

    @classmethod
    def from_env(cls) -> Prices:
        return cls(float(os.environ.get("RLBOOST_PRICE_ON_DEMAND_GPU_H") or ON_DEMAND_GPU_H),
                   float(os.environ.get("RLBOOST_PRICE_SPOT_GPU_H") or SPOT_GPU_H))

    def tokens_per_dollar(self, outcome: Outcome) -> float:
        return outcome.tokens_per_dollar(self.on_demand_gpu_h, self.spot_gpu_h)


COLUMNS = ("policy", "steps", "tokens/s", "vs (a)", "tokens/$", "vs (a)", "regenerated",
           "migrations", "trainer idle %", "spot GPUs")


def table(outcomes: list[Outcome], prices: Prices) -> list[list[str]]:
    base = outcomes[0]
    rows = []
    for o in outcomes:
        tps = o.tokens_per_s / base.tokens_per_s if base.tokens_per_s else 0.0
        tpd = prices.tokens_per_dollar(o) / prices.tokens_per_dollar(base) \
            if prices.tokens_per_dollar(base) else 0.0
        mean_spot = o.spot_gpu_s / o.window_s if o.window_s else 0.0
        rows.append([o.policy, str(len(o.steps)), f"{o.tokens_per_s:,.0f}", f"{tps:.2f}x",
                     f"{prices.tokens_per_dollar(o):,.0f}", f"{tpd:.2f}x",
                     f"{o.total('tokens_regenerated'):,.0f}", f"{o.total('migrations'):,.0f}",
                     f"{o.trainer_idle_pct:.0f}", f"{mean_spot:.1f}"])
    return rows


def render(rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*COLUMNS), *(fmt.format(*r) for r in rows)])


def plot(outcomes: list[Outcome], path: Path, title: str) -> None:
    """Throughput per step over time for each policy, the live spot count beneath."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1]})
    for o in outcomes:
        t0 = o.steps[0]["started_at_emu"] if o.steps else 0.0
        xs = [s["finished_at_emu"] - t0 for s in o.steps]
        ys = [s["tokens"] / s["step_s"] for s in o.steps]
        top.step(xs, ys, where="pre", label=o.policy)
    top.set_ylabel("trained tokens/s (per step)")
    top.set_title(title, fontsize=10)
    top.legend(fontsize=8, loc="lower right")
    top.grid(alpha=0.3)
    for o in outcomes:
        if o.spot_history:
            xs = [t for t, _ in o.spot_history]
            bottom.step(xs, [c for _, c in o.spot_history], where="post", label=o.policy,
                        alpha=0.7)
            break  # every spot policy replays the same trace: one line says it
    bottom.set_ylabel("spot instances")
    bottom.set_xlabel("emulated seconds since the first measured step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    provenance.save(fig, path, "make bench-paper")
    plt.close(fig)
