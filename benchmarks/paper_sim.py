"""``make bench-paper-sim``: the paper's figure set, in the simulator, at the paper's scale.

SIMULATION (:mod:`sim`: the manager's own seeding and placement code on simulated time; its
agreement with the emulated services is what ``make bench-sim-check`` measures). Every
configuration simulates a 2-hour segment of a real spot trace after one warm-up step:

* reserved cluster: 8 H100s (modelled) that train and, per policy, roll out;
* spot: the trace's count scaled so the mean spot GPUs are ``ratio`` x the reserved GPUs;
* workload: 256 prompts x 8 samples of reasoning-length responses (:mod:`sim.config`);
* costs: :meth:`sim.config.Costs.paper` (true-context decode, memory-bound batch, publish,
  spot boot + engine start, contended weight egress, billing through a 120 s grace).

Writes ``docs/results/paper-sim.md`` and ``sim-*.png``, and regenerates the results page
(``docs/results-simulated.md``, on the documentation site) between its ``paper-sim`` markers;
each file's figure links are relative to that file, so both render where they stand. The
agentic workload (:mod:`benchmarks.paper_sim_agentic`) goes to ``paper-sim-agentic.md``,
``sim-agentic.png`` and the page's ``paper-sim-agentic`` markers; ``--only agentic`` runs that
part alone. The asynchronous rows (:mod:`benchmarks.paper_sim_async`: staleness 1 and 2 beside
the synchronous runs) go to ``paper-sim-async.md``, ``sim-async.png`` and the page's
``paper-sim-async`` markers; ``--only async`` runs them alone. The version-kind rows
(:mod:`benchmarks.paper_sim_join`: full, delta and adapter pulls on p3) go to
``paper-sim-join.md`` and the page's ``paper-sim-join`` markers; ``--only join`` runs them alone
(about ten minutes here, against well over an hour for the whole).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from benchmarks import paper_sim_agentic as agentic
from benchmarks import paper_sim_async as asynchronous
from benchmarks import paper_sim_join as join
from benchmarks import paper_sim_plots as plots
from benchmarks import paper_sim_robust as robust
from benchmarks import paper_sim_robust_report as robust_report
from benchmarks import provenance
from benchmarks.paper_sim_setup import (
    RESERVED_GPUS,
    SEGMENT_S,
    TRACES,
    cluster_for,
    md_table,
    replace_section,
    spot_mean,
)
from sim import ideal
from sim.config import (
    ABLATIONS,
    ON_DEMAND_GPU_H,
    REASONING_MAX_TOKENS,
    REASONING_MEAN_TOKENS,
    RESERVED_ONLY,
    RLBOOST,
    SPOT_GPU_H,
    Cluster,
    Costs,
    Policy,
    Workload,
)
from sim.hindsight import StepCompare, compare
from sim.outcome import Outcome, Result, simulate

MODELS = ["emu-8b", "emu-14b", "emu-32b"]
RATIOS = [0.5, 1.0, 2.0]
# A trace with sharp capacity changes for the seeding controller: 8 -> 2 -> 12 -> 4 spot.
SHARP = ([0.0, 2400.0, 4800.0, 7200.0], [8, 2, 12, 4])
SWEEP = [0.0, 50.0, 100.0, 150.0, 200.0, 300.0, 400.0, 600.0]
COMMAND, COMMAND_ALONE = "make bench-paper-sim", "python -m benchmarks.paper_sim --only"
AGENTIC_BEGIN = "<!-- paper-sim-agentic:begin -->"
AGENTIC_END = "<!-- paper-sim-agentic:end -->"
ASYNC_BEGIN, ASYNC_END = "<!-- paper-sim-async:begin -->", "<!-- paper-sim-async:end -->"
ROBUST_BEGIN = "<!-- paper-sim-robust:begin -->"
ROBUST_END = "<!-- paper-sim-robust:end -->"
JOIN_BEGIN, JOIN_END = "<!-- paper-sim-join:begin -->", "<!-- paper-sim-join:end -->"
FIGURES = [("throughput and tokens per $", "sim-headline.png"),
           ("spot capacity", "sim-sensitivity.png"), ("ablations", "sim-ablations.png"),
           ("time breakdown", "sim-breakdown.png"),
           ("seeding window vs hindsight", "sim-seeding.png"),
           ("response lengths", "sim-lengths.png")]


def run(policy: Policy, model: str, trace: str, ratio: float) -> Result:
    work, costs = Workload.reasoning(), Costs.paper(model)
    cluster = cluster_for(trace, model, ratio)
    out = simulate(policy, work, costs, cluster, SEGMENT_S)
    reserved = max(1, RESERVED_GPUS // costs.serving.gpus)
    spot = spot_mean(cluster) if policy.spot else 0.0
    bounds = [ideal.step_bound(work, costs, s["step"], reserved, spot).step_s
              for s in out.steps]
    return Result(model, trace, ratio, out, sum(bounds) / len(bounds), spot)


def versus(r: Result, base: Result) -> tuple[float, float]:
    return (r.outcome.tokens_per_s / base.outcome.tokens_per_s,
            r.outcome.tokens_per_dollar() / base.outcome.tokens_per_dollar())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--results-page", type=Path, default=Path("docs/results-simulated.md"),
                        help="the page whose paper-sim section is regenerated")
    parser.add_argument("--steps", type=int, default=16, help="steps of the seeding comparison")
    parser.add_argument("--only", choices=["all", "agentic", "async", "join", "robust"],
                        default="all",
                        help="agentic: only the agentic workload's section (and its own "
                        "single-turn runs); async: only the staleness rows (and their own "
                        "synchronous runs); join: only the version-kind rows (and their own "
                        "full-version runs); robust: only every segment, the stronger "
                        "baselines and the sweeps")
    args = parser.parse_args(argv)
    provenance.commit()  # before any output is written: the outputs are tracked files
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only == "agentic":
        write_agentic(args.out, args.results_page, None, started)
        return 0
    if args.only == "async":
        write_async(args.out, args.results_page, None, started)
        return 0
    if args.only == "join":
        write_join(args.out, args.results_page, None, started)
        return 0
    if args.only == "robust":
        write_robust(args.out, args.results_page, started)
        return 0
    sections: list[str] = []

    # 1. Headline and spot-capacity sensitivity: every model x trace x ratio.
    grid: dict[tuple[str, str, float], tuple[Result, Result]] = {}
    for model in MODELS:
        bases = {t: run(RESERVED_ONLY, model, t, 1.0) for t in TRACES}
        for trace in TRACES:
            for ratio in RATIOS if model == "emu-8b" else [1.0]:
                grid[model, trace, ratio] = (bases[trace], run(RLBOOST, model, trace, ratio))
        print(f"  {model}: done ({time.monotonic() - started:.0f}s)", flush=True)
    rows = []
    for (model, trace, ratio), (base, boost) in grid.items():
        tps, tpd = versus(boost, base)
        rows.append([model, trace, f"{ratio:g}", f"{boost.outcome.step_s:,.0f}",
                     f"{boost.outcome.tokens_per_s:,.0f}", f"{tps:.2f}x", f"{tpd:.2f}x",
                     f"{boost.of_ideal:.2f}", f"{base.of_ideal:.2f}"])
    sections.append("## Throughput and tokens per $ vs reserved-only\n\n" + md_table(
        ["model", "trace", "spot:reserved", "step s", "tokens/s", "throughput vs reserved",
         "tokens/$ vs reserved", "rlboost / ideal", "reserved-only / ideal"], rows))
    plots.headline(grid, MODELS, TRACES, args.out / "sim-headline.png")
    plots.sensitivity(grid, TRACES, RATIOS, args.out / "sim-sensitivity.png")

    # 2. Ablations and where the time goes (8B, p3, ratio 1).
    base, boost = grid["emu-8b", "p3", 1.0]
    policies = [base, boost] + [run(p, "emu-8b", "p3", 1.0) for p in ABLATIONS]
    names = [RESERVED_ONLY.name, RLBOOST.name] + [p.name for p in ABLATIONS]
    rows = []
    for name, r in zip(names, policies, strict=True):
        tps, tpd = versus(r, base)
        o = r.outcome
        rows.append([name, str(len(o.steps)), f"{o.step_s:,.0f}", f"{tps:.2f}x", f"{tpd:.2f}x",
                     f"{o.mean('seeding_window_s'):,.0f}",
                     f"{o.mean('spot_first_s'):,.0f}" if r.spot_mean else "-",
                     f"{o.mean('migrations'):,.0f}", f"{o.mean('tokens_regenerated'):,.0f}",
                     f"{r.of_ideal:.2f}"])
    sections.append("## Ablations (8B, p3, spot:reserved 1)\n\n" + md_table(
        ["policy", "steps", "step s", "throughput", "tokens/$", "window s",
         "first spot token s", "migrations/step", "tokens regenerated/step", "of ideal"], rows))
    sections.append(loss_note(boost))
    plots.ablations(names, policies, base, args.out / "sim-ablations.png")
    plots.breakdown(names, policies, args.out / "sim-breakdown.png")
    print(f"  ablations: done ({time.monotonic() - started:.0f}s)", flush=True)

    # 3. The seeding controller against the per-step hindsight-best window.
    costs = Costs.paper("emu-8b")
    sharp = Cluster(RESERVED_GPUS, SHARP[0], SHARP[1])
    compared = compare(Workload.reasoning(), costs, sharp, args.steps, SWEEP)
    sections.append(seeding_section(compared))
    plots.seeding(compared, args.out / "sim-seeding.png")
    plots.lengths(Workload.reasoning(), args.out / "sim-lengths.png")
    print(f"  seeding: done ({time.monotonic() - started:.0f}s)", flush=True)

    def body(where: Path) -> str:
        return "\n\n".join([intro(figures_from(where, args.out)), *sections])

    (args.out / "paper-sim.md").write_text(body(args.out) + "\n")
    print(body(args.out))
    replace_section(args.results_page, body(args.results_page.parent))
    print(f"\nwrote {args.out}/paper-sim.md, sim-*.png and {args.results_page}'s results section "
          f"({time.monotonic() - started:.0f}s in all)")
    singles = {t: (grid["emu-8b", t, 1.0][0].outcome, grid["emu-8b", t, 1.0][1].outcome)
               for t in TRACES}
    write_agentic(args.out, args.results_page, singles, started)
    syncs = {(m, t): (grid[m, t, 1.0][0].outcome, grid[m, t, 1.0][1].outcome)
             for m in MODELS for t in TRACES}
    write_async(args.out, args.results_page, syncs, started)
    write_join(args.out, args.results_page, syncs, started)
    write_robust(args.out, args.results_page, started)
    return 0


def write_agentic(out: Path, page: Path, singles: dict[str, tuple[Outcome, Outcome]] | None,
                  started: float) -> None:
    """The agentic section: its runs (the single-turn ones from ``singles`` if given), figure,
    file and the page's section."""
    clusters = {t: cluster_for(t, agentic.MODEL, 1.0) for t in TRACES}
    pairs = agentic.simulate_pairs(clusters, SEGMENT_S, singles)
    agentic.plot(pairs, out / "sim-agentic.png")
    made = provenance.line(COMMAND, f"{COMMAND_ALONE} agentic")

    def body(where: Path) -> str:
        return agentic.section(pairs, made, figures_from(where, out))

    (out / "paper-sim-agentic.md").write_text(body(out) + "\n")
    print(body(out))
    replace_section(page, body(page.parent), AGENTIC_BEGIN, AGENTIC_END)
    print(f"\nwrote {out}/paper-sim-agentic.md, sim-agentic.png and {page}'s agentic section "
          f"({time.monotonic() - started:.0f}s in all)")


