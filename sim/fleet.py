"""The rollout fleet: reserved instances, spot instances following a trace, weight pulls.

SIMULATION. Spot instances appear when the trace's count rises (billed from then, usable after
boot + engine start), pull the current version over the weight service's link, shared by every
pull in flight (plus what peers that hold the version serve), then load it into HBM.

What a pull moves follows ``versions`` (:data:`sim.config.VERSION_KINDS`): ``full``, the whole
version every time; ``delta``, the delta's bytes (``Costs.delta_ratio``) when the instance holds
the version before, then the rebuild (``Costs.delta_rebuild_bytes_s``) before the full load, and
the full version otherwise; ``adapter``, the adapter's bytes (``Costs.adapter_ratio``) and its
load alone once the instance holds the base (any earlier version, or ``base_preseeded``: it came
in the image, though the first load still moves the base into HBM), the base and the adapter
before that. Peers serve every kind at the same rate (the real service serves a delta only
itself: at a few percent of a version's bytes the difference is small). In an
asynchronous run (``publish(..., keep_serving=True)``) a ready instance pulls in the background
and generates on its old version meanwhile; only the load pauses its engine (``on_swap``). When the
count falls, victims drawn with a seeded generator get a notice: they stop, hand their
responses back, and stay billed through the grace period; or, for a share of them
(``hard_kill_share``, its own seeded draw), die at once: billing stops, nothing is handed back
(``on_kill``: the manager finds out when the leases expire).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from sim.config import Costs
from sim.engine import Instance
from sim.events import EventQueue


@dataclass
class Pull:
    inst: Instance
    version: int
    left: float  # bytes
    after_s: float  # from the last byte until the engine serves the version: rebuild and load
    load_s: float  # the part of after_s that stops a serving engine (the load)


@dataclass
class Fleet:
    clock: EventQueue
    costs: Costs
    on_ready: Callable[[Instance], None]  # an instance holds the current version
    on_notice: Callable[[Instance], None]  # an instance is leaving: take its work back
    seed: int = 0
    versions: str = "full"  # what a holder of a version pulls for the next (module doc)
    base_preseeded: bool = False  # adapter versions: a joiner's image holds the base
    on_change: Callable[[], None] | None = None  # the registered spot count may have moved
    on_kill: Callable[[Instance], None] | None = None  # a hard kill: no notice, no hand-back
    hard_kill_share: float = 0.0
    spot_speed: float = 1.0  # spot instances' speed relative to the serving model's
    spot_batch: int = 0  # spot instances' running sequences (0: Costs.max_batch)
    # A ready instance's background pull is done: its engine stops for the load (seconds).
    on_swap: Callable[[Instance, float], None] | None = None
    instances: list[Instance] = field(default_factory=list)
    version: int = 0  # the newest published version
    _pulls: list[Pull] = field(default_factory=list)
    _pull_serial: int = 0
    _pull_at: float = 0.0
    _serial: int = 0
    _background: set[str] = field(default_factory=set)  # ids pulling while they serve

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        # Notice or hard kill: a stream of its own, so victims are the same at every share.
        self._kill_rng = random.Random(f"kill:{self.seed}")

    # --- membership -------------------------------------------------------------------------

    def add_reserved(self, count: int) -> None:
        for n in range(count):
            inst = Instance(f"reserved-{n}", "reserved", self.costs.max_batch, 0.0,
                            state="ready", version=0)
            self.instances.append(inst)

    def spot(self, alive_only: bool = True) -> list[Instance]:
        return [i for i in self.instances if i.kind == "spot" and (
            i.state in ("booting", "loading", "ready") if alive_only else i.state != "gone")]

    def set_spot(self, count: int, warm: bool = False) -> None:
        """Follow the trace: start or notice spot instances until ``count`` are alive.
        ``warm``: the new ones are up and hold the current version at once (the state a
        measurement starts from)."""
        alive = self.spot()
        while len(alive) > count:
            victim = alive.pop(self._rng.randrange(len(alive)))
            if self._kill_rng.random() < self.hard_kill_share:
                self._kill(victim)
            else:
                self._leave(victim)
        for _ in range(count - len(alive)):
            self._serial += 1
            inst = Instance(f"spot-{self._serial}", "spot",
                            self.spot_batch or self.costs.max_batch, self.clock.now,
                            billed_from=self.clock.now, speed=self.spot_speed)
            self.instances.append(inst)
            if warm:
                inst.state, inst.version = "ready", self.version
                self.on_ready(inst)
            else:
                self.clock.after(self.costs.spot_start_s, partial(self._booted, inst))
        if self.on_change is not None:
            self.on_change()

    def _booted(self, inst: Instance) -> None:
        if inst.state != "booting":
            return
        inst.state = "loading"
        inst.joined_at = self.clock.now  # registers now: mid-step joins count from here
        self._start_pull(inst)
        if self.on_change is not None:
            self.on_change()

    def _leave(self, inst: Instance) -> None:
        was = inst.state
        inst.state = "draining" if was in ("ready", "loading") else "gone"
        inst.billed_to = self.clock.now + self.costs.grace_s
        self._pulls = [p for p in self._pulls if p.inst is not inst]
        if was == "ready":
            self.on_notice(inst)
        self.clock.after(0.0, partial(self._gone, inst))

    def _kill(self, inst: Instance) -> None:
        was = inst.state
        inst.state, inst.billed_to = "gone", self.clock.now
        self._pulls = [p for p in self._pulls if p.inst is not inst]
        self._background.discard(inst.id)
        if was == "ready" and self.on_kill is not None:
            self.on_kill(inst)

    def _gone(self, inst: Instance) -> None:
        inst.state = "gone"

    # --- versions and pulls -----------------------------------------------------------------

    def publish(self, version: int, keep_serving: bool = False) -> None:
        """A new version exists: the reserved side swaps it in device memory, every spot
        instance pulls it; with ``keep_serving`` a ready one goes on generating meanwhile."""
        self.version = version
        for inst in self.instances:
            if inst.kind == "reserved":
                inst.state = "loading"
                self.clock.after(self.costs.serving.swap_s, partial(self._loaded, inst, version))
            elif keep_serving and inst.state == "ready":
                self._background.add(inst.id)
                self._start_pull(inst)
            elif inst.state in ("ready", "loading"):
                inst.state = "loading"
                self._start_pull(inst)

    def _start_pull(self, inst: Instance) -> None:
        self._settle_pulls()
        self._pulls = [p for p in self._pulls if p.inst is not inst]
        if self.costs.weight_bytes <= 0:
            self._pulled(inst, self.version, self.costs.load_s, self.costs.load_s)
            return
        self._pulls.append(self._pull(inst, self.version))
        self._schedule_pulls()

    def _pull(self, inst: Instance, version: int) -> Pull:
        """What ``inst`` pulls for ``version``, by version kind (module doc)."""
        c, holds = self.costs, inst.version >= 0  # a joiner holds no version yet
        if self.versions == "delta" and holds and inst.version == version - 1:
            rebuild_s = c.weight_bytes / c.delta_rebuild_bytes_s
            return Pull(inst, version, c.delta_ratio * c.weight_bytes, rebuild_s + c.load_s,
                        c.load_s)
        if self.versions == "adapter" and (holds or self.base_preseeded):
            load_s = c.load_s if not holds else c.adapter_ratio * c.load_s
            return Pull(inst, version, c.adapter_ratio * c.weight_bytes, load_s, load_s)
        size = c.weight_bytes * (1 + c.adapter_ratio if self.versions == "adapter" else 1)
        return Pull(inst, version, size, c.load_s, c.load_s)

    def _rates(self) -> float:
        """Bytes/s each pull in flight gets: the link and the peers' share, split evenly,
        at most one link each."""
        holders = sum(1 for i in self.spot() if i.version == self.version and i.state == "ready")
        total = self.costs.egress_bytes_s + self.costs.peer_bytes_s * holders
        return min(self.costs.egress_bytes_s, total / max(1, len(self._pulls)))

    def _settle_pulls(self) -> None:
        moved = (self.clock.now - self._pull_at) * self._rates() if self._pulls else 0.0
        self._pull_at = self.clock.now
        for p in self._pulls:
            p.left -= moved

    def _schedule_pulls(self) -> None:
        self._pull_serial += 1
        if not self._pulls:
            return
        serial = self._pull_serial
        first = min(p.left for p in self._pulls)
        self.clock.after(max(0.0, first) / self._rates(), partial(self._pull_tick, serial))

    def _pull_tick(self, serial: int) -> None:
        if serial != self._pull_serial:
            return
        self._settle_pulls()
        done = [p for p in self._pulls if p.left <= 1.0]
        self._pulls = [p for p in self._pulls if p.left > 1.0]
        for p in done:
            self._pulled(p.inst, p.version, p.after_s, p.load_s)
        self._schedule_pulls()

    def _pulled(self, inst: Instance, version: int, after_s: float, load_s: float) -> None:
        # The load is scheduled first: at its end the version is in place before the paused
        # engine's next segment begins (an event at the same instant runs in schedule order).
        self.clock.after(after_s, partial(self._loaded, inst, version))
        if after_s > load_s:  # a rebuild first: the engine serves on until the load
            self.clock.after(after_s - load_s, partial(self._swap, inst, version, load_s))
        else:
            self._swap(inst, version, load_s)

    def _swap(self, inst: Instance, version: int, load_s: float) -> None:
        if inst.id in self._background and inst.state == "ready" and self.on_swap is not None \
                and version == self.version:  # not when a newer version's pull replaced it
            self.on_swap(inst, load_s)

    def _loaded(self, inst: Instance, version: int) -> None:
        serving = inst.state == "ready" and inst.id in self._background
        if not (inst.state == "loading" or serving) or version != self.version:
            return  # left meanwhile, or a newer version is on its way
        self._background.discard(inst.id)
        inst.state, inst.version = "ready", version
        self._settle_pulls()  # a new holder serves peers from now on
        self._schedule_pulls()
        self.on_ready(inst)

    # --- billing ----------------------------------------------------------------------------

    def spot_instance_s(self, start: float, end: float) -> float:
        """Spot instance-seconds billed in [start, end]: from grant to notice + grace."""
        total = 0.0
        for i in self.instances:
            if i.kind != "spot":
                continue
            hi = end if i.billed_to is None else min(end, i.billed_to)
            total += max(0.0, hi - max(start, i.billed_from))
        return total


def alone(costs: Costs, versions: str = "full", base_preseeded: bool = False,
          skip: int = 0) -> tuple[float, float]:
    """One spot instance alone with the weight service: seconds from its grant until it holds
    version 0 (boot, engine start, its first pull and load), and from the publish of version
    ``1 + skip`` until it holds that one (its pull, any rebuild, its load)."""
    clock, ready = EventQueue(), []
    fleet = Fleet(clock, costs, lambda i: ready.append(clock.now), lambda i: None,
                  versions=versions, base_preseeded=base_preseeded)
    fleet.set_spot(1)
    clock.run_until(math.inf, lambda: len(ready) == 1)
    published = clock.now
    fleet.publish(1 + skip)
    clock.run_until(math.inf, lambda: len(ready) == 2)
    return ready[0], ready[1] - published
