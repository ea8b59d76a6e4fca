"""The asynchronous rows of ``make bench-paper-sim``: staleness 1 and 2 beside synchronous runs.

SIMULATION (:mod:`sim`, bounded staleness as :mod:`sim.simulator` models it). The headline's
configurations at spot:reserved 1 (every model on every trace, 8 reserved H100s, the same
prices) run rlboost with ``staleness`` 1 and 2; each row is set against the same trace's
synchronous rlboost run and its reserved-only run. Throughput is trained tokens per second,
tokens/$ trained tokens per dollar: neither counts what staleness costs in learning per token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks import provenance
from sim.config import RESERVED_ONLY, RLBOOST, Cluster, Costs, Policy, Workload
from sim.outcome import Outcome, simulate

STALENESS = [1, 2]


def policy(k: int) -> Policy:
    return RLBOOST if k == 0 else replace(RLBOOST, name=f"rlboost, staleness {k}", staleness=k)


@dataclass(frozen=True)
class Row:
    """One configuration at one staleness, with the same configuration's baselines."""

    model: str
    trace: str
    staleness: int
    run: Outcome
    sync: Outcome  # rlboost, staleness 0
    base: Outcome  # reserved-only

    def ratios(self, to: Outcome) -> tuple[float, float]:
        return (self.run.tokens_per_s / to.tokens_per_s,
                self.run.tokens_per_dollar() / to.tokens_per_dollar())


def simulate_rows(clusters: dict[tuple[str, str], Cluster], span_s: float,
                  syncs: dict[tuple[str, str], tuple[Outcome, Outcome]] | None = None
                  ) -> list[Row]:
    """Per (model, trace): the synchronous pair (``syncs``' when given: the headline's own
    runs of (reserved-only, rlboost)), then rlboost at each of :data:`STALENESS`."""
    rows = []
    for (model, trace), cluster in clusters.items():
        costs, work = Costs.paper(model), Workload.reasoning()
        base, sync = (syncs or {}).get((model, trace)) or tuple(
            simulate(p, work, costs, cluster, span_s) for p in (RESERVED_ONLY, RLBOOST))
        rows.append(Row(model, trace, 0, sync, sync, base))
        for k in STALENESS:
            rows.append(Row(model, trace, k, simulate(policy(k), work, costs, cluster, span_s),
                            sync, base))
    return rows


def table(rows: list[Row]) -> str:
    header = ["model", "trace", "staleness", "step s", "tokens/s", "tokens/$",
              "throughput vs sync", "tokens/$ vs sync", "throughput vs reserved",
              "tokens/$ vs reserved", "off-policy tokens", "re-prefilled tokens/step"]
    lines = []
    for r in rows:
        o = r.run
        sync_tps, sync_tpd = r.ratios(r.sync)
        base_tps, base_tpd = r.ratios(r.base)
        lines.append([r.model, r.trace, str(r.staleness), f"{o.step_s:,.0f}",
                      f"{o.tokens_per_s:,.0f}", f"{o.tokens_per_dollar():,.0f}",
                      f"{sync_tps:.2f}x", f"{sync_tpd:.2f}x", f"{base_tps:.2f}x",
                      f"{base_tpd:.2f}x",
                      f"{100 * o.total('tokens_off_policy') / o.tokens:.0f} %",
                      f"{o.mean('tokens_reprefilled'):,.0f}"])
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                      *("| " + " | ".join(x) + " |" for x in lines)])


def section(rows: list[Row], provenance: str, figures: str) -> str:
    gains = {k: [r.ratios(r.sync) for r in rows if r.staleness == k] for k in STALENESS}
    load_s = Costs.paper("emu-8b").load_s
    by = {(r.model, r.trace, r.staleness): r.run.tokens_per_s for r in rows}
    flat_keys = [(m, t) for m, t, k in by if k == 2 and by[m, t, 2] < 1.01 * by[m, t, 1]]
    flat = [f"{m[4:]} {t}" for m, t in flat_keys]

    def span(k: int, which: int) -> str:
        values = [g[which] for g in gains[k]]
        return f"{min(values):.2f}\u2013{max(values):.2f}x"

    return (
        "## Asynchronous runs: staleness 1 and 2 vs synchronous (spot:reserved 1)\n\n"
        f"**SIMULATION**; {provenance}\n\n"
        "The headline's configurations at spot:reserved 1 with rlboost's `staleness` k > 0 "
        "(issue 39, `sim/simulator.py`): step m's responses may be generated once version "
        "m \u2212 k is published, oldest step first, so no trained token is more than k versions "
        "old. Spot instances keep generating across the barrier and pull each new version in the "
        "background; loading it stops their engine, after which the responses they hold continue "
        "on the new version with their context prefilled again (the *re-prefilled tokens* "
        f"column; the load takes {load_s:.1f} s for 8B, the prefill the serving model's "
        "rate per token). The reserved side never generates while its GPUs train. Ratios are "
        "against the same trace's synchronous rlboost run (staleness 0, the headline's) and its "
        "reserved-only run; *off-policy tokens* is the share of trained tokens sampled by a "
        "version older than their step's.\n\n"
        f"![staleness vs synchronous]({figures}sim-async.png)\n\n" + table(rows) + "\n\n"
        f"Against synchronous rlboost, staleness 1 gives {span(1, 0)} the throughput and "
        f"{span(1, 1)} the tokens per dollar; staleness 2 {span(2, 0)} and {span(2, 1)}. "
        "Both ratios move together: the trace decides the spot capacity billed and the "
        "reserved GPUs are billed throughout, so a run pays the same per second whatever its "
        "staleness. "
        + (f"Staleness 2 adds under 1 % to staleness 1 for {', '.join(flat)}: there the "
           "next step's responses already keep the spot instances busy through the trainer's "
           "step, so a second step ahead has little to add. " if flat else "")
        + "What favours asynchrony here: the spot instances that synchronously sit idle through "
        "a step's tail (its last, longest responses), its training, the publish and their "
        "weight pull now generate the next steps' responses, and the trainer's step is "
        "often rolled out, in part or in full, by the time the trainer comes to it. What "
        "counts against it and is *not* in these figures: a stale token teaches less than a "
        "fresh one (the simulator counts trained tokens, not learning; off-policy corrections "
        "recover part of it; reward per step against staleness is for the emulated services to "
        "measure, not the simulator), and larger k trains on more off-policy tokens. What is "
        "in them: each version swap stops a spot "
        "instance for the load and charges the prefill of every response it holds again.")


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys((r.model, r.trace) for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / (len(STALENESS) + 1)
    for ax, which, label in ((axes[0], 0, "throughput"), (axes[1], 1, "trained tokens per $")):
        for n, k in enumerate([0, *STALENESS]):
            mine = [r for r in rows if r.staleness == k]
            xs = [configs.index((r.model, r.trace)) + (n - len(STALENESS) / 2) * width
                  for r in mine]
            ax.bar(xs, [r.ratios(r.base)[which] for r in mine], width, label=f"staleness {k}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(configs)), [f"{m[4:]}\n{t}" for m, t in configs], fontsize=8)
        ax.set_ylabel(f"{label}, rlboost / reserved-only")
        ax.set_title(f"spot:reserved 1: {label}", fontsize=10)
        ax.set_ylim(0, 1.25 * max(r.ratios(r.base)[which] for r in rows))  # legend room
        ax.legend(fontsize=8, loc="upper left", ncols=3)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("SIMULATION: bounded staleness vs synchronous, 2 h of each trace", fontsize=11)
    fig.tight_layout()
    provenance.save(fig, path, "make bench-paper-sim")
    plt.close(fig)
