"""What every part of ``make bench-paper-sim`` shares: the traces' segments, the cluster a
segment makes, and the tables and page sections the parts write.

SIMULATION. :mod:`benchmarks.paper_sim` runs the parts; the parts that have a module of their
own (:mod:`benchmarks.paper_sim_robust`) import this one, not it, so nothing imports in a
circle.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.trace import load
from rollout_svc.engines.emu_models import serving_model
from sim.config import Cluster

TRACES = ["p3", "g4dn", "gcp"]
SEGMENT_START_S, SEGMENT_S = 3600.0, 7200.0  # from 1 h in (past the traces' ramp-up), 2 h
RESERVED_GPUS = 8
PAGE_BEGIN, PAGE_END = "<!-- paper-sim:begin -->", "<!-- paper-sim:end -->"


def cluster_for(trace: str, model: str, ratio: float, start: float = SEGMENT_START_S,
                reserved: int = RESERVED_GPUS, spot_gpus: int = 0) -> Cluster:
    """The trace's 2-hour segment from ``start``, scaled to a mean of ``ratio`` x 8 spot GPUs
    (the headline's reserved count, whatever ``reserved`` is), ``spot_gpus`` an instance (0:
    the model's)."""
    seg = load(trace).segment(start, SEGMENT_S)
    per_instance = spot_gpus or serving_model(model).gpus
    scaled = seg.compressed(1.0, ratio * RESERVED_GPUS / (per_instance * seg.mean()))
    return Cluster(reserved, list(scaled.times), list(scaled.counts),
                   trace_length_s=scaled.length_s, spot_gpus=spot_gpus)


def spot_mean(cluster: Cluster) -> float:
    edges = [*cluster.spot_times, cluster.trace_length_s]
    total = sum(c * (edges[i + 1] - edges[i]) for i, c in enumerate(cluster.spot_counts))
    return total / cluster.trace_length_s


def md_table(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                      *("| " + " | ".join(r) + " |" for r in rows)])


def replace_section(path: Path, body: str, begin: str = PAGE_BEGIN,
                    end: str = PAGE_END) -> None:
    text = path.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{path}: no {begin} ... {end} section to regenerate")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{body}\n{end}{tail}")
