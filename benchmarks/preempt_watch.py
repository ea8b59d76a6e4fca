"""What each preemption of ``make bench-preempt`` cost, from what the services send each other.

A :class:`Watch` subscribes to the bus beside the services (its own connection, thread and
event loop) and records, with the time each reached it: every command the manager sends an
instance (``Assign``: request id, lease epoch, prompt and committed token counts; ``Revoke``),
every token frame an instance publishes (request id, epoch, the offset it reaches, final), and
every heartbeat (per held response: tokens published and generated but not yet published, as
the manager records them, ``Held``). The bench adds the time and kind of each signal it sends.
:func:`preemptions` replays that record in time order. A response is *moved* by a preemption
when its holder at the signal (or an instance assigned it after the signal, before the manager
knew) is leased it no more and another instance is: per moved response,

- **hand-on s**: from the signal (or its assignment to the victim, if later) to its ``Assign``
  to the next instance: how long the victim's work stood still. A hard kill waits for the
  instance's TTL and the reaper; a notice for the hand-back and the manager's commit wait.
  A response the manager leases to the victim again after the signal (it does not know yet
  that the instance left or died: *relet*) stays the victim's until another instance gets it.
- **regenerated tokens**: the victim's generated extent (the furthest of its frames and
  heartbeats reached) less the tokens committed at the hand-on (the next owner starts there):
  tokens decoded twice. Tokens generated after the victim's last frame and last heartbeat are
  recorded nowhere, and not counted (under one flush interval of them: frames go every
  RLBOOST_CHUNK_TOKENS tokens).
- **re-prefill tokens**: prompt + committed tokens of the next ``Assign``, the context the
  next owner prefills before its first token; the victim had prefilled or decoded all of it.
- **lost GPU-s**, the victim's GPU time thrown away or idle, with its GPU shared equally by
  the responses it held (the emu engine's decode step advances each of them by one token):
  *thrown* is, for each moved response, the victim's GPU time since the last frame of it that
  the next owner keeps (its committed prefix; with none, since the victim's lease of it), up
  to the signal, integrated over the victim's batch as the record gives it (a share of
  1/batch a second); *idle* is its share at the signal (1/batch) times its hand-on s. Times
  are wall clock on the emu engine at time scale 1: its modelled GPU time plus whatever the
  host adds on this machine. Multiplied by the GPUs of one instance of the emu model (1 at 8B).

Nothing here adds to a service; the figures are what the manager and the instances send.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import nats

from shared import names
from shared import protocol as wire

Event = tuple[float, str, str, Any]  # (arrival time, kind, instance id, what it carried)


class Watch:
    """Assignments, frames and heartbeats as they cross the bus, and the bench's signals."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.events: list[Event] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(30):
            raise TimeoutError("the bus watch did not subscribe in 30 s")

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread.is_alive():
            self._thread.join(30)

    def signal(self, instance_id: str, name: str) -> None:
        """The bench is about to send ``name`` to ``instance_id``."""
        self.events.append((time.time(), "signal", instance_id, name))

    def _run(self) -> None:
        self._loop.run_until_complete(self._watch())

    async def _watch(self) -> None:
        self._stop = asyncio.Event()
        nc = await nats.connect(self.url)

        async def on_command(msg: Any) -> None:
            cmd, t = wire.decode_command(msg.data), time.time()
            inst = names.subject_owner(msg.subject)[0]
            if isinstance(cmd, wire.Assign):
                self.events.append((t, "assign", inst, [
                    (a.request_id, a.epoch, len(a.prompt_token_ids), len(a.committed_token_ids))
                    for a in cmd.items]))
            elif not cmd.flush:  # a flush (seeding hand-off) leaves the leases in place
                self.events.append((t, "revoke", inst, list(cmd.request_ids)))

        async def on_frame(msg: Any) -> None:
            frame, t = wire.decode(msg.data, wire.TokenFrame), time.time()
            self.events.append((t, "frame", frame.instance_id, [
                (e.request_id, e.epoch, e.offset + e.n_tokens, e.final) for e in frame.entries]))

        async def on_beat(msg: Any) -> None:
            beat, t = wire.decode(msg.data, wire.Heartbeat), time.time()
            self.events.append((t, "beat", beat.instance_id, [
                (h.request_id, h.epoch, h.published + h.buffered) for h in beat.held]))
        # Instance subjects end in the instance's key fingerprint: any of them, by its id.
        await nc.subscribe(f"{names.PREFIX}.inst.assign.>", cb=on_command)
        await nc.subscribe(names.CHUNK_WILDCARD, cb=on_frame)
        await nc.subscribe(names.HEARTBEAT_ANY, cb=on_beat)
        await nc.flush()
        self._ready.set()
        await self._stop.wait()
        await nc.close()