def write_async(out: Path, page: Path,
                syncs: dict[tuple[str, str], tuple[Outcome, Outcome]] | None,
                started: float) -> None:
    """The staleness rows: their runs (the synchronous ones from ``syncs`` if given), figure,
    file and the page's section."""
    clusters = {(m, t): cluster_for(t, m, 1.0) for m in MODELS for t in TRACES}
    rows = asynchronous.simulate_rows(clusters, SEGMENT_S, syncs)
    asynchronous.plot(rows, out / "sim-async.png")
    made = provenance.line(COMMAND, f"{COMMAND_ALONE} async")

    def body(where: Path) -> str:
        return asynchronous.section(rows, made, figures_from(where, out))

    (out / "paper-sim-async.md").write_text(body(out) + "\n")
    print(body(out))
    replace_section(page, body(page.parent), ASYNC_BEGIN, ASYNC_END)
    print(f"\nwrote {out}/paper-sim-async.md, sim-async.png and {page}'s asynchronous section "
          f"({time.monotonic() - started:.0f}s in all)")


def write_join(out: Path, page: Path,
               fulls: dict[tuple[str, str], tuple[Outcome, Outcome]] | None,
               started: float) -> None:
    """The version-kind rows: their runs (the full-version ones from ``fulls`` if given), file
    and the page's section."""
    clusters = {(m, t): cluster_for(t, m, 1.0) for m in MODELS for t in join.TRACES}
    rows = join.simulate_rows(clusters, SEGMENT_S, fulls)
    made = provenance.line(COMMAND, f"{COMMAND_ALONE} join")
    body = join.section(rows, made)
    (out / "paper-sim-join.md").write_text(body + "\n")
    print(body)
    replace_section(page, body, JOIN_BEGIN, JOIN_END)
    print(f"\nwrote {out}/paper-sim-join.md and {page}'s version-kind section "
          f"({time.monotonic() - started:.0f}s in all)")


