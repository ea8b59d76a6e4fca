"""The manager's bus side: instance registry, dispatch, chunk ingest, barrier, trainer protocol.

Contract: the manager holds no state of its own. Instances, runs, steps, responses and leases
are Redis data (see :mod:`manager_svc.accounting`); token chunks arrive through a durable
JetStream consumer and are acked only after their commit, so a manager killed at any point and
restarted picks up exactly where Redis and the stream say it was. Every bus handler validates
its message; a malformed one is counted, logged and answered with ``Ack(ok=False)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import redis.asyncio as aioredis
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg as NatsMsg
from redis.exceptions import RedisError

from manager_svc.accounting import Ledger
from manager_svc.dispatch import Dispatch
from manager_svc.ingest import ChunkIngest
from manager_svc.metrics import ManagerMetrics
from manager_svc.runs import RunStore
from manager_svc.scripts import register
from manager_svc.trainer_api import TrainerProtocol
from shared import names
from shared.bus import connect_nats, connect_redis, ensure_chunk_stream
from shared.config import ManagerConfig
from shared.errors import ProtocolError
from shared.names import Keys
from shared.process import cancel_and_wait
from shared.protocol import (
    Ack,
    Heartbeat,
    HeartbeatReply,
    Release,
    RunFailed,
    StepFinish,
    StepSamplesQuery,
    StepStart,
    Target,
    TrainerPoll,
    decode,
    encode,
)

log = logging.getLogger("manager")
M = TypeVar("M", bound=msgspec.Struct)
# An assignment the instance has not confirmed in a heartbeat after this long is taken back.
LOST_ASSIGNMENT_S = 1.5
# How long a release waits for the leaving instance's last chunks to be committed.
RELEASE_COMMIT_WAIT_S = 3.0
# How long a released session stays barred: far longer than any beat can sit in flight.
DEPARTED_TTL_MS = 60_000
# How long stop() waits for the background loops after cancelling them.
STOP_WAIT_S = 3.0

class ManagerService(ChunkIngest, Dispatch, TrainerProtocol):
    def __init__(self, cfg: ManagerConfig) -> None:
        self.cfg = cfg
        self.metrics = ManagerMetrics()
        self._tasks: list[asyncio.Task[None]] = []
        self._tails: dict[str, asyncio.Task[None]] = {}  # keyed bus handlers, newest per key
        self._wake = asyncio.Event()
        self._stopping = False
        self._rebalanced: dict[str, float] = {}  # soft state: last rebalance per instance
        self._idle_since: dict[str, float] = {}  # soft state: when each instance went idle
        self.redis: aioredis.Redis
        self.nc: Nats
        self.ledger: Ledger
        self.runs: RunStore

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self.redis = await connect_redis(self.cfg.common.redis_url)
        self.nc = await connect_nats(self.cfg.common.nats_url, "manager")
        self.ledger = Ledger(self.redis, self.cfg.lease_ttl_s, self.cfg.migration)
        self.runs = RunStore(self.redis)
        self._register = register(self.redis, "register.lua")
        await ensure_chunk_stream(self.nc.jetstream())
        await self._serve(names.HEARTBEAT, Heartbeat, self.on_heartbeat,
                          key=lambda hb: hb.instance_id)
        await self._serve(names.RELEASE, Release, self.on_release)
        await self._serve(names.TRAINER_POLL, TrainerPoll, self.on_poll)
        await self._serve(names.TRAINER_START, StepStart, self.on_step_start)
        await self._serve(names.TRAINER_SAMPLES, StepSamplesQuery, self.on_samples)
        await self._serve(names.TRAINER_FINISH, StepFinish, self.on_finish)
        await self._serve(names.TRAINER_FAIL, RunFailed, self.on_run_failed)
        self._tasks = [asyncio.create_task(self._supervised(self._consume_chunks)),
                       asyncio.create_task(self._supervised(self._dispatch_loop))]
        log.info("manager started: %s", self.cfg.common.describe())

    async def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        # Bounded, so that stop() returns and closes the clients even if a loop ignores its
        # cancels (the loops also end on _stopping: this is a backstop, logged if ever needed).
        ended = await asyncio.gather(*(cancel_and_wait(t, STOP_WAIT_S) for t in self._tasks))
        for task, done in zip(self._tasks, ended, strict=True):
            if not done:
                log.error("background loop %s ignored its cancels; leaving it", task.get_name())
        # Drain flushes what handlers already answered; bounded, since a pull subscription
        # with an open fetch can otherwise hold it for nats-py's 30 s default.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.nc.drain(), 2.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.nc.close(), STOP_WAIT_S)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.redis.aclose(), STOP_WAIT_S)

    async def _supervised(self, loop: Callable[[], Awaitable[None]]) -> None:
        """Run a background loop; transient broker errors are retried, never silently fatal."""
        while not self._stopping:
            try:
                await loop()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s failed; restarting it in 0.5s", loop.__name__)
                await asyncio.sleep(0.5)

    async def _serve(self, subject: str, kind: type[M], handler: Callable[[M], Awaitable[Any]],
                     key: Callable[[M], str] | None = None) -> None:
        """Answer with ``handler`` one message at a time; with ``key``, in order per key but
        concurrently across keys (all in one queue, heartbeats came late and leases expired)."""
        async def callback(msg: NatsMsg, after: asyncio.Task[None] | None = None) -> None:
            if after is not None:
                await asyncio.wait([after])
            try:
                request = decode(msg.data, kind)
            except ProtocolError as exc:
                self.metrics.malformed.labels(subject).inc()
                log.warning("dropped %s", exc)
                reply: msgspec.Struct = Ack(ok=False, detail=str(exc))
            else:
                try:
                    reply = await handler(request)
                except RedisError as exc:  # Redis restarting: the sender should try again
                    self.metrics.handler_errors.labels(subject).inc()
                    log.warning("%s: state store unavailable (%s)", subject, exc)
                    reply = Ack(ok=False, detail="state store unavailable", retryable=True)
                except Exception as exc:
                    self.metrics.handler_errors.labels(subject).inc()
                    log.exception("handler for %s failed", subject)
                    reply = Ack(ok=False, detail=f"manager error: {type(exc).__name__}")
            if msg.reply:
                with contextlib.suppress(Exception):
                    await msg.respond(encode(reply))

        async def spawn(msg: NatsMsg) -> None:
            try:
                tag = key(decode(msg.data, kind)) if key else ""
            except ProtocolError:
                tag = ""  # the callback reports it
            task = asyncio.create_task(callback(msg, self._tails.get(tag)))
            self._tails[tag] = task  # the newest per key; each task holds the one before it
            task.add_done_callback(lambda t: self._tails.get(tag) is t and self._tails.pop(tag))

        await self.nc.subscribe(subject, cb=callback if key is None else spawn)

    # --- instances -------------------------------------------------------------------------

    async def current_target(self) -> tuple[str, int] | None:
        run_id = await self.runs.active()
        if not run_id:
            return None
        step = await self.redis.hget(Keys.run(run_id), "step")
        return (run_id, int(step or 0))

    async def on_heartbeat(self, hb: Heartbeat) -> HeartbeatReply:
        fields = {
            "id": hb.instance_id, "kind": hb.kind, "engine": hb.engine, "state": hb.state,
            "run_id": hb.run_id or "", "weight_version": -1 if hb.weight_version is None
            else hb.weight_version, "capacity": hb.capacity, "pid": hb.pid,
            "metrics_port": hb.metrics_port, "last_seen": time.time(), "session": hb.session,
        }
        held_rows = await self._register(
            keys=[Keys.instance(hb.instance_id), Keys.instances,
                  Keys.instance_held(hb.instance_id), Keys.departed(hb.instance_id)],
            args=[json.dumps([str(x) for kv in fields.items() for x in kv]),
                  int(self.cfg.instance_ttl_s * 1000), hb.session, hb.instance_id,
                  fields["last_seen"]])
        if held_rows is None:  # this process already released and left
            return HeartbeatReply(target=None, revoke=[h.request_id for h in hb.held])
        server_held = set(held_rows)
        target = await self.current_target()
        reported = {held.request_id for held in hb.held}
        prefix = f"{target[0]}:" if target else None
        revoke = [h.request_id for h in hb.held
                  if prefix is None or not h.request_id.startswith(prefix)]
        revoke += await self.ledger.renew_many(hb.instance_id, [
            (h.request_id, h.epoch, h.buffered) for h in hb.held
            if prefix is not None and h.request_id.startswith(prefix)])
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

    async def on_release(self, rel: Release) -> Ack:
        await self._await_commits(rel)
        revoked = 0
        for held in rel.held:
            if await self.ledger.revoke(held.request_id, held.epoch):
                self.metrics.revocations.labels(rel.reason).inc()
                revoked += 1
        if rel.held and rel.reason == "preempt":
            await self._count_preemption(revoked)
        if rel.leaving:
            if rel.session:
                await self.redis.set(Keys.departed(rel.instance_id), rel.session,
                                     px=DEPARTED_TTL_MS)
            await self._forget_instance(rel.instance_id)
        self._wake.set()
        return Ack()

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
            rows = await pipe.execute()
            behind = [h for h, (n, epoch, done) in zip(rel.held, rows, strict=True)
                      if n is not None and done != "1" and epoch == str(h.epoch)
                      and int(n) < h.published]
            if not behind:
                return
            await asyncio.sleep(0.02)

    async def _count_preemption(self, responses: int) -> None:
        target = await self.current_target()
        if target:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hincrby(Keys.step(*target), "preemptions", 1)
            pipe.hincrby(Keys.step(*target), "preempted_responses", responses)
            await pipe.execute()

    async def _forget_instance(self, instance_id: str) -> int:
        revoked = 0
        for rid in await self.redis.smembers(Keys.instance_held(instance_id)):
            if await self.ledger.revoke(rid):
                self.metrics.revocations.labels("dead").inc()
                revoked += 1
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(Keys.instance(instance_id), Keys.instance_held(instance_id))
        pipe.srem(Keys.instances, instance_id)
        await pipe.execute()
        return revoked

    async def instances(self) -> list[dict[str, Any]]:
        ids = sorted(await self.redis.smembers(Keys.instances))
        pipe = self.redis.pipeline(transaction=False)
        for i in ids:
            pipe.hgetall(Keys.instance(i))
            pipe.scard(Keys.instance_held(i))
        rows = await pipe.execute()
        out = []
        for i, (info, held) in zip(ids, zip(rows[::2], rows[1::2], strict=True), strict=True):
            if not info:
                continue  # expired: the reaper will take its work back
            version = int(info.get("weight_version", -1))
            out.append({
                "id": i, "kind": info.get("kind"), "state": info.get("state"),
                "engine": info.get("engine"), "run_id": info.get("run_id") or None,
                "weight_version": None if version < 0 else version,
                "capacity": int(info.get("capacity", 1)), "held": int(held),
                "pid": int(info.get("pid", 0)), "metrics_port": int(info.get("metrics_port", 0)),
                "last_seen": float(info.get("last_seen", 0)),
                "joined_at": float(info.get("joined_at", 0)),
            })
        return out
