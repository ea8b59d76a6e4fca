"""Dispatch: which instance generates which response, and when work moves.

Contract: every decision is a Redis state change through :class:`~manager_svc.accounting.Ledger`
(assign, revoke), so a restarted manager continues from what Redis says. Pending responses of
the active step go to ready instances holding the step's weight version: during a seeding window
to everyone (reserved first), after it to spot instances only (see :mod:`manager_svc.seeding`);
a fair share each, so one fast joiner does not take everything. Dead instances and expired
leases give their responses back; an instance idle for a while takes work from the busiest.

:meth:`Dispatcher.run` and :meth:`Dispatcher.dispatch_once` are the policy, top to bottom; the
Redis and NATS mechanics of each stage are the helpers beneath them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from nats.aio.client import Client as Nats

from manager_svc.accounting import Ledger
from manager_svc.crash import HANDOFF_FLUSH, HANDOFF_FREE, HANDOFF_REVOKE, CrashPoints
from manager_svc.ingest import ChunkIngest
from manager_svc.leader import Leadership
from manager_svc.metrics import ManagerMetrics
from manager_svc.placement import (
    idle_marks,
    joined_in_time,
    lease_plan,
    least_advanced,
    rebalance_move,
    spot_alive,
    spot_count,
    takers,
)
from manager_svc.registry import RELEASE_COMMIT_WAIT_S, Registry, assign_subjects
from manager_svc.runs import RunStore
from manager_svc.seeding import SeedingState, retarget
from manager_svc.soft_state import SoftState
from shared import names
from shared.config import ManagerConfig
from shared.names import Keys
from shared.process import wait_event
from shared.protocol import Assign, Assignment, Handoff, Revoke, encode

log = logging.getLogger("manager")
# Responses leased per assignment script: it holds Redis while it runs (~10 commands each), so
# a big lease goes as several calls and other clients' commands get in between them.
ASSIGN_BATCH = 256
# How long reserved instances get at a hand-off to flush their buffers and hand work back (a
# release waits up to RELEASE_COMMIT_WAIT_S for its chunks' commits) before it is revoked.
HANDOFF_FLUSH_S = RELEASE_COMMIT_WAIT_S + 1.0
# Near a step's end a lease that committed nothing for this fraction of the progress timeout
# moves to an idle instance: a healthy lease commits every chunk_tokens decode steps, far more
# often than this, and a wrong guess costs one re-prefill on an instance that was idle anyway.
BACKUP_FRACTION = 0.25

Instance = dict[str, Any]  # a row of Registry.instances()


def window_open(info: dict[str, str]) -> bool:
    """Whether the seeding window of a step (its hash ``info``) is still open."""
    return time.time() < float(info.get("window_end", 0.0))


def window_work(info: dict[str, str]) -> bool:
    """Whether a pass has seeding work on a step (its hash ``info``) even with nothing
    pending: an open adaptive window follows the spot count, and a window that closed
    without its hand-off must hand off (:meth:`Dispatcher._eligible`)."""
    mode = info.get("mode", "off")
    if mode == "off":
        return False
    if window_open(info):
        return mode == "adaptive"
    return not info.get("handoff_at")


@dataclass(frozen=True, slots=True)
class ActiveStep:
    run_id: str
    step: int
    info: dict[str, str]  # the step's Redis hash, as read at the start of this pass

    def serves(self, instance: Instance) -> bool:
        """Whether ``instance``'s weights may generate this step: its version, or in an
        asynchronous run (the step's ``staleness``) any version from the step's, the oldest
        its tokens may come from, to the step's own number (docs/async.md)."""
        version, low = int(instance["weight_version"]), int(self.info["version"])
        if int(self.info.get("staleness", 0)) > 0:
            return low <= version <= self.step
        return version == low


class Dispatcher:
    def __init__(self, cfg: ManagerConfig, redis: aioredis.Redis, nc: Nats, ledger: Ledger,
                 runs: RunStore, registry: Registry, ingest: ChunkIngest,
                 metrics: ManagerMetrics, soft: SoftState, crash: CrashPoints,
                 leader: Leadership) -> None:
        self.cfg = cfg
        self.leader = leader
        self.crash = crash
        self.redis = redis
        self.nc = nc
        self.ledger = ledger
        self.runs = runs
        self.registry = registry
        self.ingest = ingest
        self.metrics = metrics
        self.soft = soft
        self._last_reap = 0.0
        self._rebalanced: dict[str, float] = {}  # soft state: last rebalance per instance
        self._idle_since: dict[str, float] = {}  # soft state: when each instance went idle
        # Progress is judged only once this process has run for a progress timeout: a
        # restarted manager has not yet committed what the stream holds for it.
        self._started = time.monotonic()
        # Soft state: instances a backup took work from, and until when they get none (what
        # was moved off them would otherwise be leased straight back while they look ready).
        self._lagging: dict[str, float] = {}

    async def run(self) -> None:
        """The dispatch loop: one pass per wake-up, or per interval when nothing wakes it,
        while this replica holds the dispatch lease (:mod:`manager_svc.leader`)."""
        while not self.soft.stopping:
            await self._wait_for_wake()
            if not await self.leader.held():
                continue  # a standby replica: another one dispatches
            if self._reap_due():
                await self.registry.reap_dead()  # dead instances give their work back,
                await self._expire_leases()  # and so do leases nobody renewed,
                await self._check_progress()  # and hung or lagging holders
            await self.dispatch_once()

    async def dispatch_once(self) -> int:
        """Lease pending responses of the active steps to eligible instances, the step
        training waits for first; returns how many."""
        sent = 0
        for step in await self._active_steps():
            sent += await self._dispatch_step(step)
        return sent

    async def _dispatch_step(self, step: ActiveStep) -> int:
        if int(step.info.get("remaining", 1)) <= 0:
            await self.ingest.barrier(step.run_id, step.step)  # all complete: the barrier
            return 0
        if not window_work(step.info) and not await self.redis.scard(
                Keys.pending(step.run_id, step.step)):
            # Nothing to lease and no window to follow: reading every instance each pass was
            # ~10 % of the manager's time while it drained a backlog at 128 instances.
            return 0
        ready = await self._eligible(step)  # seeding window, or the hand-off at its end
        ready = [i for i in ready if self._lagging.get(i["id"], 0.0) < time.monotonic()]
        if not ready:
            return 0  # before reading what may be a big pending set
        pending = await self.redis.smembers(Keys.pending(step.run_id, step.step))
        if not pending:
            return 0
        sent, left = await self._lease_fairly(step, ready, pending)
        if not left and self.cfg.rebalance_skew:
            await self._rebalance(step, ready)  # nothing left to lease: even out holdings
        return sent

    # --- the mechanics of each stage -------------------------------------------------------

    async def _wait_for_wake(self) -> None:
        await wait_event(self.soft.wake, self.cfg.dispatch_interval_s)
        self.soft.wake.clear()

    def _reap_due(self) -> bool:
        """Reaping reads every instance and lease: not every pass, but well within a TTL."""
        if time.monotonic() - self._last_reap <= min(0.5, self.cfg.instance_ttl_s / 2):
            return False
        self._last_reap = time.monotonic()
        return True

    async def _active_steps(self) -> list[ActiveStep]:
        """The run's steps in rollout, oldest (the one training waits for) first: its step
        alone in a synchronous run; with ``staleness`` k, those of the next k that started."""
        target = await self.runs.target()
        if target is None:
            return []
        run_id, first = target
        info = await self.redis.hgetall(Keys.step(run_id, first))
        out = [ActiveStep(run_id, first, info)] if info.get("state") == "rollout" else []
        ahead = int(info.get("staleness", 0))
        if ahead:
            pipe = self.redis.pipeline(transaction=False)
            for step in range(first + 1, first + ahead + 1):
                pipe.hgetall(Keys.step(run_id, step))
            for step, later in enumerate(await pipe.execute(), start=first + 1):
                if later.get("state") == "rollout":
                    out.append(ActiveStep(run_id, step, later))
        return out

    async def _expire_leases(self) -> None:
        for active in await self._active_steps():
            await self._expire_step_leases(active)

    async def _expire_step_leases(self, active: ActiveStep) -> None:
        expired = await self.ledger.expired_leases(active.run_id, active.step)
        if expired:
            # A beat renews its instance's registration and then its leases, to the same TTL:
            # leases that expired with their holder are a dead instance's, found dead by the
            # reap just before this only if it ran a few ms later. Reaped now, the instance
            # gives them back as a preemption (counted), not as leases that lapsed one by one.
            await self.registry.reap_dead()
        for rid in expired:
            if await self.ledger.revoke(rid):
                self.metrics.revocations.labels("expired").inc()
                log.info("lease of %s expired; taken back", rid)

    async def _check_progress(self) -> None:
        """Progress, not just liveness (RLBOOST_PROGRESS_TIMEOUT_S, T), judged at a bound b:
        T, or near the step's end (nothing pending, and idle instances with room for every
        response still leased) BACKUP_FRACTION of it, never under two instance TTLs (an
        engine's count is seen on beats, which may come that late). An instance whose engine
        has not advanced for b while it holds work is drained; then a lease that committed
        nothing for b, plus an instance TTL where its holder's engine reports its steps (so
        the engine check has judged that holder first), is revoked: "no_progress" past T,
        else "backup", the response moving to an idle instance. The lagging holder's lease
        is gone, so whoever commits next under the new epoch wins and its late tokens are
        refused as stale, counted as regenerated. A drained instance whose engine moves again
        (a slow one, or a healthy one judged on a late beat) reads ready at its next beat."""
        timeout = self.cfg.progress_timeout_s
        now = time.monotonic()
        if now - self._started < timeout:
            return
        self._lagging = {i: until for i, until in self._lagging.items() if until > now}
        for active in await self._active_steps():
            await self._check_step_progress(active, timeout, now)

    async def _check_step_progress(self, active: ActiveStep, timeout: float,
                                   now: float) -> None:
        everyone = {i["id"]: i for i in await self.registry.instances(active.run_id)}
        backup = await self._backup_room(active, everyone)
        bound = max(timeout * BACKUP_FRACTION if backup else timeout,
                    2 * self.cfg.instance_ttl_s)
        # The engine first: a backup that took only the work of a hung engine would leave it
        # ready for the next step's, to hang on that too.
        for instance_id, rids in await self.registry.drain_stuck(
                list(everyone.values()), active.run_id, bound):
            if rids:
                await self._tell(instance_id, Revoke(request_ids=rids))
        for rid, owner, idle_s in await self.ledger.stalled_leases(
                active.run_id, active.step, bound):
            reports = bool(everyone.get(owner, {}).get("decode_steps"))
            later = self.cfg.instance_ttl_s if reports else 0.0
            reason = "no_progress" if idle_s >= timeout + later else \
                "backup" if backup and idle_s >= bound + later else ""
            if not reason:
                continue
            self._lagging[owner] = now + timeout
            if await self._take_back(owner, [rid], reason):
                log.warning("%s: nothing committed by %s for %.1fs (%s); it moves", rid,
                            owner, idle_s, reason)
                self.soft.wake.set()

    async def _backup_room(self, step: ActiveStep, everyone: dict[str, Instance]) -> bool:
        """Whether the step is at its end: nothing pending, and idle instances that may take
        work have room for every response still leased."""
        if await self.redis.scard(Keys.pending(step.run_id, step.step)):
            return False
        leased = await self.redis.scard(Keys.leased(step.run_id, step.step))
        idle = [i for i in everyone.values() if i["state"] == "ready" and i["held"] == 0
                and i["run_id"] == step.run_id and step.serves(i)]
        room = takers(idle, in_window=window_open(step.info),
                      any_spot=spot_alive(list(everyone.values())))
        return bool(0 < leased <= sum(int(i["capacity"]) for i in room))

    async def _eligible(self, step: ActiveStep) -> list[Instance]:
        """Who may take work now: ready instances holding the step's version. During the
        seeding window everyone ready (reserved first); after it, or with seeding off, only
        spot instances, unless no spot instance is alive at all, in which case the reserved
        side generates everything (co-located)."""
        info = step.info
        everyone = await self.registry.instances(step.run_id)
        # A quarantined instance is listed so, never ready: it gets nothing (quarantine.py).
        await self.ingest.quarantine.screen(step.run_id, everyone)
        await self.ingest.quarantine.watch(step.run_id, everyone)
        ready = [i for i in everyone if i["state"] == "ready" and i["run_id"] == step.run_id
                 and step.serves(i)]
        mode = info.get("mode", "off")
        if mode == "adaptive" and window_open(info):
            await self._follow_capacity(step, everyone)
        if not self.cfg.midstep_join:
            started = float(info.get("started_at", 0.0))
            everyone, ready = joined_in_time(everyone, started), joined_in_time(ready, started)
        if mode != "off" and window_open(info):
            return takers(ready, in_window=True, any_spot=True)
        any_spot = spot_alive(everyone)
        if mode != "off" and not info.get("handoff_at"):
            await self._handoff(step, everyone, any_spot)
        return takers(ready, in_window=False, any_spot=any_spot)

    async def _follow_capacity(self, step: ActiveStep, everyone: list[Instance]) -> None:
        """An open adaptive window follows the spot count (:func:`manager_svc.seeding.retarget`,
        counted as at the step's start: registered and not draining). The step's hash and
        the controller's state are rewritten together; a manager killed between the two
        finds the count still differing on its next pass and writes both again."""
        count = spot_count(everyone)
        chosen = step.info.get("spot_count")
        if chosen is None or int(chosen) == count:
            return
        state = SeedingState.load(await self.redis.hgetall(Keys.seeding(step.run_id)))
        window = retarget(state, count)
        started = float(step.info["started_at"])
        moved: dict[str, str | int | float] = {"spot_count": count}
        if window is not None:
            moved.update(window_s=window, window_end=started + window)
            state.window_s, state.spot_count = window, count
            await self.redis.hset(Keys.seeding(step.run_id), mapping=state.dump())
            log.info("step %d of %s: spot %s -> %d inside the seeding window; window %.1fs",
                     step.step, step.run_id, chosen, count, window)
        await self.redis.hset(Keys.step(step.run_id, step.step), mapping=moved)
        step.info.update({k: str(v) for k, v in moved.items()})

    async def _handoff(self, step: ActiveStep, everyone: list[Instance],
                       spot_alive: bool) -> None:
        """End of the seeding window: the reserved side's unfinished responses move to spot
        instances (token-level, the preemption path) and the reserved side starts training.

        Idempotent by construction, in passes: each write is a mark or a per-response revoke
        that a re-run repeats harmlessly, and the last one (``reserved_free`` with
        ``handoff_at``) is what ends it, so a manager killed anywhere in between finishes it
        on its next pass. First the reserved instances are asked to flush what they buffered
        and hand their responses back (their releases revoke each once its chunks are
        committed); after HANDOFF_FLUSH_S what is still held is revoked here."""
        skey = Keys.step(step.run_id, step.step)
        if not spot_alive:
            # Nobody to hand to: the reserved side keeps generating, and trains after.
            await self.redis.hset(skey, "handoff_at", time.time())
            return
        held = await self._reserved_held(step, everyone)
        flush_at = step.info.get("handoff_flush_at")
        if flush_at is None:
            for instance_id, rids in held.items():
                await self._tell(instance_id, Revoke(request_ids=rids, flush=True))
            await self.redis.hset(skey, "handoff_flush_at", time.time())
            self.crash.reach(HANDOFF_FLUSH)
            return
        if held and time.time() < float(flush_at) + HANDOFF_FLUSH_S:
            return  # still flushing: a later pass looks again
        for instance_id, rids in held.items():
            for rid in rids:
                await self._take_back(instance_id, [rid], "handoff")
                self.crash.reach(HANDOFF_REVOKE)
        self.crash.reach(HANDOFF_FREE)
        await self.redis.hset(skey, mapping={"reserved_free": 1, "handoff_at": time.time()})
        await self.nc.publish(names.handoff_subject(step.run_id),
                              encode(Handoff(run_id=step.run_id, step=step.step)))

    async def _reserved_held(self, step: ActiveStep, everyone: list[Instance]
                             ) -> dict[str, list[str]]:
        """The step's responses each reserved instance holds, for those that hold any."""
        prefix = f"{step.run_id}:{step.step}:"
        held = {}
        for inst in everyone:
            if inst["kind"] == "reserved":
                rids = sorted(r for r in await self.redis.smembers(
                    Keys.held(step.run_id, inst["id"])) if r.startswith(prefix))
                if rids:
                    held[inst["id"]] = rids
        return held

    async def _lease_fairly(self, step: ActiveStep, ready: list[Instance], pending: set[str]
                            ) -> tuple[int, bool]:
        """Lease ``pending`` in (prompt, sample) order by :func:`lease_plan`. Returns how many
        went out and whether any stayed."""
        spec = await self.runs.spec(step.run_id)
        if spec is None:
            return 0, True  # the run's record is gone: nothing of it to lease
        queue = sorted(pending, key=lambda r: names.parse_request_id(r)[2:])
        # Every instance's slice first, then all of them in one pipelined round trip: leased
        # one instance after the other, a step's first pass over 128 instances waited for
        # 128 scripts and their fsyncs in a row (assignment up to 1.4 s, bench-control-plane).
        # A response another pass took meanwhile is skipped; its room waits for the next pass.
        plan: list[tuple[str, list[str]]] = []
        for inst, room in lease_plan(len(queue), ready):
            take, queue = queue[:room], queue[room:]
            plan += [(inst["id"], take[i:i + ASSIGN_BATCH])
                     for i in range(0, len(take), ASSIGN_BATCH)]
        # An asynchronous run's lease is of the instance's version (lua/assign.lua).
        versions = {i["id"]: int(i["weight_version"]) for i in ready} \
            if int(step.info.get("staleness", 0)) > 0 else None
        leased = await self.ledger.assign_plan(plan, spec.temperature, spec.seed,
                                               int(step.info.get("eos", 0)), versions)
        batches: dict[str, list[Assignment]] = {}
        for (instance_id, _), got in zip(plan, leased, strict=True):
            batches.setdefault(instance_id, []).extend(got)
        sent = 0
        batches = {i: batch for i, batch in batches.items() if batch}
        subjects = await assign_subjects(self.redis, list(batches))
        for subject, batch in zip(subjects, batches.values(), strict=True):
            self.metrics.assignments.inc(len(batch))
            await self.nc.publish(subject, encode(Assign(items=batch)))
            sent += len(batch)
        return sent, bool(queue)

    async def _rebalance(self, step: ActiveStep, ready: list[Instance]) -> None:
        """Token-level load balancing by :func:`rebalance_move` (an instance joined mid-step,
        or its responses ran long): the moved responses continue from their committed tokens
        on the next dispatch, by the migration path."""
        if len(ready) < 2:
            return
        ids = {i["id"] for i in ready}  # re-read: the held counts changed as work went out
        ready = [i for i in await self.registry.instances(step.run_id) if i["id"] in ids]
        now = time.monotonic()
        idle_marks(ready, self._idle_since, now)
        chosen = rebalance_move(ready, self._idle_since, self._rebalanced, now,
                                self.cfg.rebalance_skew)
        if chosen is None:
            return
        busy, idle, count = chosen
        self._rebalanced[busy["id"]] = now
        held = sorted(await self.redis.smembers(Keys.held(step.run_id, busy["id"])))
        pipe = self.redis.pipeline(transaction=False)
        for rid in held:
            pipe.hget(Keys.request(rid), "n")
        progress = [int(n or 0) for n in await pipe.execute()]
        moved = await self._take_back(busy["id"], least_advanced(
            list(zip(held, progress, strict=True)), count), "rebalance")
        if moved:
            log.info("moving %d responses off %s (holds %d, %s holds %d)", len(moved),
                     busy["id"], busy["held"], idle["id"], idle["held"])
            self.soft.wake.set()

    async def _take_back(self, instance_id: str, rids: list[str], reason: str) -> list[str]:
        """Revoke ``rids`` from a live instance and tell it to stop on them; returns the ones
        actually revoked (a response that completed meanwhile stays where it is)."""
        moved = [rid for rid in rids if await self.ledger.revoke(rid)]
        if moved:
            self.metrics.revocations.labels(reason).inc(len(moved))
            await self._tell(instance_id, Revoke(request_ids=moved))
        return moved

    async def _tell(self, instance_id: str, command: Revoke) -> None:
        [subject] = await assign_subjects(self.redis, [instance_id])
        await self.nc.publish(subject, encode(command))