@dataclass
class Moved:
    hand_on_s: float
    regenerated: int
    reprefill: int
    thrown_gpu_s: float  # the victim's GPU share spent on what the next owner does again


@dataclass
class Preemption:
    instance: str
    signal: str  # SIGTERM: a notice; SIGKILL: a hard kill
    at: float
    held: int  # responses the instance held at the signal
    gpus: int = 1  # of one instance
    moved: list[Moved] = field(default_factory=list)
    relet: int = 0  # responses leased to it again after the signal

    def idle_gpu_s(self) -> float:
        share = self.gpus / max(self.held, len(self.moved), 1)
        return share * sum(m.hand_on_s for m in self.moved)

    def lost_gpu_s(self) -> float:
        return self.idle_gpu_s() + sum(m.thrown_gpu_s for m in self.moved)


@dataclass
class _Lease:
    instance: str
    epoch: int
    since: float
    extent: int  # generated extent recorded: frames and heartbeats
    kept: list[tuple[float, int]] = field(default_factory=list)  # (frame time, offset reached)
    revoked: float | None = None


class _Batches:
    """Each instance's held responses over time, as the record gives them."""

    def __init__(self) -> None:
        self.held: dict[str, set[str]] = defaultdict(set)
        self.steps: dict[str, list[tuple[float, int]]] = defaultdict(list)

    def add(self, inst: str, rid: str, t: float) -> None:
        self.held[inst].add(rid)
        self.steps[inst].append((t, len(self.held[inst])))

    def drop(self, inst: str, rid: str, t: float) -> None:
        if rid in self.held[inst]:
            self.held[inst].discard(rid)
            self.steps[inst].append((t, len(self.held[inst])))

    def share_s(self, inst: str, start: float, end: float) -> float:
        """Integral of 1/batch over [start, end): one response's share of the GPU."""
        total, steps = 0.0, self.steps[inst]
        for i, (t, n) in enumerate(steps):
            t_next = steps[i + 1][0] if i + 1 < len(steps) else end
            lo, hi = max(t, start), min(t_next, end)
            if hi > lo and n > 0:
                total += (hi - lo) / n
        return total


def preemptions(events: list[Event], gpus: int = 1) -> list[Preemption]:
    """Replay the record (see the module's docstring): each signal's preemption and what it
    moved. ``gpus``: GPUs of one instance, which lost GPU-seconds are multiplied by."""
    leases: dict[str, _Lease] = {}
    batches = _Batches()
    down: dict[str, Preemption] = {}
    out: list[Preemption] = []
    for t, kind, inst, data in sorted(events, key=lambda e: e[0]):
        if kind == "signal":
            down[inst] = Preemption(inst, data, t, len(batches.held[inst]), gpus)
            out.append(down[inst])
        elif kind == "assign":
            for rid, epoch, prompt, committed in data:
                prev = leases.get(rid)
                if inst in down:  # leased to it after its signal: the manager does not know yet
                    down[inst].relet += 1
                    if prev is not None and prev.instance == inst:
                        prev.epoch = epoch  # still its work, still standing still
                        continue
                if prev is not None and prev.instance != inst:
                    p = down.get(prev.instance)
                    if p is not None and (prev.revoked is None or prev.revoked >= p.at):
                        p.moved.append(_moved(p, prev, batches, t, prompt, committed, gpus))
                    batches.drop(prev.instance, rid, t)
                leases[rid] = _Lease(inst, epoch, t, committed)
                batches.add(inst, rid, t)
        elif kind == "revoke":
            for rid in data:
                lease = leases.get(rid)
                if lease is not None and lease.instance == inst:
                    lease.revoked = t
                    batches.drop(inst, rid, t)
        else:  # a frame or a heartbeat of ``inst``
            for rid, epoch, reached, *final in data:
                lease = leases.get(rid)
                if lease is None or lease.instance != inst or lease.epoch != epoch:
                    continue
                lease.extent = max(lease.extent, reached)
                if kind == "frame":
                    lease.kept.append((t, reached))
                    if final[0]:
                        del leases[rid]
                        batches.drop(inst, rid, t)
    return out


def _moved(p: Preemption, lease: _Lease, batches: _Batches, t: float, prompt: int,
           committed: int, gpus: int) -> Moved:
    # The victim's last frame of it that the next owner keeps; with none, its lease's start.
    kept = max((at for at, reached in lease.kept if reached <= committed), default=lease.since)
    start = min(max(kept, lease.since), p.at)
    return Moved(hand_on_s=t - max(p.at, lease.since),
                 regenerated=max(0, lease.extent - committed), reprefill=prompt + committed,
                 thrown_gpu_s=gpus * batches.share_s(lease.instance, start, p.at))
