"""The version-kind rows of ``make bench-paper-sim``: full, delta and adapter versions.

SIMULATION (:mod:`sim`, version kinds as :mod:`sim.fleet` models them, with the bytes ratios
``make bench-weights`` measured: :data:`sim.config.DELTA_BYTES_RATIO`,
:data:`sim.config.ADAPTER_BYTES_RATIO`). The headline's configurations at spot:reserved 1 on
:data:`TRACES` run synchronous rlboost three ways: every pull a full version (the headline's
run); a holder of the version before pulls its delta and rebuilds it; a LoRA run's adapters over
a base that every spot image carries (a pre-seeded base directory). Each row is set against the
same configuration's full-version run and its reserved-only run. Throughput is trained tokens
per second: what LoRA changes in training compute, publish and learning per step is not
modelled, only what a spot instance pulls and loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from sim.config import (
    ADAPTER_BYTES_RATIO,
    DELTA_BYTES_RATIO,
    DELTA_REBUILD_BYTES_S,
    RESERVED_ONLY,
    RLBOOST,
    Cluster,
    Costs,
    Workload,
)
from sim.fleet import alone
from sim.outcome import Outcome, simulate

TRACES = ["p3"]  # one trace per model keeps the section to minutes (the async rows use three)
# (label, Policy.versions, Cluster.base_preseeded, the delta's rebuild rate): the last delta
# row charges no rebuild, the bound a rebuild spread over a host's cores would approach.
KINDS = [("full", "full", False, DELTA_REBUILD_BYTES_S),
         ("delta", "delta", False, DELTA_REBUILD_BYTES_S),
         ("delta, no rebuild cost", "delta", False, math.inf),
         ("adapter, pre-seeded base", "adapter", True, DELTA_REBUILD_BYTES_S)]


@dataclass(frozen=True)
class Row:
    """One configuration with one version kind, and the same configuration's baselines."""

    model: str
    trace: str
    kind: str
    join_s: float  # a spot instance alone: grant to serving
    update_s: float  # a holder alone: publish to serving the new version
    run: Outcome
    full: Outcome  # rlboost, full versions
    base: Outcome  # reserved-only

    def ratios(self, to: Outcome) -> tuple[float, float]:
        return (self.run.tokens_per_s / to.tokens_per_s,
                self.run.tokens_per_dollar() / to.tokens_per_dollar())


def simulate_rows(clusters: dict[tuple[str, str], Cluster], span_s: float,
                  fulls: dict[tuple[str, str], tuple[Outcome, Outcome]] | None = None
                  ) -> list[Row]:
    """Per (model, trace) of ``clusters`` whose trace is in :data:`TRACES`: the full-version
    pair (``fulls``' when given: the headline's own (reserved-only, rlboost) runs), then
    rlboost with each other kind of :data:`KINDS`."""
    rows = []
    for (model, trace), cluster in clusters.items():
        if trace not in TRACES:
            continue
        costs, work = Costs.paper(model), Workload.reasoning()
        base, full = (fulls or {}).get((model, trace)) or tuple(
            simulate(p, work, costs, cluster, span_s) for p in (RESERVED_ONLY, RLBOOST))
        for label, versions, seeded, rebuild in KINDS:
            kind_costs = replace(costs, delta_rebuild_bytes_s=rebuild)
            run = full if versions == "full" else simulate(
                replace(RLBOOST, name=f"rlboost, {label}", versions=versions), work,
                kind_costs, replace(cluster, base_preseeded=seeded), span_s)
            join_s, update_s = alone(kind_costs, versions, seeded)
            rows.append(Row(model, trace, label, join_s, update_s, run, full, base))
    return rows


def table(rows: list[Row]) -> str:
    header = ["model", "trace", "versions", "join s (alone)", "update s (alone)", "step s",
              "first spot token s", "tokens/s", "tokens/$", "throughput vs full",
              "tokens/$ vs full", "throughput vs reserved", "tokens/$ vs reserved"]
    lines = []
    for r in rows:
        o = r.run
        full_tps, full_tpd = r.ratios(r.full)
        base_tps, base_tpd = r.ratios(r.base)
        lines.append([r.model, r.trace, r.kind, f"{r.join_s:.1f}", f"{r.update_s:.2f}",
                      f"{o.step_s:,.0f}", f"{o.mean('spot_first_s'):,.0f}",
                      f"{o.tokens_per_s:,.0f}", f"{o.tokens_per_dollar():,.0f}",
                      f"{full_tps:.3f}x", f"{full_tpd:.3f}x", f"{base_tps:.2f}x",
                      f"{base_tpd:.2f}x"])
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                      *("| " + " | ".join(x) + " |" for x in lines)])


def section(rows: list[Row], provenance: str) -> str:
    gains = {k[0]: [r.ratios(r.full)[0] for r in rows if r.kind == k[0]] for k in KINDS[1:]}
    spans = "; ".join(f"{k} {min(v):.3f}\u2013{max(v):.3f}x" for k, v in gains.items())
    c8 = Costs.paper("emu-8b")
    return (
        "## Version kinds: full, delta and adapter pulls (spot:reserved 1)\n\n"
        f"**SIMULATION**; {provenance}\n\n"
        "What a spot instance pulls when it joins and after each update (issue 40, "
        "`sim/fleet.py`). *full*: the whole bf16 version every time (the headline's runs). "
        "*delta*: a joiner holds no version and pulls in full; a holder of version n\u22121 "
        f"pulls the delta, {100 * DELTA_BYTES_RATIO:.1f} % of the version's bytes, then "
        f"rebuilds the version at {DELTA_REBUILD_BYTES_S / 1e9:.2f} GB/s (one thread, as "
        "the pull does it today) before loading it whole; *delta, no rebuild cost* charges "
        "none, the bound a rebuild spread over a host's cores would approach. *adapter, "
        "pre-seeded base*: a LoRA run whose spot images carry the base model; every pull, the "
        "first included, is the "
        f"adapter, {100 * ADAPTER_BYTES_RATIO:.2f} % of the version's bytes, and only the first "
        "load moves the base into HBM. Without a pre-seeded base an adapter joiner pulls the "
        "base and the adapter once, as a full joiner does, then adapters only. Both ratios are "
        "`make bench-weights`' measurements on a 45 M-parameter Qwen2-shaped model (`sim/"
        "config.py`); an adapter's share of an 8B\u201332B model is smaller still, a delta's "
        "depends on the learning rate.\n\n"
        "*join s (alone)* is one spot instance alone with the weight service, from its grant "
        "to serving: boot and engine start "
        f"({c8.spot_start_s:.0f} s) dominate it; *update s (alone)* from a publish to serving "
        "the new version. In the runs pulls share the weight service's 12.5 GB/s (and the "
        "peers') with every other instance pulling. Ratios are against the same trace's "
        "full-version rlboost run and its reserved-only run.\n\n" + table(rows) + "\n\n"
        f"Against full versions, throughput: {spans}; tokens per dollar moves with it (the "
        "trace decides the spot capacity billed).")
