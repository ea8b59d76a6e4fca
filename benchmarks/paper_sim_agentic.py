"""The agentic workload of ``make bench-paper-sim``: spot vs reserved-only, beside single-turn.

SIMULATION (:mod:`sim`, agentic responses as :mod:`sim.turns` draws them). The headline's
configuration (8B, 8 reserved H100s, spot:reserved 1 on each trace, the same prices) runs the
reasoning workload twice: single-turn, and in model turns with tool calls between them
(:class:`sim.config.Turns`'s stated distributions), plus once with slow tools on p3. The
section's text states every distribution and where it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import provenance
from sim.config import (
    AGENTIC_MAX_TOOL_S,
    AGENTIC_MAX_TURNS,
    AGENTIC_OBSERVATION_TOKENS,
    AGENTIC_TOOL_MEDIAN_S,
    AGENTIC_TOOL_SIGMA,
    AGENTIC_TURN_P,
    RESERVED_ONLY,
    RLBOOST,
    Cluster,
    Costs,
    Turns,
    Workload,
)
from sim.outcome import Outcome, simulate

MODEL = "emu-8b"
# Tools four times slower (a test suite, a web page fetched and read), cut at a minute.
SLOW = Turns(tool_median_s=4 * AGENTIC_TOOL_MEDIAN_S, max_tool_s=60.0)
SLOW_TRACE = "p3"
SINGLE, AGENTIC, AGENTIC_SLOW = "single-turn", "agentic", "agentic, slow tools"


@dataclass(frozen=True)
class Pair:
    """Reserved-only and rlboost on one workload and trace."""

    workload: str
    trace: str
    base: Outcome
    boost: Outcome

    @property
    def throughput(self) -> float:
        return self.boost.tokens_per_s / self.base.tokens_per_s

    @property
    def per_dollar(self) -> float:
        return self.boost.tokens_per_dollar() / self.base.tokens_per_dollar()


def simulate_pairs(clusters: dict[str, Cluster], span_s: float,
                   singles: dict[str, tuple[Outcome, Outcome]] | None = None) -> list[Pair]:
    """Every trace's single-turn pair (``singles``' when given: the headline's own runs) and
    agentic pair, then the slow-tools pair on :data:`SLOW_TRACE`."""
    costs = Costs.paper(MODEL)

    def both(work: Workload, cluster: Cluster) -> tuple[Outcome, Outcome]:
        base, boost = (simulate(p, work, costs, cluster, span_s) for p in (RESERVED_ONLY, RLBOOST))
        return base, boost

    pairs = []
    for trace, cluster in clusters.items():
        single = (singles or {}).get(trace) or both(Workload.reasoning(), cluster)
        pairs.append(Pair(SINGLE, trace, *single))
        pairs.append(Pair(AGENTIC, trace, *both(Workload.agentic(), cluster)))
    pairs.append(Pair(AGENTIC_SLOW, SLOW_TRACE,
                      *both(Workload.agentic(turns=SLOW), clusters[SLOW_TRACE])))
    return pairs


def _calls(o: Outcome) -> tuple[float, float]:
    """(tool calls per response, mean seconds per call) over the measured steps."""
    calls = o.total("tool_calls")
    responses = o.total("responses")
    return calls / responses, (o.total("tool_s") / calls if calls else 0.0)


def section(pairs: list[Pair], provenance: str, figures: str) -> str:
    rows = []
    for p in pairs:
        per_response, per_call = _calls(p.boost)
        rows.append([p.workload, p.trace, f"{1 + per_response:.2f}", f"{per_call:.2f}",
                     f"{p.base.step_s:,.0f}", f"{p.boost.step_s:,.0f}",
                     f"{p.base.tokens_per_s:,.0f}", f"{p.boost.tokens_per_s:,.0f}",
                     f"{p.throughput:.2f}x", f"{p.per_dollar:.2f}x"])
    header = ["workload", "trace", "model turns/response", "s/tool call",
              "reserved-only step s", "rlboost step s", "reserved-only tokens/s",
              "rlboost tokens/s", "throughput vs reserved", "tokens/$ vs reserved"]
    table = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                       *("| " + " | ".join(r) + " |" for r in rows)])
    mean_turns = Turns().mean_turns
    return (
        "## Agentic workload: spot vs reserved-only (8B, spot:reserved 1)\n\n"
        f"**SIMULATION**; {provenance}\n\n"
        "The headline's configuration (8B, 8 reserved H100s, spot scaled to a mean of 8 GPUs, "
        "the same prices) with its reasoning workload in model turns, tool calls between them "
        "(docs/agentic.md). The distributions are ASSUMPTIONS (`sim/config.py`):\n\n"
        f"- Model turns per response: 1 + Binomial({AGENTIC_MAX_TURNS - 1}, {AGENTIC_TURN_P}), "
        f"max_turns {AGENTIC_MAX_TURNS} (1/8 one, 3/8 two, 3/8 three, 1/8 four; mean "
        f"{mean_turns:g}), the 2-4-turn tool use of issue 38's example.\n"
        "- Each turn's length: the single-turn lognormal (sigma 1.0) with its mean divided by "
        f"{mean_turns:g}, so a response's model tokens average the single-turn mean "
        "(3,584); the whole response, observations included, stays within 14,336 tokens.\n"
        f"- Tool latency per call: lognormal, median {AGENTIC_TOOL_MEDIAN_S:g} s, sigma "
        f"{AGENTIC_TOOL_SIGMA:.1f} (p90 5.4 s, p99 15.4 s), cut at max_tool_s "
        f"{AGENTIC_MAX_TOOL_S:g} s (the spec's default; 2.9 % of calls). Slow tools: median "
        f"{SLOW.tool_median_s:g} s, cut at {SLOW.max_tool_s:g} s.\n"
        f"- Observation: {AGENTIC_OBSERVATION_TOKENS} tokens per call (the spec's default "
        "max_observation_tokens), masked out of the loss: not counted as trained tokens, "
        "but prefilled with the next turn and charged to training compute.\n"
        "- Tools run on the reserved side's tool pool (CPU), every call at once (enough "
        "workers, no queue). During a call the response holds no GPU slot; its next turn is "
        "leased like any pending response and prefills its whole context there (no prefix "
        "cache is modelled, as after a migration).\n\n"
        f"![agentic vs single-turn]({figures}sim-agentic.png)\n\n" + table + "\n\n"
        + reading(pairs))


def reading(pairs: list[Pair]) -> str:
    """What the table says, from the slow-tools trace's pairs."""
    by = {(p.workload, p.trace): p for p in pairs}
    single, turns, slow = (by[w, SLOW_TRACE] for w in (SINGLE, AGENTIC, AGENTIC_SLOW))

    def more(key: str) -> float:
        return 100 * (turns.boost.mean(key) / single.boost.mean(key) - 1)

    return (
        f"Tokens/s and tokens/$ count trained (model) tokens only. On {SLOW_TRACE}, agentic "
        f"steps hold {more('tokens'):.0f} % more model tokens than single-turn ones (fewer "
        "responses reach the budget when their tokens are split in turns) and take "
        f"{more('train_s'):.0f} % more training compute (observations are in every forward "
        "and backward pass). Reserved-only trains after its rollout, so it pays that on its "
        f"path ({turns.base.mean('train_tail_s'):,.0f} s after the barrier against "
        f"{single.base.mean('train_tail_s'):,.0f} s single-turn); rlboost trains during the "
        f"spot rollout ({turns.boost.mean('train_tail_s'):,.0f} s after the barrier against "
        f"{single.boost.mean('train_tail_s'):,.0f} s), which is where its larger gain comes "
        "from. Tool time itself barely shows: a call frees its slot, the GPUs serve other "
        "turns meanwhile, and only the last responses' calls lie on the step's path (tools "
        f"{SLOW.tool_median_s / AGENTIC_TOOL_MEDIAN_S:g}x slower: rlboost "
        f"{slow.boost.step_s - turns.boost.step_s:+,.0f} s, reserved-only "
        f"{slow.base.step_s - turns.base.step_s:+,.0f} s per step).")


def plot(pairs: list[Pair], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(p.trace for p in pairs))
    workloads = list(dict.fromkeys(p.workload for p in pairs))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(workloads)
    for ax, label in ((axes[0], "throughput"), (axes[1], "trained tokens per $")):
        for k, work in enumerate(workloads):
            mine = [p for p in pairs if p.workload == work]
            xs = [traces.index(p.trace) + (k - (len(workloads) - 1) / 2) * width for p in mine]
            values: list[Any] = [p.throughput if label == "throughput" else p.per_dollar
                                 for p in mine]
            ax.bar(xs, values, width, label=work)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(traces)), traces)
        ax.set_ylabel(f"{label}, rlboost / reserved-only")
        ax.set_title(f"8B, spot:reserved 1: {label}", fontsize=10)
        ax.set_ylim(0, 1.35 * max(p.throughput if label == "throughput" else p.per_dollar
                                  for p in pairs))  # room for the legend above the bars
        ax.legend(fontsize=8, loc="upper left", ncols=3)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("SIMULATION: agentic vs single-turn responses, 2 h of each trace",
                 fontsize=11)
    fig.tight_layout()
    provenance.save(fig, path, "make bench-paper-sim")
    plt.close(fig)
