"""The fault campaign's engine faults: new instances whose engine hangs or slows once serving.

Contract: :meth:`EngineFaults.launch` starts a spot instance (as a join does) whose emu engine,
a random short time after its first decode step, hangs (``RLBOOST_EMU_STALL_AFTER_S``: no more
tokens, the decode-step count stops, heartbeats go on) or slows 100-10,000x
(``RLBOOST_EMU_SLOW_AFTER_S``, ``RLBOOST_EMU_SLOW_FACTOR``). A thread of its own polls
``GET /v1/instances`` (the injector's loop can sit in a link fault for seconds). Such a fault
counts only once it hit work: the instance was seen holding responses after the latest moment
the fault can have begun (its first decode step is seen on a poll, so it happened after the
poll before). For a hang it then times how long until the instance's work was taken back,
measured from the earliest moment the hung engine can have held it (the hang's earliest start,
or the last poll that saw it idle, whichever is later; so never less than it was): the
part of a step's extra time the manager's progress check is responsible for. Each instance is
stopped a while after its fault resolves, so the hung and the slow do not pile up.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlboost.launcher import Child, Cluster

GIVE_UP_S = 45.0  # a fault instance that found no work this long after its start hit nothing
RETIRE_S = 8.0  # how long after its fault resolved an instance is stopped
POLL_S = 0.25


@dataclass(slots=True)
class Watched:
    kind: str  # "hang" | "slow"
    child: Child
    delay_s: float  # seconds after its first decode step that the fault begins
    started: float  # wall clock of the launch
    polled: float  # wall clock of the last poll that saw it without decode steps
    earliest: float | None = None  # the earliest the fault can have begun
    latest: float | None = None  # the latest the fault can have begun
    idle_seen: float = 0.0  # the last poll that saw it hold nothing (before the hit)
    hit_at: float | None = None  # first poll after ``latest`` that saw it holding work
    # hang: from when the hung engine can first have held work (the later of ``earliest`` and
    # ``idle_seen``) until its work was taken back
    moved_s: float | None = None
    retire_at: float | None = None


class EngineFaults:
    def __init__(self, cluster: Cluster, rng: random.Random,
                 instances: Callable[[], list[dict[str, Any]]],
                 on_hit: Callable[[str, float], None]) -> None:
        self.cluster = cluster
        self.rng = rng
        self.instances = instances  # GET /v1/instances ([] when unanswered)
        self.on_hit = on_hit  # (kind, wall clock): a fault that hit work
        self.watched: list[Watched] = []
        self.hangs: list[Watched] = []  # hangs that hit work, for their timings
        self.missed: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def launch(self, kind: str, name: str) -> None:
        delay = self.rng.uniform(0.2, 2.0)
        extra = {"RLBOOST_EMU_STALL_AFTER_S": f"{delay:.2f}"} if kind == "hang" else {
            "RLBOOST_EMU_SLOW_AFTER_S": f"{delay:.2f}",
            "RLBOOST_EMU_SLOW_FACTOR": f"{10 ** self.rng.uniform(2, 4):.0f}"}
        child = self.cluster.add_instance("spot", name, extra)
        now = time.time()
        with self._lock:
            self.watched.append(Watched(kind, child, delay, now, now))

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            rows = self.instances()
            if rows:  # no answer (a manager restarting) tells nothing
                self._poll({str(r["id"]): r for r in rows}, time.time())

    def _poll(self, rows: dict[str, dict[str, Any]], now: float) -> None:
        with self._lock:
            for w in list(self.watched):
                row = rows.get(w.child.name)
                if (w.retire_at is not None and now >= w.retire_at) or not w.child.alive():
                    self._retire(w)
                elif w.latest is None:
                    if row is not None and int(row.get("decode_steps", 0)) > 0:
                        w.earliest, w.latest = w.polled + w.delay_s, now + w.delay_s
                    elif now - w.started > GIVE_UP_S:
                        self._retire(w)
                    w.polled = now
                elif w.hit_at is None:
                    if row is not None and row["held"] == 0:
                        w.idle_seen = now
                    if now >= w.latest and row is not None and row["held"] > 0:
                        w.hit_at = now
                        self.on_hit(w.kind, now)
                        if w.kind == "hang":
                            self.hangs.append(w)
                        else:
                            w.retire_at = now + RETIRE_S
                    elif now - w.started > GIVE_UP_S:
                        self._retire(w)
                elif w.moved_s is None and (row is None or row["held"] == 0):
                    assert w.earliest is not None
                    w.moved_s = now - max(w.earliest, w.idle_seen)
                    w.retire_at = now + RETIRE_S

    def unresolved(self) -> set[str]:
        """Names of the instances whose fault has not yet hit work, or (a hang) whose work
        has not yet moved."""
        with self._lock:
            return {w.child.name for w in self.watched
                    if w.hit_at is None or (w.kind == "hang" and w.moved_s is None)}

    def on_the_way(self) -> int:
        """How many launched instances' faults have not yet hit work (nor missed it)."""
        with self._lock:
            return sum(w.hit_at is None for w in self.watched)

    def _retire(self, w: Watched) -> None:
        if w.hit_at is None:
            self.missed[w.kind] += 1  # it never held work once faulty: no fault
        w.child.signal(signal.SIGTERM)
        self.watched.remove(w)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        with self._lock:
            for w in list(self.watched):
                self._retire(w)