def write_robust(out: Path, page: Path, started: float) -> None:
    """Every segment, the stronger baselines and the sweeps: runs, file, page section."""
    base = robust.baseline()
    segs = robust.segments(base)
    pairs = robust.baselines(base)
    sweeps = robust.sweeps(base)
    head = pairs[0][1]  # rlboost on the headline segment
    body = "\n\n".join([
        "## Robustness: every trace segment, stronger baselines, sweeps (8B)",
        f"**SIMULATION**; {provenance.line(COMMAND, f'{COMMAND_ALONE} robust')} What each "
        "part varies, and the sources of the published lengths: `benchmarks/paper_sim_robust.py`.",
        robust_report.statement(segs, base, head, pairs, sweeps),
        "### Every 2-hour segment of every trace (from 1 h in)\n\n"
        + robust_report.segments_table(segs, base),
        "### Stronger baselines (p3 headline segment)\n\n" + robust_report.baselines_table(pairs),
        "### Spot discount (the same runs, repriced)\n\n"
        + robust_report.discount_table(head, segs, base),
        "### Hard kills instead of notices\n\n" + robust_report.sweep_table(sweeps["hard kills"]),
        "### Spot instances on the trace's own GPU type\n\n"
        + robust_report.sweep_table(sweeps["spot GPU type"]),
        "### Response lengths\n\n" + robust_report.sweep_table(sweeps["lengths"])])
    (out / "paper-sim-robust.md").write_text(body + "\n")
    print(body)
    replace_section(page, body, ROBUST_BEGIN, ROBUST_END)
    print(f"\nwrote {out}/paper-sim-robust.md and {page}'s robustness section "
          f"({time.monotonic() - started:.0f}s in all)")


