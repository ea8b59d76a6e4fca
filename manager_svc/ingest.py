"""Frame ingest: the manager's exactly-once path from the stream to Redis.

Contract: token frames (one per rollout-instance flush, an entry per response) arrive through
the durable JetStream consumer and are committed in stream order by group commit (the frames
that arrive while a commit runs are checked and go in the next), on a
:class:`~manager_svc.commit_stream.CommitStream` (the next commit queued in Redis behind the
one running, on one connection, so in order) or, on a cluster client or with replica acks, one
commit at a time; and acked only after their commit, so a manager killed at any point replays
at most the unacked frames, whose entries the ledger then drops as duplicates. A malformed
frame is counted, logged and terminated (never redelivered), and so is a frame whose instance
is not its subject's. Within a frame, an entry that is forged (its MAC or run does not check
out: :mod:`manager_svc.chunk_auth`; counted as the step's ``forged_chunks_rejected``) or has a
negative offset or a token id outside the run's vocabulary (``invalid_chunks_dropped``) is
dropped alone: no such entry reaches the commit script, the frame's others do; each is counted
by reason, logged in a sum per instance now and then, and enough of them quarantine their sender
(:mod:`manager_svc.quarantine`). What a commit completed is announced by
:mod:`manager_svc.announce` (group events, then the barrier of a completed step; the dispatcher
calls :meth:`ChunkIngest.barrier` too, for a complete step whose barrier a killed manager never
announced) before its frames are acked. How each part of this path came to be as it is, with
the measurements, is in docs/ingest-history.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg as NatsMsg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from redis.exceptions import RedisError

from manager_svc.accounting import COMMIT_SLICE, Ledger, commit_statuses
from manager_svc.announce import Announcer
from manager_svc.chunk_auth import ChunkAuth, Rejections, invalid
from manager_svc.commit_stream import PIPELINED, CommitStream
from manager_svc.metrics import ManagerMetrics
from manager_svc.quarantine import Quarantine
from manager_svc.runs import RunStore
from manager_svc.scripts import Call
from manager_svc.soft_state import SoftState
from shared import names
from shared.digest import token_json
from shared.errors import ProtocolError
from shared.names import Keys
from shared.process import wait_event
from shared.protocol import FrameEntry, InstanceKind, TokenFrame, decode

log = logging.getLogger("manager")
# Frames one pull request asks for, and how long it waits for them.
FETCH_BATCH, FETCH_WAIT_S = 512, 0.5
SETTLING = 2  # parts committed and being announced while the next commit runs
GROUP_MAX = 4096  # entries one commit takes at most (16 script calls)
PULL_NEXT = f"$JS.API.CONSUMER.MSG.NEXT.{names.CHUNK_STREAM}.{names.CHUNK_CONSUMER}"
CREATE_CONSUMER = (f"$JS.API.CONSUMER.CREATE.{names.CHUNK_STREAM}.{names.CHUNK_CONSUMER}."
                   f"{names.CHUNK_WILDCARD}")
UNPIN = f"$JS.API.CONSUMER.UNPIN.{names.CHUNK_STREAM}.{names.CHUNK_CONSUMER}"
INGEST_GROUP = "managers"  # the consumer's one priority group: every replica pulls in it
PIN_HEADER = "Nats-Pin-Id"
CACHE_SIZE = 64  # steps whose vocabulary size is remembered
KIND_TTL_S = 5.0  # how long a sender's registered kind is taken as known
KINDS_MAX = 8192  # senders whose kind is remembered
# Acks sent between yields to the event loop: a part's acks in one stretch would hold the
# answer of the commit in flight, and with it the next commit, while Redis stands idle.
YIELD_EVERY = 64


async def bind_consumer(nc: Nats, ack_wait_s: float) -> None:
    """Create the managers' shared durable chunk consumer, or bring an existing one to this
    configuration: bound as it is, a consumer an older manager created would keep its own
    ack_wait, and ingest would stall that long after a manager SIGKILL. ack_wait,
    max_ack_pending and the priority group are editable in place; the server answers an
    identical configuration with the consumer as it is.

    The consumer is one priority group with the ``pinned_client`` policy: of all the manager
    replicas pulling from it, the server delivers to one at a time (the pinned one) and moves
    the pin to a waiting replica when the pinned one has not pulled for a lease TTL (or says
    it is leaving: :func:`unpin`). Frames of one response are then committed in the order
    their instance sent them, whichever replica is up; two replicas committing interleaved
    frames of one response would each see the other's offsets as gaps and revoke the lease."""
    config = ConsumerConfig(
        durable_name=names.CHUNK_CONSUMER, filter_subject=names.CHUNK_WILDCARD,
        ack_policy=AckPolicy.EXPLICIT, ack_wait=ack_wait_s, max_ack_pending=65536).as_dict()
    # nats-py's ConsumerConfig has no priority fields yet: the JetStream API takes them as JSON.
    # The pin moves no sooner than the dead replica's pulled frames are redelivered (ack_wait),
    # so its successor commits them before anything the instances sent later.
    config.update(priority_groups=[INGEST_GROUP], priority_policy="pinned_client",
                  priority_timeout=int(ack_wait_s * 1e9))
    reply = await nc.request(CREATE_CONSUMER, json.dumps(
        {"stream_name": names.CHUNK_STREAM, "config": config}).encode(), timeout=10)
    error = json.loads(reply.data).get("error")
    if error:
        raise RuntimeError(f"chunk consumer: {error.get('description', error)}")


