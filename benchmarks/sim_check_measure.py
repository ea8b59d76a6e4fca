"""What ``make bench-sim-check`` reads off an emulated run, and its statistics.

Time compression magnifies every wall second the emulation's hosts spend (two shared cores
running a dozen services): at 40x, 25 ms of Python is a modelled second. What they cost is
measured on each run, component by component, from the components' own clocks and logs, and
charged in the simulator beside the hardware model (:class:`~benchmarks.sim_check_regime.
HostCosts`); none is taken from a step's length or a policy's throughput, the figures the check
compares:

* engines: host time per decode step, and how long a slot freed with work waiting stays empty
  (the control plane's round trip), as each engine's meters log them
  (:mod:`rollout_svc.engines.emu_meters`);
* trainer: its busy time (the step record's ``train_s``) beyond what its compute model sleeps
  for the tokens it trained, per modelled token;
* report: the part of a step outside the trainer's clock (``step_s - train_s -
  trainer_idle_s``), the finish report's way to the manager; and the manager's time from a
  step's end to the next one's start;
* reserved update: from a step's start until the reserved instances log that they hold its
  version;
* spot join: from the trace player's grant until a joiner logs its first version, less the
  modelled boot and its pull and load alone on the link.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.sim_check_regime import HostCosts, Regime
from rollout_svc.engines.emu_models import response_length
from trainer_svc.learn.compute_model import PRESETS

HOST_LINE = re.compile(r"emu host time ([\d.]+) ms per decode step over (\d+) steps")
REFILL_LINE = re.compile(r"emu refill wait ([\d.]+) ms over (\d+) refills")
LOADED_LINE = re.compile(r"^(\S+ \S+) .* rollout: loaded \S+ v(\d+)", re.MULTILINE)
# Two-sided 95 % Student t quantiles by degrees of freedom (beyond the table: the normal's).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
       9: 2.262, 10: 2.228}


def measured_host(logs: Path) -> dict[str, float]:
    """The engines' logged host seconds per decode step (emulated), by kind of instance,
    weighted by steps."""
    sums: dict[str, list[float]] = {}
    for path in logs.glob("*.log"):
        kind = path.stem.split("-")[0]
        if kind not in ("reserved", "spot"):
            continue
        for ms, steps in HOST_LINE.findall(path.read_text(errors="replace")):
            total = sums.setdefault(kind, [0.0, 0.0])
            total[0] += float(ms) / 1e3 * int(steps)
            total[1] += int(steps)
    return {kind: s / n for kind, (s, n) in sums.items() if n}


def engine_mean(logs: Path, line: re.Pattern[str]) -> float:
    """The engines' logged mean (``line``: emulated ms over a count), in seconds, over every
    engine's lines weighted by their counts."""
    total = seconds = 0.0
    for path in logs.glob("*.log"):
        if path.stem.split("-")[0] in ("reserved", "spot"):
            for ms, count in line.findall(path.read_text(errors="replace")):
                seconds += float(ms) / 1e3 * int(count)
                total += int(count)
    return seconds / total if total else 0.0


def log_time(stamp: str) -> float:
    """A log line's local timestamp (shared.logs' format) as epoch seconds."""
    return dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def loaded(path: Path) -> dict[int, list[float]]:
    """When the instances logging to ``path`` came to hold each version, in log order."""
    out: dict[int, list[float]] = {}
    for stamp, version in LOADED_LINE.findall(path.read_text(errors="replace")):
        out.setdefault(int(version), []).append(log_time(stamp))
    return out


def reserved_update_s(logs: Path, records: Sequence[dict[str, Any]], instances: int,
                      scale: float) -> float:
    """Mean emulated seconds from a measured step's start until a reserved instance holds
    the step's version for the last time before the step's barrier (a heartbeat naming the
    step before can make it swap back and forth; the trainer's publish of the next version
    comes after the barrier). Step ``n`` runs on version ``n``; 0 for a version swapped in
    before the step began."""
    times = loaded(logs / "reserved.log")
    waits = []
    for r in records:
        start = float(r["started_at"])
        barrier = start + float(r["rollout_s"])
        during = [t for t in times.get(int(r["step"]), []) if t <= barrier]
        waits += [max(0.0, t - start) / scale for t in during[-instances:]]
    return statistics.fmean(waits) if waits else 0.0