def loss_note(boost: Result) -> str:
    """Where rlboost's step goes against the ideal, from its own breakdown."""
    o = boost.outcome
    fixed = o.step_s - o.mean("window_seen_s") - o.mean("tail_s") - o.mean("train_tail_s")
    return (f"rlboost reaches **{boost.of_ideal:.2f}** of the ideal step time here "
            f"({o.step_s:,.0f} s against {boost.ideal_step_s:,.0f} s). Of its step, "
            f"{o.mean('window_seen_s'):,.0f} s is the seeding window, "
            f"{o.mean('tail_s'):,.0f} s rollout after it, {o.mean('train_tail_s'):,.0f} s "
            f"training after the barrier and {fixed:,.0f} s "
            "optimizer step and publish. The rollout after the window is the loss: it ends with "
            "the longest responses (up to 14,336 tokens) decoding at the per-token latency of a "
            "full batch, while the critical-path bound decodes them at batch one. Giving the "
            "longest responses their own lightly loaded instances once the queue drains (or "
            "speculative decoding on them) is what would remove it; more spot capacity does not.")


def seeding_section(compared: list[StepCompare]) -> str:
    rows = [[str(c.step), str(c.spot), f"{c.window:,.0f}", f"{c.best_window:,.0f}",
             f"{c.step_s:,.0f}", f"{c.best_step_s:,.0f}", f"{100 * c.loss:.1f} %"]
            for c in compared]
    total = sum(c.step_s for c in compared) / sum(c.best_step_s for c in compared) - 1
    warm = sum(c.step_s for c in compared[1:]) / sum(c.best_step_s for c in compared[1:]) - 1
    return ("## Seeding controller vs the per-step hindsight-best window (8B, spot 8 -> 2 -> "
            "12 -> 4 every 40 min)\n\n"
            + md_table(["step", "spot", "window s", "best window s", "step s", "best step s",
                        "loss"], rows)
            + f"\n\nStep-time loss against the per-step optimum over all steps: "
            f"**{100 * total:.1f} %**; after the first step (which has nothing measured yet): "
            f"**{100 * warm:.1f} %** (goal: at most 5 %).")