async def unpin(nc: Nats) -> None:
    """Hand the chunk stream's pin to a waiting replica now rather than after a TTL."""
    with contextlib.suppress(Exception):
        await nc.request(UNPIN, json.dumps({"group": INGEST_GROUP}).encode(), timeout=2)


@dataclass
class _Part:
    """Frames checked and packed for one commit, and the messages it acks."""

    frames: list[TokenFrame] = field(default_factory=list)
    keep: list[NatsMsg] = field(default_factory=list)  # acked after the commit
    entries: int = 0
    calls: list[Call] = field(default_factory=list)


class ChunkIngest:
    def __init__(self, redis: aioredis.Redis, nc: Nats, ledger: Ledger, runs: RunStore,
                 metrics: ManagerMetrics, soft: SoftState, auth: ChunkAuth,
                 ack_wait_s: float = 3.0, quarantine: Quarantine | None = None) -> None:
        self.redis = redis
        # How long frames pulled by a manager that died stay with it before JetStream delivers
        # them again; the manager's lease TTL, so a restart stalls ingest no longer than a
        # lost lease stalls a response. A batch slower than this to commit is delivered
        # twice: the commit script drops the second copy as duplicate chunks, so only work
        # is lost, never a token counted twice.
        self.ack_wait_s = ack_wait_s
        self.nc = nc
        self.ledger = ledger
        self.runs = runs
        self.metrics = metrics
        self.soft = soft
        self.auth = auth
        # Counts and logs what is dropped, and quarantines an instance that sends garbage.
        self.quarantine = quarantine or Quarantine(redis, nc, ledger, runs, metrics, soft)
        self.rejects = Rejections(redis, metrics)
        self._vocab: dict[str, int] = {}  # "<run>:<step>" -> its vocabulary size (0: unknown)
        self._kinds: dict[str, tuple[float, bool]] = {}  # sender -> (read at, reserved?)
        self.pin: str | None = None  # the chunk stream's pin id while this replica holds it
        self.in_flight = 0  # frames pulled and not yet acked or terminated
        self.announcer = Announcer(redis, nc, ledger, runs, metrics, soft)
        self.stream = CommitStream(redis) if CommitStream.usable(
            redis, ledger.replica_acks) else None

    async def barrier(self, run_id: str, step: int) -> None:
        """:meth:`Announcer.barrier`: the dispatcher's and dynamic sampling's way in."""
        await self.announcer.barrier(run_id, step)

    async def leave(self) -> None:
        """After the last ack: a waiting replica takes the stream over now, not in a TTL.
        With a batch cut short (pulled, perhaps committed, not acked) the pin is kept: its
        frames come back after ack_wait, when the pin moves anyway, and so still come first
        to the next replica (handed over at once, it would see later frames first: gaps)."""
        if self.pin is not None and not self.in_flight:
            self.pin = None
            self.metrics.ingest_pinned.set(0)
            await unpin(self.nc)

    async def consume(self) -> None:
        """Bind the consumer and run one :class:`_PullLoop` until stopping (or a commit or a
        settle fails: the supervisor then starts another)."""
        await bind_consumer(self.nc, self.ack_wait_s)
        if self.stream is not None:
            with contextlib.suppress(RedisError):  # else the first commit connects
                await self.stream.ready([self.ledger.commit_script])
        self.in_flight = 0  # what a failed run left unacked comes back after ack_wait
        try:
            await _PullLoop(self).run()
        finally:  # the loop has waited for its commits: nothing uses the stream now
            if self.stream is not None:
                await self.stream.close()

    async def check(self, taken: deque[NatsMsg], part: _Part) -> None:
        """Decode, check and pack frames from the left of ``taken`` into ``part``, up to
        COMMIT_SLICE entries (one script call) at a time; a frame that cannot be committed at
        all is terminated now, and a bad entry is counted and dropped alone."""
        frames: list[TokenFrame] = []
        texts: list[list[bytes]] = []  # per frame kept, each entry's ids as JSON (token_json)
        entries = 0
        while taken and entries < COMMIT_SLICE:
            msg = taken.popleft()
            subject_run = msg.subject.split(".")[2]
            try:
                frame = decode(msg.data, TokenFrame)
            except ProtocolError as exc:
                self.metrics.malformed.labels(names.CHUNK_WILDCARD).inc()
                log.warning("dropped frame: %s", str(exc)[:200])
                await self._term(msg)
                continue
            if (why := self.auth.forged_frame(frame, msg.subject)) is not None:
                for entry in frame.entries:
                    await self._reject(frame, entry, msg.subject, "forged", why)
                await self._term(msg)
                continue
            part.keep.append(msg)
            if frame.kind != "spot":
                frame.kind = await self._sender_kind(frame, msg.subject)
            kept, kept_texts = [], []
            for entry in frame.entries:
                # "<run>:<step>:<prompt>:<sample>", no colon in a run id, once its MAC checks
                # out (the manager leased it); split once here, not parsed whole per check.
                scope = entry.request_id.rsplit(":", 2)[0]
                run_id = scope.partition(":")[0]
                if (why := self.auth.forged(frame, entry, run_id, subject_run)) is not None:
                    await self._reject(frame, entry, msg.subject, "forged", why)
                    continue
                size = self._vocab.get(scope)
                if size is None:
                    size = await self._vocab_size(scope)
                ids = entry.token_ids if entry.whole else []
                if (why := invalid(entry, size, ids)) is not None:
                    await self._reject(frame, entry, msg.subject, "invalid", why)
                else:
                    kept.append(entry)
                    kept_texts.append(token_json(ids))
            if kept:
                frame.entries = kept
                frames.append(frame)
                texts.append(kept_texts)
                entries += len(kept)
        await self.rejects.flush()  # one round trip for every entry dropped above
        part.frames += frames
        part.entries += entries
        part.calls += self.ledger.pack(frames, texts)

    async def _term(self, msg: NatsMsg) -> None:
        await msg.term()
        self.in_flight -= 1

    async def _reject(self, frame: TokenFrame, entry: FrameEntry, subject: str, result: str,
                      why: str) -> None:
        self.rejects.add(frame, entry, subject, result, why)  # counted in Redis by check()
        # rlb.chunk.<run>.<instance>[.<key>]: who sent it, where
        sender, key = names.chunk_sender(subject)
        await self.quarantine.reject(subject.split(".")[2], sender or frame.instance_id, why,
                                     key)

    async def _sender_kind(self, frame: TokenFrame, subject: str) -> InstanceKind:
        """The kind a frame claiming ``reserved`` is counted as: its sender's registered kind
        (the registry takes that from the credential), else spot, counted. The step's
        ``tokens_reserved`` and first/last times feed the seeding controller: a spot instance
        claiming reserved would skew them. Read from Redis once per KIND_TTL_S per sender."""
        sender = names.chunk_sender(subject)[0] or frame.instance_id
        now = time.monotonic()
        known = self._kinds.get(sender)
        if known is None or now - known[0] > KIND_TTL_S:
            if len(self._kinds) >= KINDS_MAX:
                self._kinds.clear()
            kind = await self.redis.hget(Keys.instance(sender), "kind")
            known = self._kinds[sender] = (now, kind == "reserved")
        if known[1]:
            return "reserved"
        self.metrics.kind_refused.inc()
        return "spot"

    async def _vocab_size(self, scope: str) -> int:
        """The vocabulary size of step ``scope`` ("<run>:<step>"), read once per step."""
        run_id, _, step = scope.partition(":")
        stored = await self.redis.hget(Keys.step(run_id, int(step)), "vocab")
        if len(self._vocab) >= CACHE_SIZE:
            self._vocab.clear()
        # Written with the step's creation, so once there it is final, 0 (not checked)
        # included: cached too, or such a run would cost a Redis round trip per entry.
        if stored is not None:
            self._vocab[scope] = int(stored)
        return int(stored or 0)