def spawned(history: Sequence[tuple[float, int]]) -> dict[str, float]:
    """The trace player's processes by name (``spot-t<serial>``) and wall time of their
    grant, from its history of counts (each rise starts the next serials)."""
    out: dict[str, float] = {}
    serial = alive = 0
    for at, count in history:
        for _ in range(max(0, count - alive)):
            serial += 1
            out[f"spot-t{serial}"] = at
        alive = count
    return out


def spot_join_s(logs: Path, history: Sequence[tuple[float, int]], begin: float,
                deadline: float, scale: float, modelled_s: float) -> float:
    """Mean emulated seconds from the grant of a spot instance started inside the measured
    window until it held its first version, less ``modelled_s`` (boot, engine start, a pull
    and a load alone): what joining costs the emulation's hosts."""
    extra = []
    for name, granted in spawned(history).items():
        path = logs / f"{name}.log"
        if not begin <= granted < deadline or not path.is_file():
            continue
        first = min((t for ts in loaded(path).values() for t in ts), default=None)
        if first is not None:
            extra.append((first - granted) / scale - modelled_s)
    return max(0.0, statistics.fmean(extra)) if extra else 0.0


def trainer_s_per_token(steps: Sequence[dict[str, Any]], regime: Regime) -> float:
    """The trainer's busy seconds per trained token beyond its compute model (emulated):
    ``train_s`` of every step against what the emu policy sleeps for it (each response token
    counts ``token_scale``, each prompt token one; then the optimizer step and the
    publish)."""
    compute = PRESETS[regime.model]
    publish = regime.setup(0).publish_s
    responses = regime.prompts * regime.samples
    tokens = sum(int(s["tokens"]) * regime.token_scale + responses * regime.prompt_tokens
                 for s in steps)
    modelled = tokens * compute.seconds_per_token \
        + len(steps) * (compute.optimizer_step_s + publish)
    busy = sum(float(s["train_s"]) for s in steps)
    return max(0.0, busy - modelled) / tokens if tokens else 0.0


def report_s(steps: Sequence[dict[str, Any]]) -> float:
    """Mean time of a step outside the trainer's clock (emulated seconds)."""
    outside = [float(s["step_s"]) - float(s["train_s"]) - float(s["trainer_idle_s"])
               for s in steps]
    return max(0.0, statistics.fmean(outside)) if outside else 0.0


def between_s(records: Sequence[dict[str, Any]], scale: float) -> float:
    """Mean emulated seconds from a step's end to the next one's start, over consecutive
    steps of the run (wall-clock records)."""
    by_step = {int(r["step"]): r for r in records}
    gaps = [(float(by_step[n + 1]["started_at"]) - float(r["finished_at"])) / scale
            for n, r in by_step.items() if n + 1 in by_step]
    return max(0.0, statistics.fmean(gaps)) if gaps else 0.0


def measure(regime: Regime, logs: Path, records: Sequence[dict[str, Any]],
            steps: Sequence[dict[str, Any]], history: Sequence[tuple[float, int]],
            begin: float, deadline: float) -> HostCosts:
    """Every host cost of one emulated run: ``records`` are its measured steps as the manager
    wrote them (wall clock), ``steps`` the same in emulated seconds."""
    scale = regime.time_scale
    boot = regime.setup(0).start_s
    return HostCosts(
        step_s=engine_mean(logs, HOST_LINE),
        trainer_s_per_token=trainer_s_per_token(steps, regime),
        report_s=report_s(steps),
        between_s=between_s(records, scale),
        control_s=engine_mean(logs, REFILL_LINE),
        reserved_update_s=reserved_update_s(
            logs, records, max(1, regime.reserved_gpus // regime.serving.gpus), scale),
        spot_join_s=spot_join_s(logs, history, begin, deadline, scale,
                                boot + regime.pull_alone_s()))


def modelled_tokens(regime: Regime, seed: int, step: int) -> tuple[int, int]:
    """A step's response tokens as modelled, and as the emu engine emits them (a response of
    L modelled tokens is ceil(L / token_scale) tokens): the engine's length draws, keyed by
    the step's version (step ``step`` runs on version ``step``)."""
    w, m = regime.workload(seed), regime.token_scale
    total = emitted = 0
    for p in range(w.prompts):
        for s in range(w.samples):
            n = response_length(seed, step, p, s, step, w.mean_tokens, w.sigma,
                                w.max_new_tokens)
            total += n
            emitted += math.ceil(n / m)
    return total, emitted


def interval(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its two-sided 95 % Student t interval (0 for one value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    t = T95.get(len(values) - 1, 1.96)
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))