def figures_from(folder: Path, out: Path) -> str:
    """The prefix that reaches the figures in ``out`` from a file in ``folder``."""
    rel = Path(os.path.relpath(out, folder)).as_posix()
    return "" if rel == "." else f"{rel}/"


def intro(figures: str) -> str:
    return (
        f"{provenance.line(COMMAND)}\n\n"
        "**SIMULATION** (`make bench-paper-sim`, `sim/`): the manager's own seeding and "
        "placement code on simulated time; `make bench-sim-check` compares it with the "
        "emulated services. The paper (RLBoost, NSDI 2026) reports **1.51\u20131.97\u00d7** "
        "training throughput and **+28\u201349 %** tokens per dollar over on-demand-only.\n\n"
        f"- Workload: 256 prompts x 8 samples a step; response lengths lognormal (sigma 1.0), mean "
        f"{REASONING_MEAN_TOKENS:,} tokens, truncated at {REASONING_MAX_TOKENS:,} "
        "(Terra-Flux/PolyRL's example `max_response_length=14336`; the shape is an assumption, "
        "`sim/config.py`), 512-token prompts.\n"
        f"- Reserved: {RESERVED_GPUS} H100s; spot: a 2-hour segment (from 1 h in) of each "
        "Bamboo trace (AWS p3, AWS g4dn, GCP a100), scaled to a mean of ratio x 8 spot GPUs; "
        "32B runs 2-GPU instances.\n"
        "- Costs: decode at true context, batch bounded by HBM, publish 11-66 s (write, hash, "
        "upload), spot boot + engine start 90 s, weight egress 12.5 GB/s shared (+ peers), "
        f"billing through a 120 s grace; ${ON_DEMAND_GPU_H}/GPU-h on-demand, ${SPOT_GPU_H} spot "
        "(sources in `sim/config.py`, `shared/hardware.py`).\n"
        "- Ideal: per step the larger of the work bound and the critical-path bound "
        "(`sim/ideal.py`); a policy's fraction of ideal is ideal step time / its step time.\n\n"
        + "\n".join(f"![{alt}]({figures}{name})" for alt, name in FIGURES))


if __name__ == "__main__":
    raise SystemExit(main())