class _PullLoop:
    """One run of :meth:`ChunkIngest.consume`: pull FETCH_BATCH frames at a time, one request
    outstanding (so in stream order), answered into a callback subscription (:meth:`on_msg`;
    nats-py's ``fetch`` costs two tasks per message), and commit them by group commit.

    While Redis runs one commit, this loop decodes and checks the frames that arrived, and the
    next commit takes all of them: sent once the last one has answered or, on a commit stream,
    queued behind it (:meth:`_may_send`). So commits run in stream order and grow with the
    load: each round trip and AOF fsync serves whatever queued behind it, where commits of a
    fixed size would pay one each, and Redis does not stand idle while this loop reads one
    commit's answer and sends the next. A committed part is then settled (announced, then
    acked) behind it while the next commit runs."""

    def __init__(self, ingest: ChunkIngest) -> None:
        self.ingest = ingest
        self.inbox = ingest.nc.new_inbox()
        self.arrived = asyncio.Event()  # on_msg has put something in batch, or a status
        self.batch: list[NatsMsg] = []  # delivered, not yet taken
        self.taken: deque[NatsMsg] = deque()  # pulled, not yet checked
        self.part = _Part()  # checked and packed, waiting for the commit in flight to answer
        self.commits: deque[asyncio.Future[list[str]]] = deque()  # sent, in order
        self.newest = 0  # entries of the commit sent last
        self.settles: deque[asyncio.Future[None]] = deque()  # parts committed, not yet settled
        self.announced: asyncio.Future[None] | None = None  # the newest part's announcements
        self.due = 0  # messages the outstanding pull request may still bring
        self.expires = 0.0  # when it ends (monotonic)

    async def on_msg(self, msg: NatsMsg) -> None:
        """A pulled frame, or a status that ends the request or moves the pin."""
        ingest = self.ingest
        status = JetStreamContext.is_status_msg(msg)
        if status is None:
            self.batch.append(msg)
            self.due -= 1
            pin = (msg.headers or {}).get(PIN_HEADER)
            if pin and pin != ingest.pin:
                log.info("ingest: this replica now commits the chunk stream")
                ingest.metrics.ingest_pinned.set(1)
                ingest.pin = pin
        elif status == "423":  # the pin moved to another replica: wait as a standby
            log.info("ingest: another replica commits the chunk stream now")
            ingest.metrics.ingest_pinned.set(0)
            ingest.pin, self.due = None, 0
        elif status != "100":  # 404/408/409 end a request (100 is an idle heartbeat)
            self.due = 0
        self.arrived.set()

    async def run(self) -> None:
        ingest = self.ingest
        sub = await ingest.nc.subscribe(self.inbox, cb=self.on_msg)
        try:
            # A request lost to a broker restart never answers: its expiry ends it. A standby
            # replica's requests (no pin id) are held by the server until the pin is free.
            # Stopping, what was pulled is still committed: else it waits out ack_wait.
            while not ingest.soft.stopping or self.taken or self.part.keep:
                if not ingest.soft.stopping and (
                        self.due <= 0 or time.monotonic() > self.expires):
                    await self._pull()
                ingest.in_flight += len(self.batch)
                self.taken.extend(self.batch)
                self.batch.clear()
                if self.taken and self.part.entries < GROUP_MAX:
                    await ingest.check(self.taken, self.part)
                    await asyncio.sleep(0)  # the commit in flight may answer meanwhile
                elif self.part.keep and not self._may_send():
                    # nothing else to check: the oldest commit's answer is next
                    await asyncio.wait([next(c for c in self.commits if not c.done())])
                elif not self.part.keep:
                    self.arrived.clear()
                    await wait_event(self.arrived, FETCH_WAIT_S)
                    continue
                if self.part.keep and self._may_send():
                    await self._send()
        finally:
            # Committed and acked, or returned by JetStream after ack_wait.
            pending: list[asyncio.Future[Any]] = [*self.settles, *self.commits]
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.gather(*pending)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _pull(self) -> None:
        """Ask for the next FETCH_BATCH frames, answered on this loop's inbox."""
        self.due, self.expires = FETCH_BATCH, time.monotonic() + FETCH_WAIT_S
        pull: dict[str, str | int] = {
            "batch": FETCH_BATCH, "expires": int(FETCH_WAIT_S * 1e9), "group": INGEST_GROUP}
        if self.ingest.pin is not None:
            pull["id"] = self.ingest.pin
        await self.ingest.nc.publish(PULL_NEXT, reply=self.inbox,
                                     payload=json.dumps(pull).encode())

    def _may_send(self) -> bool:
        """Whether the part goes now: when no commit is in flight; on a commit stream also
        behind one that is, once the part is as large as the one in flight (up to
        GROUP_MAX) or nothing is left to check. So Redis has the next commit queued before
        it ends the one it runs, and a part holds what was checked during one commit:
        commits grow while Redis is the slower side and shrink while this loop is. (Waiting
        until a part was twice the one in flight left Redis idle between a backlog's early
        commits.)"""
        flying = sum(not c.done() for c in self.commits)
        return not flying or (self.ingest.stream is not None and flying < PIPELINED and (
            not self.taken or self.part.entries >= min(GROUP_MAX, self.newest)))

    async def _send(self) -> None:
        """Commit the part behind the commits sent, and settle it behind the part before."""
        commits, settles = self.commits, self.settles
        while commits and commits[0].done():
            commits.popleft().result()  # a commit that failed ends ingest here
        commit = asyncio.ensure_future(
            self._commit(self.part.calls, commits[-1] if commits else None))
        commits.append(commit)
        self.newest = self.part.entries
        before, self.announced = self.announced, asyncio.get_running_loop().create_future()
        settles.append(asyncio.ensure_future(
            self._settle(self.part, commit, before, self.announced)))
        self.ingest.announcer.track(settles[-1])
        self.part = _Part()
        while settles and (len(settles) > SETTLING or settles[0].done()):
            await settles.popleft()  # what a settle raised ends ingest here
        await asyncio.sleep(0)  # the commit goes out now, not after the next check

    async def _commit(self, calls: list[Call], before: asyncio.Future[Any] | None
                      ) -> list[str]:
        """A part's commit, after the one ``before`` it: pipelined behind it on the commit
        stream where there is one, else sent once that one has answered. Each entry's
        status, in order."""
        ingest = self.ingest
        again = functools.partial(ingest.ledger.run_replies, wait_for_redis=True)
        if ingest.stream is None:
            return commit_statuses(await again(calls))
        return commit_statuses(await ingest.stream.commit(calls, before, again))

    async def _settle(self, part: _Part, commit: asyncio.Future[list[str]],
                      before: asyncio.Future[None] | None,
                      announced: asyncio.Future[None]) -> None:
        """After the part's commit, and after the part before it has been announced: announce
        what it completed (``announced`` is then done, whatever became of it), then ack it. A
        part is acked only once committed, so after a crash it returns as duplicates; the next
        part's commit does not wait for this, nor does its announcement wait for these acks,
        which would hold the step's last groups back from the barrier."""
        ingest = self.ingest
        try:
            try:
                tally = ingest.announcer.tally(part.frames, iter(await commit))
                await ingest.announcer.announce(tally, before)
            finally:
                if not announced.done():
                    announced.set_result(None)
            for i, msg in enumerate(part.keep, 1):
                await msg.ack()  # a buffered write: it never yields by itself
                if not i % YIELD_EVERY:
                    await asyncio.sleep(0)  # the commit in flight's answer goes first
        finally:
            ingest.in_flight -= len(part.keep)
