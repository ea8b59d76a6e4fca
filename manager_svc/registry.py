"""The instance registry: which rollout instances are alive, and taking work back from the gone.

Contract: an instance is a Redis hash that each heartbeat refreshes (``lua/beat.lua``, then
``lua/beat_run.lua`` in the run it serves) and that expires ``instance_ttl_s`` after the last
one; the set of the responses it holds in the active run is Redis data too. A heartbeat renews
the leases the instance reports, takes back what it should hold but never confirmed, and is
answered with the run and weight version to serve. An instance leaves in one of two ways: a
release (it hands its work back after its last chunks are committed, and its session is
barred, so a late beat cannot bring it back), or silence (its hash expires and
:meth:`Registry.reap_dead` takes its work back). Either way its responses go back to the
pending set through the ledger's revoke, and continue elsewhere from the last committed
token.

With the auth callout on, an instance's heartbeats and releases come on subjects that name its
key (:func:`shared.names.fingerprint`), and only those under the key its id is bound to count:
one under another key comes from an older connection under the id, whose process was declared
dead (its binding lapsed) while it stayed connected, and is refused (the instance is answered
with a :class:`~shared.protocol.Refused` and stops). Assignments go to the key an accepted beat
named (:func:`assign_subjects`). (A refused beat's part in its run, sent with its registration
to save a round trip, may still renew leases the id holds, the newer process's, and note its
session in the run's events; it never registers the instance and is never assigned anything.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import msgspec
import redis.asyncio as aioredis

from manager_svc.accounting import Ledger
from manager_svc.crash import HANDOFF_REVOKE, CrashPoints
from manager_svc.events import MAX_EVENTS, InstanceEvents
from manager_svc.metrics import ManagerMetrics
from manager_svc.runs import RunStore
from manager_svc.scripts import Call, register, run_batch
from manager_svc.soft_state import SoftState
from shared import names
from shared.config import ManagerConfig
from shared.logs import Throttled
from shared.names import Keys
from shared.protocol import Ack, Heartbeat, HeartbeatReply, Refused, Release, Target

log = logging.getLogger("manager")
# An assignment the instance has not confirmed in a heartbeat after this long is taken back.
LOST_ASSIGNMENT_S = 1.5
# How long a release waits for the leaving instance's last chunks to be committed.
RELEASE_COMMIT_WAIT_S = 3.0
# How long a released session stays barred: far longer than any beat can sit in flight.
DEPARTED_TTL_MS = 60_000


async def assign_subjects(redis: aioredis.Redis, instance_ids: list[str]) -> list[str]:
    """Where each instance reads its assignments and revocations: its id's subject under the
    key fingerprint its accepted beats named (none: the bare id's, no callout's login may read
    it), in one round trip."""
    pipe = redis.pipeline(transaction=False)
    for instance_id in instance_ids:
        pipe.hget(Keys.instance(instance_id), "fp")
    fps = await pipe.execute() if instance_ids else []
    return [names.assign_subject(i, fp or "") for i, fp in zip(instance_ids, fps, strict=True)]


def stuck_mark(info: dict[str, str]) -> str:
    """What a drained instance's ``stuck`` field holds: its process and its engine's count."""
    return f"{info.get('session', '')}:{info.get('decode_steps', '0')}"


class Registry:
    def __init__(self, cfg: ManagerConfig, redis: aioredis.Redis, ledger: Ledger,
                 runs: RunStore, metrics: ManagerMetrics, soft: SoftState,
                 events: InstanceEvents, crash: CrashPoints) -> None:
        self.cfg = cfg
        self.redis = redis
        self.ledger = ledger
        self.runs = runs
        self.metrics = metrics
        self.soft = soft
        self.events = events
        self.crash = crash
        self._beat = register(redis, "beat.lua")
        self._beat_run = register(redis, "beat_run.lua")
        self._claims = Throttled(log)
        self._stale = Throttled(log)

    async def _credential_kind(self, hb: Heartbeat) -> Heartbeat:
        """``hb`` with the kind its sender's credential gives it, and a spot instance's
        capacity bounded: with the auth callout on, a beat may claim ``reserved`` only from a
        reserved login (Keys.identity, bound by the callout); any other claim is served as
        spot. A spot instance declaring more than ``max_spot_capacity`` is served at it (one
        such claim would otherwise take a whole step's work, to sit on it until the progress
        check takes it back). Both counted and logged (rate-limited)."""
        if hb.kind != "spot" and self.cfg.issuer_seed is not None:
            bound = await self.redis.get(Keys.identity(hb.instance_id))
            if bound is None or not str(bound).startswith("reserved:"):
                self.metrics.kind_refused.inc()
                self._claims.warning("instance %s claims to be reserved with a spot "
                                     "credential: served as spot", hb.instance_id)
                hb = msgspec.structs.replace(hb, kind="spot")
        if hb.kind == "spot" and hb.capacity > self.cfg.max_spot_capacity:
            self.metrics.capacity_clamped.inc()
            self._claims.warning("spot instance %s declares capacity %d: served at %d",
                                 hb.instance_id, hb.capacity, self.cfg.max_spot_capacity)
            hb = msgspec.structs.replace(hb, capacity=self.cfg.max_spot_capacity)
        return hb

    def _superseded(self, message: str, instance_id: str, key: str) -> str:
        """Count and log (rate-limited) a ``message`` refused because another key holds its
        instance id; what the sender is told."""
        self.metrics.superseded.labels(message).inc()
        why = ("names no key: an image older than the manager's release" if not key else
               "comes from a key that no longer holds the id (a newer process logged in "
               "under it)")
        self._stale.warning("%s of instance %s refused: it %s", message, instance_id, why)
        return f"the {message} of instance {instance_id} {why}"

    async def _keyless(self, message: str, instance_id: str, key: str) -> str | None:
        """Why a ``message`` (a release) from the process of key fingerprint ``key`` is
        refused, None if it is not: with the callout on, only under the key its id is bound
        to (or any, while no process holds the id)."""
        if self.cfg.issuer_seed is None:
            return None
        if key:
            bound = await self.redis.get(Keys.identity(instance_id))
            if bound is None or names.fingerprint(str(bound).partition(":")[2]) == key:
                return None
        return self._superseded(message, instance_id, key)

    async def on_heartbeat(self, hb: Heartbeat, key: str = "") -> HeartbeatReply | Refused:
        """``key``: the fingerprint of the sender's key its subject names ("" none)."""
        if not key and self.cfg.issuer_seed is not None:
            return Refused(detail=self._superseded("heartbeat", hb.instance_id, key))
        hb = await self._credential_kind(hb)
        version = -1 if hb.weight_version is None else hb.weight_version
        fields = {
            "id": hb.instance_id, "kind": hb.kind, "engine": hb.engine, "state": hb.state,
            "run_id": hb.run_id or "", "weight_version": version, "capacity": hb.capacity,
            "pid": hb.pid, "metrics_port": hb.metrics_port, "last_seen": time.time(),
            "session": hb.session, "fp": key,
        }
        # Two scripts, one per slot (the control keys', then the run's), as a Redis Cluster
        # keeps them apart; in one round trip when the run the instance names is the active
        # one, as it is but around a run's start. The run's part is harmless for a process
        # that has left: its leases were revoked, and its run records no join for it.
        beat = Call(self._beat, [Keys.instance(hb.instance_id), Keys.instances,
                                 Keys.departed(hb.instance_id), Keys.identity(hb.instance_id),
                                 Keys.active],
                    [json.dumps([str(x) for kv in fields.items() for x in kv]),
                     int(self.cfg.instance_ttl_s * 1000), hb.session, hb.instance_id,
                     fields["last_seen"], hb.decode_steps, int(bool(hb.held)), key])
        guess = [self._run_part(hb, hb.run_id, version)] if hb.run_id else []
        replies = await run_batch(self.redis, [beat, *guess])
        run_id = replies[0]
        if run_id == 0:  # another key holds the id: the run's part must not count either
            return Refused(detail=self._superseded("heartbeat", hb.instance_id, key))
        if run_id is None or run_id == "":  # it already released and left, or no run is on
            return HeartbeatReply(target=None, revoke=[h.request_id for h in hb.held])
        run_id = str(run_id)
        if run_id == hb.run_id:
            held_rows, step, dropped = replies[1]
        else:
            [(held_rows, step, dropped)] = await run_batch(
                self.redis, [self._run_part(hb, run_id, version)])
        target = (run_id, int(step)) if step is not None else None
        server_held = set(held_rows)
        reported = {held.request_id for held in hb.held}
        revoke = [str(r) for r in dropped]
        now = time.time()
        for rid in server_held - reported:
            assigned = await self.redis.hget(Keys.request(rid), "assigned_at")
            if assigned and now - float(assigned) > LOST_ASSIGNMENT_S and \
                    await self.ledger.revoke(rid):
                self.metrics.revocations.labels("lost").inc()
                log.info("%s never reached %s; taken back", rid, hb.instance_id)
        return HeartbeatReply(
            target=Target(run_id=target[0], weight_version=target[1]) if target else None,
            revoke=revoke,
        )

    def _run_part(self, hb: Heartbeat, run_id: str, version: int) -> Call:
        """The beat's part in ``run_id``: lua/beat_run.lua."""
        return Call(self._beat_run, [Keys.run(run_id), Keys.held(run_id, hb.instance_id),
                                     Keys.run_instances(run_id), Keys.events(run_id)],
                    [run_id, hb.instance_id, hb.session, hb.run_id or "", version, hb.kind,
                     MAX_EVENTS, self.ledger.lease_ttl_ms,
                     *[x for h in hb.held for x in (h.request_id, h.epoch, h.buffered)]])

    async def on_release(self, rel: Release, key: str = "") -> Ack:
        """``key``: the fingerprint of the sender's key its subject names ("" none)."""
        refused = await self._keyless("release", rel.instance_id, key)
        if refused is not None:
            return Ack(ok=False, detail=refused)
        if rel.leaving and await self.redis.exists(Keys.instance(rel.instance_id)):
            # It takes no more work from here. Its last beat said ready (it stops beating
            # before it releases), so until it is forgotten below the dispatcher could lease
            # what it hands back straight back to it, and that would wait out a lease.
            await self.redis.hset(Keys.instance(rel.instance_id), "state", "draining")
        await self._await_commits(rel)
        revoked = foreign = 0
        for held in rel.held:
            outcome = await self.ledger.hand_back(held.request_id, held.epoch, rel.instance_id)
            if outcome == 1:
                self.metrics.revocations.labels(rel.reason).inc()
                revoked += 1
                if rel.reason == "handoff":
                    self.crash.reach(HANDOFF_REVOKE)
            foreign += outcome == -1
        if foreign:
            # Another instance's lease named in a release: a hostile or broken sender. Its
            # holder keeps it; one line per release, however many ids it named.
            self.metrics.foreign_releases.inc(foreign)
            log.warning("release from %s named %d lease(s) it does not hold: refused",
                        rel.instance_id, foreign)
        if rel.held and rel.reason == "preempt":
            await self._count_preemption(revoked)
        if rel.leaving:
            run_id = await self.runs.active()
            if run_id:
                kind = await self.redis.hget(Keys.instance(rel.instance_id), "kind")
                await self.events.left(run_id, rel.instance_id, kind, rel.reason,
                                       rel.session)
            if rel.session:
                await self.redis.set(Keys.departed(rel.instance_id), rel.session,
                                     px=DEPARTED_TTL_MS)
            await self._forget(rel.instance_id)
            # Its NATS identity too: a new process may log in under the id at once. (Only
            # here: an expired instance's binding has expired with it.)
            await self.redis.delete(Keys.identity(rel.instance_id))
        self.soft.wake.set()
        return Ack()

    async def reap_dead(self) -> None:
        """An instance whose heartbeat key expired is dead: take its work back (hard loss)."""
        known = sorted(await self.redis.smembers(Keys.instances))
        pipe = self.redis.pipeline(transaction=False)
        for instance_id in known:
            pipe.exists(Keys.instance(instance_id))
        # One round trip for the fleet, not one per instance every reap.
        alive = await pipe.execute() if known else []
        for instance_id, up in zip(known, alive, strict=True):
            if up:
                continue
            revoked = await self._forget(instance_id)
            log.warning("instance %s is gone; %d responses go back to the queue",
                        instance_id, revoked)
            run_id = await self.runs.active()
            if run_id:
                await self.events.died(run_id, instance_id)
            if revoked:
                await self._count_preemption(revoked)

    async def instances(self, run_id: str | None = None) -> list[dict[str, Any]]:
        """Every live instance, with how many responses of ``run_id`` (by default the
        active run) it holds; one quarantined in that run is in state "quarantined", with
        its ``reason`` (otherwise None)."""
        ids = sorted(await self.redis.smembers(Keys.instances))
        run_id = run_id or await self.redis.get(Keys.active)
        pipe = self.redis.pipeline(transaction=False)
        for i in ids:
            pipe.hgetall(Keys.instance(i))
        for i in ids if run_id else ():  # with no run on, nobody holds anything
            pipe.scard(Keys.held(run_id or "", i))
        if run_id:
            pipe.hgetall(Keys.quarantined(run_id))
        rows = await pipe.execute()
        quarantined = rows.pop() if run_id else {}  # id -> why it gets no work (quarantine.py)
        counts = rows[len(ids):] or [0] * len(ids)
        out = []
        for i, info, held in zip(ids, rows[:len(ids)], counts, strict=True):
            if not info:
                continue  # expired: the reaper will take its work back
            version = int(info.get("weight_version", -1))
            out.append({
                "id": i, "kind": info.get("kind"),
                "state": "quarantined" if i in quarantined else self._state(info),
                "reason": quarantined.get(i),
                "engine": info.get("engine"), "run_id": info.get("run_id") or None,
                "weight_version": None if version < 0 else version,
                "capacity": int(info.get("capacity", 1)), "held": int(held),
                "pid": int(info.get("pid", 0)), "metrics_port": int(info.get("metrics_port", 0)),
                "last_seen": float(info.get("last_seen", 0)),
                "joined_at": float(info.get("joined_at", 0)),
                "decode_steps": int(info.get("decode_steps", 0)),
                "steps_at": float(info.get("steps_at", 0)),
            })
        return out

    @staticmethod
    def _state(info: dict[str, str]) -> str | None:
        """An instance drained for a hung engine reads ``draining`` (and gets no work) until
        its engine moves again: its mark names the process and the step count it stopped at."""
        if info.get("stuck") and info["stuck"] == stuck_mark(info):
            return "draining"
        return info.get("state")

    async def drain_stuck(self, rows: list[dict[str, Any]], run_id: str, timeout_s: float
                          ) -> list[tuple[str, list[str]]]:
        """Of ``rows`` (:meth:`instances` of the active run ``run_id``), those that hold work
        while their engine has not advanced for ``timeout_s``: each is marked (so it reads
        ``draining`` until its engine moves) and its leases of the run revoked. Returns
        (instance, request ids revoked) for each one marked. An engine that cannot tell its
        steps (0) is left to the per-lease progress check."""
        drained = []
        now = time.time()
        for row in rows:
            if row["state"] != "ready" or row["held"] == 0 or row["decode_steps"] == 0 or \
                    now - row["steps_at"] < timeout_s:
                continue
            key = Keys.instance(row["id"])
            info = await self.redis.hgetall(key)
            if info.get("decode_steps") != str(row["decode_steps"]):
                continue  # gone, or a beat since says its engine moved
            await self.redis.hset(key, "stuck", stuck_mark(info))
            revoked = [rid for rid in sorted(await self.redis.smembers(
                Keys.held(run_id, row["id"]))) if await self.ledger.revoke(rid)]
            self.metrics.revocations.labels("engine_stuck").inc(len(revoked))
            self.metrics.stuck_engines.inc()
            log.warning("instance %s: engine stuck at decode step %d for %.1fs while holding "
                        "work; drained, %d responses move", row["id"], row["decode_steps"],
                        now - row["steps_at"], len(revoked))
            drained.append((row["id"], revoked))
        return drained

    async def _await_commits(self, rel: Release) -> None:
        """A leaving instance flushed its tokens to the stream before releasing: let the chunk
        consumer commit them first (bounded), or revoking now would reject them as stale."""
        # The instance no longer heartbeats: hold its leases for the wait.
        await self.ledger.renew_many(rel.instance_id, [(h.request_id, h.epoch, 0)
                                                       for h in rel.held])
        end = time.monotonic() + RELEASE_COMMIT_WAIT_S
        while time.monotonic() < end:
            pipe = self.redis.pipeline(transaction=False)
            for held in rel.held:
                pipe.hmget(Keys.request(held.request_id), ["n", "epoch", "done"])
                pipe.get(Keys.lease(held.request_id))
            rows = await pipe.execute()
            # Only for the sender's own leases: a release naming another's, with a count
            # published that is never reached, would hold its handler for the whole wait.
            behind = [h for h, (n, epoch, done), owner
                      in zip(rel.held, rows[::2], rows[1::2], strict=True)
                      if n is not None and done != "1" and epoch == str(h.epoch)
                      and owner == f"{rel.instance_id}:{h.epoch}" and int(n) < h.published]
            if not behind:
                return
            await asyncio.sleep(0.02)

    async def _count_preemption(self, responses: int) -> None:
        target = await self.runs.target()
        if target:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hincrby(Keys.step(*target), "preemptions", 1)
            pipe.hincrby(Keys.step(*target), "preempted_responses", responses)
            await pipe.execute()

    async def _forget(self, instance_id: str) -> int:
        """Take back what the instance holds in the active run (what it held in an ended
        run no longer matters: those keys expire with the run) and forget it."""
        revoked = 0
        run_id = await self.redis.get(Keys.active)
        held = Keys.held(run_id, instance_id) if run_id else None
        for rid in await self.redis.smembers(held) if held else ():
            if await self.ledger.revoke(rid):
                self.metrics.revocations.labels("dead").inc()
                revoked += 1
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(Keys.instance(instance_id))
        if held:
            pipe.delete(held)
        pipe.srem(Keys.instances, instance_id)
        await pipe.execute()
        return revoked
