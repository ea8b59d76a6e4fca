"""Real spot-availability traces, and a player that makes real rollout processes follow one.

A trace is a step function: how many spot nodes were alive from each instant on. The player
compresses its time, scales its counts, and at every change starts rollout instance processes
(which then pull the step's weights and serve) or removes them: SIGTERM, the preemption notice
path, or SIGKILL, a hard loss. Victims are drawn with a seeded generator, so every policy in a
comparison sees the same instances leave at the same moments.
"""

from __future__ import annotations

import bisect
import csv
import datetime as dt
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rlboost.launcher import Child

TRACE_DIR = Path(__file__).parent / "traces"
FILES = {
    "p3": "bamboo-p3-trace.csv",
    "g4dn": "bamboo-g4dn-trace.csv",
    "gcp": "bamboo-gcloud-a100x1-east1b.txt",
}


@dataclass(frozen=True)
class Trace:
    name: str
    times: list[float]  # seconds from the trace's start, ascending, first is 0
    counts: list[int]  # nodes alive from times[i] until times[i + 1]
    length_s: float

    def count_at(self, t: float) -> int:
        return self.counts[max(0, bisect.bisect_right(self.times, t) - 1)]

    def segment(self, start_s: float, length_s: float) -> Trace:
        """The part from ``start_s`` on, re-based to 0 (the count at ``start_s`` holds at 0)."""
        if not 0 <= start_s < self.length_s or length_s <= 0:
            raise ValueError(f"segment {start_s}+{length_s}s outside {self.name} "
                             f"({self.length_s:.0f}s)")
        times, counts = [0.0], [self.count_at(start_s)]
        for t, c in zip(self.times, self.counts, strict=True):
            if start_s < t < start_s + length_s and c != counts[-1]:
                times.append(t - start_s)
                counts.append(c)
        return Trace(self.name, times, counts, length_s)

    def compressed(self, time_factor: float, count_scale: float) -> Trace:
        """Time divided by ``time_factor``; counts multiplied by ``count_scale`` and rounded."""
        times: list[float] = []
        counts: list[int] = []
        for t, c in zip(self.times, self.counts, strict=True):
            scaled = round(c * count_scale)
            if not counts or scaled != counts[-1]:
                times.append(t / time_factor)
                counts.append(scaled)
        return Trace(self.name, times, counts, self.length_s / time_factor)

    def mean(self) -> float:
        """Time-weighted mean count."""
        edges = [*self.times, self.length_s]
        total = sum(c * (edges[i + 1] - edges[i]) for i, c in enumerate(self.counts))
        return total / self.length_s


def load(name: str) -> Trace:
    if name not in FILES:
        raise ValueError(f"unknown trace {name!r}; one of {', '.join(FILES)}")
    path = TRACE_DIR / FILES[name]
    points = _bamboo_events(path) if path.suffix == ".csv" else _count_series(path)
    times: list[float] = []
    counts: list[int] = []
    for t, c in points:
        if times and t == times[-1]:
            counts[-1] = c  # several events at one instant: keep the count after all of them
        elif not counts or c != counts[-1]:
            times.append(t)
            counts.append(c)
    return Trace(name, times, counts, points[-1][0])


def _bamboo_events(path: Path) -> list[tuple[float, int]]:
    alive: set[str] = set()
    points = []
    with path.open() as f:
        for ms, event, node in csv.reader(f):
            if event == "add":
                alive.add(node)
            elif event == "remove":
                alive.discard(node)
            else:
                raise ValueError(f"{path.name}: unknown event {event!r}")
            points.append((int(ms) / 1000, len(alive)))
    return points


def _count_series(path: Path) -> list[tuple[float, int]]:
    points: list[tuple[float, int]] = []
    start: dt.datetime | None = None
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        day, clock, count = (part.strip() for part in line.split(","))
        at = dt.datetime.fromisoformat(f"{day}T{clock}")
        start = start or at
        points.append(((at - start).total_seconds(), int(count)))
    return points


Removal = Literal["notice", "kill"]


@dataclass
class TracePlayer:
    """Follows ``trace`` (in emulated seconds) with real instance processes.

    ``spawn(name)`` starts one instance process; ``wall_per_s`` converts emulated seconds to
    wall seconds (the emu time scale). ``history`` records (wall time, instances running) at
    every change, for the cost model and the plot.
    """

    trace: Trace
    spawn: Callable[[str], Child]
    wall_per_s: float = 1.0
    removal: Removal = "notice"
    seed: int = 0
    history: list[tuple[float, int]] = field(default_factory=list)
    _alive: list[Child] = field(default_factory=list)
    _serial: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> float:
        """Apply the count at 0 now and follow the rest in the background; returns t0."""
        self._rng = random.Random(self.seed)
        self.t0 = time.time()
        self._thread = threading.Thread(target=self._play, name="trace", daemon=True)
        self._thread.start()
        return self.t0

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def set_count(self, count: int) -> None:
        self._alive = [c for c in self._alive if c.alive()]
        while len(self._alive) > count:
            victim = self._alive.pop(self._rng.randrange(len(self._alive)))
            victim.signal(signal.SIGTERM if self.removal == "notice" else signal.SIGKILL)
        while len(self._alive) < count:
            self._serial += 1
            self._alive.append(self.spawn(f"spot-t{self._serial}"))
        self.history.append((time.time(), count))

    def _play(self) -> None:
        base = self.t0
        while True:  # loop the trace if the run outlasts it: a slower policy sees more of it
            for t, count in zip(self.trace.times, self.trace.counts, strict=True):
                delay = base + t * self.wall_per_s - time.time()
                if self._stop.wait(max(delay, 0.0)):
                    return
                self.set_count(count)
            base += self.trace.length_s * self.wall_per_s

    def gpu_seconds(self, start: float, end: float, gpus_per_instance: int,
                    grace_s: float = 0.0) -> float:
        """Spot GPU time billed between two wall instants, in wall seconds; an instance that
        got a notice stays billed for ``grace_s`` (wall) after it."""
        total = 0.0
        for i, (at, count) in enumerate(self.history):
            nxt = self.history[i + 1][0] if i + 1 < len(self.history) else end
            lo, hi = max(at, start), min(nxt, end)
            if hi > lo:
                total += (hi - lo) * count * gpus_per_instance
            dropped = self.history[i - 1][1] - count if i else 0
            if dropped > 0 and start <= at < end:
                total += dropped * min(grace_s, end - at) * gpus_per_instance
        return total
