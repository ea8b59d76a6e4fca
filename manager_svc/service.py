"""The manager service: wires its parts and owns their lifecycle.

Contract: the manager holds no state of its own. Instances, runs, steps, responses and leases
are Redis data (see :mod:`manager_svc.accounting`); token chunks arrive through a durable
JetStream consumer and are acked only after their commit, so a manager killed at any point and
restarted picks up exactly where Redis and the stream say it was. This module connects the
clients, builds the parts (run store, ledger, instance registry, chunk ingest, dispatcher,
trainer API; each a plain class given what it uses), answers the bus subjects with their
handlers and supervises the two background loops (chunk ingest, dispatch) until :meth:`stop`.
Every bus handler validates its message; a malformed one is counted, logged and answered with
``Ack(ok=False)``, and so is an instance's message whose id differs from its subject's (an
instance speaking in another's name). With RLBOOST_NATS_ISSUER_SEED set it also answers the
NATS server's auth callout (:mod:`manager_svc.callout`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import msgspec
import redis.asyncio as aioredis
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg as NatsMsg
from redis.exceptions import RedisError

from manager_svc.accounting import Ledger
from manager_svc.archive import Archive
from manager_svc.callout import AuthCallout
from manager_svc.chunk_auth import ChunkAuth
from manager_svc.crash import CrashPoints
from manager_svc.dispatcher import Dispatcher
from manager_svc.dynamic_sampling import DynamicSteps
from manager_svc.events import InstanceEvents
from manager_svc.ingest import ChunkIngest
from manager_svc.leader import Leadership, replica_id
from manager_svc.metrics import ManagerMetrics
from manager_svc.quarantine import Quarantine
from manager_svc.registry import Registry
from manager_svc.runs import RunStore
from manager_svc.soft_state import SoftState
from manager_svc.trainer_api import TrainerApi
from manager_svc.turns import Turns
from manager_svc.version_gate import VersionGate
from shared import names
from shared.bus import connect_nats, connect_redis, ensure_chunk_stream
from shared.config import ManagerConfig
from shared.errors import ProtocolError
from shared.logs import Throttled
from shared.names import Keys
from shared.process import cancel_and_wait
from shared.protocol import (
    Ack,
    Heartbeat,
    Release,
    RunFailed,
    RunWarning,
    StepClose,
    StepExtend,
    StepFinish,
    StepRecordQuery,
    StepSamplesQuery,
    StepStart,
    ToolClaim,
    ToolResult,
    TrainerPoll,
    decode,
    encode,
)
from shared.settings import reveal

log = logging.getLogger("manager")
M = TypeVar("M", bound=msgspec.Struct)
# How long stop() waits for the background loops after cancelling them.
STOP_WAIT_S = 3.0
SERVE_QUEUE = "managers"  # the NATS queue group every replica answers the bus in
# Bus handlers running or waiting at once, all instances together: past it a request is shed
# unanswered (its sender retries), so a flood from many ids cannot grow the manager's memory.
# Each instance has at most two (one running, one waiting), so this is a fleet of thousands.
MAX_HANDLERS = 8192
# What the NATS client queues per subscription before it drops (nats-py: 128 MB by default):
# the handlers drain it at once, so only a flood fills it, and a flood is dropped.
PENDING_BYTES = 16 << 20


class ManagerService:
    def __init__(self, cfg: ManagerConfig) -> None:
        self.cfg = cfg
        self.metrics = ManagerMetrics()
        self.soft = SoftState()
        self.replica = replica_id()  # this process among any other manager replicas
        self._tasks: list[asyncio.Task[None]] = []
        self._tails: dict[str, asyncio.Task[None]] = {}  # keyed bus handlers, newest per key
        self._waiting: set[str] = set()  # keys whose newest handler waits behind another
        self._handlers = 0  # keyed bus handlers running or waiting
        self._dropped = Throttled(log)  # malformed bus messages: one line per 10 s at most
        # Set by start(), once the clients are connected:
        self.redis: aioredis.Redis
        self.nc: Nats
        self.runs: RunStore
        self.ledger: Ledger
        self.registry: Registry
        self.ingest: ChunkIngest
        self.dispatcher: Dispatcher
        self.trainer: TrainerApi
        self.auth: ChunkAuth
        self.events: InstanceEvents
        self.leader: Leadership

    async def start(self) -> None:
        self.redis = await connect_redis(self.cfg.common.redis_url)
        self.nc = await connect_nats(self.cfg.common.nats_url, "manager",
                                     tls=self.cfg.common.tls.client())
        self.auth = await ChunkAuth.load(self.redis)
        self._wire()
        seed, password = reveal(self.cfg.issuer_seed), reveal(self.cfg.rollout_password)
        if seed is not None and password is not None:
            # Spot first: were both passwords the same, a login would be the lesser kind.
            kinds = {"spot": password,
                     "reserved": reveal(self.cfg.rollout_reserved_password) or ""}
            await AuthCallout(self.nc, self.redis, seed, kinds, self.metrics,
                              self.cfg.max_instances_per_credential).start()
        await ensure_chunk_stream(self.nc.jetstream(), self.cfg.stream_replicas,
                                  self.cfg.stream_max_bytes)
        await self.runs.sweep()  # runs that ended as a manager died: archive, expire
        await self._serve(names.HEARTBEAT_ANY, Heartbeat, self.registry.on_heartbeat,
                          owner=lambda hb: hb.instance_id, ordered=True,
                          refuse=VersionGate(self.metrics).refuse)
        # Ordered too: a release may wait seconds for its last commits, and one at a time for
        # every instance, a flood of releases from one id held up everyone's hand-back.
        await self._serve(names.RELEASE_ANY, Release, self.registry.on_release,
                          owner=lambda rel: rel.instance_id, ordered=True)
        await self._serve(names.TRAINER_POLL, TrainerPoll, self.trainer.on_poll)
        await self._serve(names.TRAINER_START, StepStart, self.trainer.on_step_start)
        await self._serve(names.TRAINER_SAMPLES, StepSamplesQuery, self.trainer.on_samples)
        await self._serve(names.TRAINER_FINISH, StepFinish, self.trainer.on_finish)
        await self._serve(names.TRAINER_FAIL, RunFailed, self.trainer.on_run_failed)
        await self._serve(names.TRAINER_RECORD, StepRecordQuery, self.trainer.on_record)
        await self._serve(names.TRAINER_WARN, RunWarning, self.trainer.on_warning)
        await self._serve(names.TRAINER_EXTEND, StepExtend, self.dynamic.on_extend)
        await self._serve(names.TRAINER_CLOSE, StepClose, self.dynamic.on_close)
        await self._serve(names.TRAINER_TOOLS, ToolClaim, self.turns.on_claim)
        await self._serve(names.TRAINER_ANSWER, ToolResult, self.turns.on_answer)
        self._tasks = [
            asyncio.create_task(self._supervised(self.ingest.consume), name="chunk-ingest"),
            asyncio.create_task(self._supervised(self.dispatcher.run), name="dispatch"),
            asyncio.create_task(self._supervised(self._prune_runs), name="prune-runs"),
        ]
        log.info("manager %s started: %s", self.replica, self.cfg.describe())

    def _wire(self) -> None:
        """The parts, each given what it uses; none reaches another except through these."""
        cfg, redis, nc, metrics, soft = self.cfg, self.redis, self.nc, self.metrics, self.soft
        archive = Archive(cfg.common.data_dir)
        self.runs = RunStore(redis, archive, cfg.retention_s, cfg.max_queued_runs,
                             cfg.redis_replica_acks)
        self.events = InstanceEvents(redis, archive)
        crash = CrashPoints(cfg.crash_points, cfg.common.data_dir)
        self.ledger = Ledger(redis, cfg.lease_ttl_s, cfg.migration, self.auth.lease_key, crash,
                             cfg.redis_replica_acks)
        self.registry = Registry(cfg, redis, self.ledger, self.runs, metrics, soft, self.events,
                                 crash)
        quarantine = Quarantine(redis, nc, self.ledger, self.runs, metrics, soft,
                                cfg.quarantine_invalid, cfg.quarantine_ttl_s, cfg.unserved_fail_s)
        self.ingest = ChunkIngest(redis, nc, self.ledger, self.runs, metrics, soft, self.auth,
                                  ack_wait_s=cfg.lease_ttl_s, quarantine=quarantine)
        self.leader = Leadership(redis, Keys.dispatch_leader, self.replica, cfg.lease_ttl_s,
                                 metrics)
        self.dispatcher = Dispatcher(cfg, redis, nc, self.ledger, self.runs, self.registry,
                                     self.ingest, metrics, soft, crash, self.leader)
        self.trainer = TrainerApi(redis, self.ledger, self.runs, self.registry, metrics, soft)
        self.dynamic = DynamicSteps(nc, self.ledger, self.runs, self.ingest, metrics, soft)
        self.turns = Turns(redis, self.ingest.announcer, soft)

    async def stop(self) -> None:
        if self.soft.stopping:
            return
        self.soft.stopping = True
        # Bounded, so that stop() returns and closes the clients even if a loop ignores its
        # cancels (the loops also end on soft.stopping: this is a backstop, logged if ever needed).
        ended = await asyncio.gather(*(cancel_and_wait(t, STOP_WAIT_S) for t in self._tasks))
        for task, done in zip(self._tasks, ended, strict=True):
            if not done:
                log.error("background loop %s ignored its cancels; leaving it", task.get_name())
        # Nothing is pulled unacked now: another replica takes ingest and dispatch at once.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ingest.leave(), STOP_WAIT_S)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.leader.release(), STOP_WAIT_S)
        # Drain flushes what handlers already answered; bounded, since a pull subscription
        # with an open fetch can otherwise hold it for nats-py's 30 s default.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.nc.drain(), 2.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.nc.close(), STOP_WAIT_S)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.redis.aclose(), STOP_WAIT_S)

    async def _prune_runs(self) -> None:
        """Ended runs whose keys expired leave the runs index, about when they expire."""
        every, due = min(60.0, max(0.2, self.cfg.retention_s / 4)), 0.0
        while not self.soft.stopping:  # short sleeps: it ends soon after stopping, like the rest
            if time.monotonic() >= due:
                await self.runs.prune()
                due = time.monotonic() + every
            await asyncio.sleep(min(every, 0.5))

    async def _supervised(self, loop: Callable[[], Awaitable[None]]) -> None:
        """Run a background loop; transient broker errors are retried, never silently fatal."""
        while not self.soft.stopping:
            try:
                await loop()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s failed; restarting it in 0.5s", loop.__qualname__)
                await asyncio.sleep(0.5)

    async def _serve(self, subject: str, kind: type[M], handler: Callable[..., Awaitable[Any]],
                     owner: Callable[[M], str] | None = None, ordered: bool = False,
                     refuse: Callable[[bytes, str], msgspec.Struct | None] | None = None
                     ) -> None:
        """Answer with ``handler`` one message at a time; ``ordered``, in order per instance
        subject but concurrently across instances (all in one queue, heartbeats came late and
        leases expired); the subject names the instance, so nothing is decoded to queue it.
        With ``owner``, a message must come on the subject of the instance it names, and is
        answered only on that instance's own inbox; ``handler`` is then given the key
        fingerprint the subject names too ("" none: :func:`shared.names.subject_owner`), as
        its second argument. The manager answers with its own
        permissions, so a reply subject of the sender's choosing (a JetStream API subject, or
        another instance's) would have the manager act for the sender: such a message is
        dropped unanswered, and any other request is answered only on an ``_INBOX.`` subject.
        ``refuse`` sees each message (and its sender) before it is decoded: what it returns
        is the answer, and the handler never runs (the heartbeat's protocol version gate)."""
        async def callback(msg: NatsMsg, after: asyncio.Task[None] | None = None) -> None:
            if after is not None:
                await asyncio.wait([after])
                self._waiting.discard(msg.subject)
            sender, key = names.subject_owner(msg.subject) if owner is not None else ("", "")
            answer = bool(msg.reply) and (names.is_own_inbox(sender, msg.reply) if sender
                                          else owner is None and
                                          msg.reply.startswith(names.INBOX + "."))
            try:
                if owner is not None and not sender:
                    raise ProtocolError(kind.__name__, f"subject {msg.subject[:120]!r} names "
                                        "no instance")
                if msg.reply and not answer:
                    raise ProtocolError(kind.__name__, f"reply subject {msg.reply[:80]!r} is "
                                        "not the sender's inbox")
                refusal = refuse(msg.data, sender) if refuse is not None else None
                request = None if refusal is not None else decode(msg.data, kind)
                if request is not None and owner is not None and owner(request) != sender:
                    raise ProtocolError(kind.__name__, "instance id differs from its subject's")
            except ProtocolError as exc:
                self.metrics.malformed.labels(subject).inc()
                self._dropped.warning("dropped %s", str(exc)[:300])  # a flood: counted
                reply: msgspec.Struct = Ack(ok=False, detail=str(exc))
            else:
                call = handler if owner is None else functools.partial(handler, key=key)
                reply = refusal or Ack(ok=False) if request is None else \
                    await self._handle(subject, call, request)
            if answer:
                with contextlib.suppress(Exception):
                    await msg.respond(encode(reply))

        async def spawn(msg: NatsMsg) -> None:
            self._spawn(msg, callback)

        # One queue group: of several manager replicas, each request reaches exactly one.
        await self.nc.subscribe(subject, queue=SERVE_QUEUE, cb=spawn if ordered else callback,
                                pending_bytes_limit=PENDING_BYTES)

    async def _handle(self, subject: str, handler: Callable[[M], Awaitable[Any]],
                      request: M) -> Any:
        """``handler``'s answer to a decoded ``request``; a failure answers an Ack saying so."""
        try:
            return await handler(request)
        except RedisError as exc:  # Redis restarting: the sender should try again
            self.metrics.handler_errors.labels(subject).inc()
            log.warning("%s: state store unavailable (%s)", subject, exc)
            return Ack(ok=False, detail="state store unavailable", retryable=True)
        except Exception as exc:
            self.metrics.handler_errors.labels(subject).inc()
            log.exception("handler for %s failed", subject)
            return Ack(ok=False, detail=f"manager error: {type(exc).__name__}")

    def _spawn(self, msg: NatsMsg, callback: Callable[[NatsMsg, asyncio.Task[None] | None],
                                                      Coroutine[Any, Any, None]]) -> None:
        """Start ``callback`` on ``msg`` after the handler of the same subject (one instance's
        beats, or its releases) before it. One waits per subject at most: a newer beat while
        one waits is shed (the waiting one renews the same leases), so a flood costs two
        tasks, not one each; and past MAX_HANDLERS in all, any is. Shed requests go unanswered
        and are counted."""
        tag = msg.subject
        shed = "pending" if tag in self._waiting else \
            "busy" if self._handlers >= MAX_HANDLERS else None
        if shed is not None:
            self.metrics.shed.labels(shed).inc()
            return
        after = self._tails.get(tag)
        task = asyncio.create_task(callback(msg, after))
        self._handlers += 1
        if after is not None:
            self._waiting.add(tag)
        self._tails[tag] = task  # the newest per key; each task holds the one before it
        task.add_done_callback(lambda t: self._ended(tag, t))

    def _ended(self, tag: str, task: asyncio.Task[None]) -> None:
        self._handlers -= 1
        if self._tails.get(tag) is task:
            self._tails.pop(tag)
            self._waiting.discard(tag)  # cancelled while waiting, at stop
