"""The figures of ``make bench-paper-sim`` (SIMULATION), each titled to fit its width."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks import provenance
from sim.config import Workload
from sim.turns import length

if TYPE_CHECKING:
    from sim.hindsight import StepCompare
    from sim.outcome import Result

PAPER_THROUGHPUT = (1.51, 1.97)  # RLBoost, NSDI 2026
PAPER_COST = (1.28, 1.49)


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    provenance.save(fig, path, "make bench-paper-sim")
    _plt().close(fig)


def headline(grid: dict[tuple[str, str, float], tuple[Result, Result]], models: list[str],
             traces: list[str], path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(traces)
    for ax, index, band, label in ((axes[0], 0, PAPER_THROUGHPUT, "throughput"),
                                   (axes[1], 1, PAPER_COST, "trained tokens per $")):
        for k, trace in enumerate(traces):
            values = []
            for model in models:
                base, boost = grid[model, trace, 1.0]
                values.append(boost.outcome.tokens_per_s / base.outcome.tokens_per_s
                              if index == 0 else boost.outcome.tokens_per_dollar()
                              / base.outcome.tokens_per_dollar())
            xs = [m + (k - (len(traces) - 1) / 2) * width for m in range(len(models))]
            ax.bar(xs, values, width, label=trace)
        ax.axhspan(*band, color="grey", alpha=0.2, label="paper's range")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(models)), [m.removeprefix("emu-").upper() for m in models])
        ax.set_ylabel(f"{label}, rlboost / reserved-only")
        ax.set_title(f"{label} (spot:reserved GPUs = 1)", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("SIMULATION: rlboost vs reserved-only, 2 h of each trace", fontsize=11)
    _save(fig, path)


def sensitivity(grid: dict[tuple[str, str, float], tuple[Result, Result]], traces: list[str],
                ratios: list[float], path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for trace in traces:
        pairs = [grid["emu-8b", trace, r] for r in ratios]
        axes[0].plot(ratios, [b.outcome.tokens_per_s / a.outcome.tokens_per_s
                              for a, b in pairs], marker="o", label=trace)
        axes[1].plot(ratios, [b.outcome.tokens_per_dollar() / a.outcome.tokens_per_dollar()
                              for a, b in pairs], marker="o", label=trace)
    for ax, label in ((axes[0], "throughput"), (axes[1], "tokens per $")):
        ax.set_xlabel("spot : reserved GPUs (trace mean)")
        ax.set_ylabel(f"{label} vs reserved-only")
        ax.set_title(f"8B: {label} by spot capacity", fontsize=10)
        ax.set_xticks(ratios)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("SIMULATION: sensitivity to spot capacity", fontsize=11)
    _save(fig, path)


def ablations(names: list[str], results: list[Result], base: Result, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 4))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [r.outcome.tokens_per_s / base.outcome.tokens_per_s
                                   for r in results], 0.4, label="throughput")
    ax.bar([x + 0.2 for x in xs], [r.outcome.tokens_per_dollar()
                                   / base.outcome.tokens_per_dollar() for r in results], 0.4,
           label="tokens per $")
    ax.plot(xs, [r.of_ideal for r in results], "k^", label="fraction of ideal step time")
    ax.set_xticks(list(xs), [n.replace(" ", "\n", 1) for n in names], fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("vs reserved-only")
    ax.set_title("SIMULATION: ablations, 8B on p3, spot:reserved 1", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    _save(fig, path)


PARTS = [("window_seen_s", "seeding window"), ("tail_s", "rollout after window"),
         ("train_tail_s", "training after barrier"), ("fixed_s", "optimizer + publish")]


def breakdown(names: list[str], results: list[Result], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 4.2))
    bottoms = [0.0] * len(names)
    for key, label in PARTS:
        # The last part is what the others leave of the step: optimizer step and publish.
        values = [r.outcome.mean("step_s") - sum(r.outcome.mean(k) for k, _ in PARTS[:3])
                  if key == "fixed_s" else r.outcome.mean(key) for r in results]
        ax.bar(range(len(names)), values, 0.6, bottom=bottoms, label=label)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.plot(range(len(names)), [r.outcome.mean("trainer_idle_s") for r in results], "k_",
            markersize=30, label="trainer idle (inside the above)")
    spot = [(k, r.outcome.mean("spot_first_s")) for k, r in enumerate(results) if r.spot_mean]
    ax.plot([k for k, _ in spot], [v for _, v in spot], "rx",
            label="first spot token (weight pull)")
    ax.set_xticks(range(len(names)), [n.replace(" ", "\n", 1) for n in names], fontsize=8)
    ax.set_ylabel("seconds per step (mean)")
    ax.set_title("SIMULATION: where each policy's step goes, 8B on p3", fontsize=10)
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    _save(fig, path)


def seeding(compared: list[StepCompare], path: Path) -> None:
    plt = _plt()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1]})
    steps = [c.step for c in compared]
    top.plot(steps, [c.window for c in compared], "o-", label="controller's window")
    top.plot(steps, [c.best_window for c in compared], "s--", label="hindsight-best window")
    top.set_ylabel("seeding window (s)")
    loss = sum(c.step_s for c in compared) / sum(c.best_step_s for c in compared) - 1
    top.set_title(f"SIMULATION: seeding window per step, 8B (step-time loss {100 * loss:.1f} %)",
                  fontsize=10)
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    bottom.step(steps, [c.spot for c in compared], where="mid")
    bottom.set_ylabel("spot instances")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    _save(fig, path)


def lengths(work: Workload, path: Path) -> None:
    plt = _plt()
    draws = [length(work, 0, p, s) for p in range(work.prompts) for s in range(work.samples)]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.hist(draws, bins=60)
    ax.set_xlabel("response tokens")
    ax.set_ylabel("responses")
    ax.set_title(f"Response lengths of one step: lognormal, mean {work.mean_tokens:,.0f}, "
                 f"cap {work.max_new_tokens:,}", fontsize=10)
    ax.grid(alpha=0.3)
    _save(fig, path)
