"""Frame ingest and the barrier: the manager's exactly-once path from the stream to Redis.

Contract: token frames (one per rollout-instance flush, an entry per response) arrive through
the durable JetStream consumer and are committed in stream order by
:meth:`~manager_svc.accounting.Ledger.commit_many`, a batch in one Redis round trip, and acked
only after their commit, so a manager killed at any point replays at most the unacked batch,
whose entries the ledger then drops as duplicates. A malformed frame is counted, logged and
terminated (never redelivered), and so is a frame whose instance is not its subject's. Within a
frame, an entry that is forged (its MAC or run does not check out:
:mod:`manager_svc.chunk_auth`; counted as the step's ``forged_chunks_rejected``) or has a
negative offset or a token id outside the run's vocabulary (``invalid_chunks_dropped``) is
dropped alone: no such entry reaches the commit script, the frame's others do. A group or step
completed by a commit is announced (``GroupDone``), and a completed step freezes its digest and
announces the barrier (the dispatcher calls :meth:`ChunkIngest.barrier` too, for a complete
step whose barrier a killed manager never announced).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter

import msgspec
import redis.asyncio as aioredis
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg as NatsMsg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from manager_svc.accounting import Ledger
from manager_svc.chunk_auth import ChunkAuth, invalid
from manager_svc.metrics import ManagerMetrics
from manager_svc.runs import RunStore
from manager_svc.soft_state import SoftState
from shared import names
from shared.errors import ProtocolError
from shared.names import Keys, request_id
from shared.process import wait_event
from shared.protocol import (
    MESSAGE_BUDGET,
    Barrier,
    FrameEntry,
    GroupDone,
    RunSpec,
    Sample,
    TokenFrame,
    decode,
    encode,
)

log = logging.getLogger("manager")
# Frames pulled, committed in one Redis round trip (one AOF fsync) and acked together.
FETCH_BATCH, FETCH_WAIT_S = 512, 0.5
PULL_NEXT = f"$JS.API.CONSUMER.MSG.NEXT.{names.CHUNK_STREAM}.{names.CHUNK_CONSUMER}"
CREATE_CONSUMER = (f"$JS.API.CONSUMER.CREATE.{names.CHUNK_STREAM}.{names.CHUNK_CONSUMER}."
                   f"{names.CHUNK_WILDCARD}")
UNPIN = f"$JS.API.CONSUMER.UNPIN.{names.CHUNK_STREAM}.{names.CHUNK_CONSUMER}"
INGEST_GROUP = "managers"  # the consumer's one priority group: every replica pulls in it
PIN_HEADER = "Nats-Pin-Id"
CACHE_SIZE = 64  # steps whose vocabulary size, and runs whose spec, are remembered


async def bind_consumer(nc: Nats, ack_wait_s: float) -> None:
    """Create the managers' shared durable chunk consumer, or bring an existing one to this
    configuration. A plain bind kept whatever an older manager created: a stream that outlived
    an upgrade kept its 30 s ack_wait, and with it the 20 s ingest stalls after a manager
    SIGKILL that the lease-long ack_wait removed. ack_wait, max_ack_pending and the priority
    group are editable in place; the server answers an identical configuration with the
    consumer as it is.

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


class ChunkIngest:
    def __init__(self, redis: aioredis.Redis, nc: Nats, ledger: Ledger, runs: RunStore,
                 metrics: ManagerMetrics, soft: SoftState, auth: ChunkAuth,
                 ack_wait_s: float = 3.0) -> None:
        self.redis = redis
        # How long frames pulled by a manager that died stay with it before JetStream delivers
        # them again; the manager's lease TTL, so a restart stalls ingest no longer than a
        # lost lease stalls a response. At the 30 s this was, the fault campaign saw runs
        # stand still ~21 s after a manager SIGKILL (3 of 438 heals over the 6.5 s bound).
        # A batch slower than this to commit is delivered twice: the commit script drops the
        # second copy as duplicate chunks, so only work is lost, never a token counted twice.
        self.ack_wait_s = ack_wait_s
        self.nc = nc
        self.ledger = ledger
        self.runs = runs
        self.metrics = metrics
        self.soft = soft
        self.auth = auth
        self._vocab: dict[str, int] = {}  # step key -> the run's vocabulary size (0: unknown)
        self._specs: dict[str, RunSpec] = {}  # run id -> its spec, written once at submission
        self.pin: str | None = None  # the chunk stream's pin id while this replica holds it
        self._in_flight = False  # a pulled batch is being committed and is not acked yet
        self._barriers: dict[tuple[str, int], asyncio.Future[None]] = {}  # being made now

    async def leave(self) -> None:
        """After the last ack: a waiting replica takes the stream over now, not in a TTL.
        With a batch cut short (pulled, perhaps committed, not acked) the pin is kept: its
        frames come back after ack_wait, when the pin moves anyway, and so still come first
        to the next replica (handed over at once, it would see later frames first: gaps)."""
        if self.pin is not None and not self._in_flight:
            self.pin = None
            self.metrics.ingest_pinned.set(0)
            await unpin(self.nc)

    async def consume(self) -> None:
        """Pull FETCH_BATCH at a time, one request outstanding (so in stream order), answered
        into a callback subscription: nats-py's ``fetch`` costs two tasks per message."""
        await bind_consumer(self.nc, self.ack_wait_s)
        inbox, arrived, batch = self.nc.new_inbox(), asyncio.Event(), list[NatsMsg]()
        due = [0, 0.0]  # messages the outstanding request may still bring, and its expiry

        async def on_msg(msg: NatsMsg) -> None:
            status = JetStreamContext.is_status_msg(msg)
            if status is None:
                batch.append(msg)
                due[0] -= 1
                pin = (msg.headers or {}).get(PIN_HEADER)
                if pin and pin != self.pin:
                    log.info("ingest: this replica now commits the chunk stream")
                    self.metrics.ingest_pinned.set(1)
                    self.pin = pin
            elif status == "423":  # the pin moved to another replica: wait as a standby
                log.info("ingest: another replica commits the chunk stream now")
                self.metrics.ingest_pinned.set(0)
                self.pin, due[0] = None, 0
            elif status != "100":  # 404/408/409 end a request (100 is an idle heartbeat)
                due[0] = 0
            arrived.set()

        sub = await self.nc.subscribe(inbox, cb=on_msg)
        try:
            # A request lost to a broker restart never answers: its expiry ends it. A standby
            # replica's requests (no pin id) are held by the server until the pin is free.
            while not self.soft.stopping:
                if due[0] <= 0 or time.monotonic() > due[1]:
                    due[:] = [FETCH_BATCH, time.monotonic() + FETCH_WAIT_S]
                    pull: dict[str, str | int] = {
                        "batch": FETCH_BATCH, "expires": int(FETCH_WAIT_S * 1e9),
                        "group": INGEST_GROUP}
                    if self.pin is not None:
                        pull["id"] = self.pin
                    await self.nc.publish(PULL_NEXT, reply=inbox,
                                          payload=json.dumps(pull).encode())
                if not batch:
                    arrived.clear()
                    await wait_event(arrived, FETCH_WAIT_S)
                taken, batch[:] = batch[:], []
                self._in_flight = True
                await self._ingest(taken)
                self._in_flight = False
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _ingest(self, batch: list[NatsMsg]) -> None:
        """Commit a batch in stream order in one round trip, send its events, then ack it: a
        batch is acked only once committed, so after a crash it returns as duplicates."""
        frames: list[TokenFrame] = []
        keep: list[NatsMsg] = []  # acked after the commit; the rest are terminated now
        for msg in batch:
            try:
                frame = decode(msg.data, TokenFrame)
                for entry in frame.entries:
                    names.parse_request_id(entry.request_id)
            except (ProtocolError, ValueError) as exc:
                self.metrics.malformed.labels(names.CHUNK_WILDCARD).inc()
                log.warning("dropped frame: %s", str(exc)[:200])
                await msg.term()
                continue
            if (why := self.auth.forged_frame(frame, msg.subject)) is not None:
                for entry in frame.entries:
                    await self._reject(frame, entry, msg.subject, "forged", why)
                await msg.term()
                continue
            keep.append(msg)
            kept = [e for e in frame.entries if await self._admissible(msg, frame, e)]
            if kept:
                frame.entries = kept
                frames.append(frame)
        results = iter(await self.ledger.commit_many(frames, wait_for_redis=True))
        # Counted once per batch, not per entry: a labelled counter costs microseconds a call.
        statuses: Counter[str] = Counter()
        tokens = discarded = 0
        ended: list[tuple[str, int, int]] = []  # groups complete, in commit order
        barriers: list[tuple[str, int]] = []  # steps complete
        for frame in frames:
            for entry in frame.entries:
                status = next(results).status
                statuses[status] += 1
                if status in ("ok", "final", "group", "step"):
                    tokens += len(entry.token_ids)
                elif status == "aborted":  # its step closed without it (dynamic sampling)
                    discarded += len(entry.token_ids)
                if status in ("gap", "wrong_version", "overlong"):
                    self._taken_back(frame, entry, status)
                elif status in ("group", "step"):
                    run_id, step, prompt, _ = names.parse_request_id(entry.request_id)
                    ended.append((run_id, step, prompt))
                    if status == "step":
                        barriers.append((run_id, step))
        # Every group a batch completed is read in one round trip and announced before the
        # barrier of its step (one read per group was a round trip each, inside the loop).
        await self._announce_groups(ended)
        for run_id, step in barriers:
            await self.barrier(run_id, step)
        for status, n in statuses.items():
            self.metrics.chunks.labels(status).inc(n)
        self.metrics.tokens.inc(tokens)
        self.metrics.discarded.inc(discarded)
        for msg in keep:
            await msg.ack()

    def _taken_back(self, frame: TokenFrame, entry: FrameEntry, status: str) -> None:
        """The commit script revoked the entry's response: dispatch leases it again."""
        self.metrics.revocations.labels(status).inc()
        log.info("entry of %s from %s: %s; taken back", entry.request_id, frame.instance_id,
                 status)
        self.soft.wake.set()

    async def _admissible(self, msg: NatsMsg, frame: TokenFrame, entry: FrameEntry) -> bool:
        """From its lease holder (MAC, subject) and committable at all (offset, vocabulary);
        anything else is counted against its step, logged, and never committed."""
        run_id, step, _, _ = names.parse_request_id(entry.request_id)
        if (why := self.auth.forged(frame, entry, msg.subject)) is not None:
            await self._reject(frame, entry, msg.subject, "forged", why)
        elif (why := invalid(entry, await self._vocab_size(Keys.step(run_id, step)))) is not None:
            await self._reject(frame, entry, msg.subject, "invalid", why)
        else:
            return True
        return False

    async def _reject(self, frame: TokenFrame, entry: FrameEntry, subject: str, result: str,
                      why: str) -> None:
        run_id, step, _, _ = names.parse_request_id(entry.request_id)
        skey = Keys.step(run_id, step)
        self.metrics.chunks.labels(result).inc()
        if result == "forged":
            self.metrics.forged.inc()
        log.warning("%s entry of %s as %s on %s: %s", result, entry.request_id[:100],
                    frame.instance_id, subject[:120], why)
        counter = "forged_chunks_rejected" if result == "forged" else "invalid_chunks_dropped"
        if await self.redis.exists(skey):  # never a key for a step that does not exist
            await self.redis.hincrby(skey, counter, 1)

    async def _vocab_size(self, skey: str) -> int:
        size = self._vocab.get(skey)
        if size is None:
            stored = await self.redis.hget(skey, "vocab")
            size = int(stored or 0)
            if len(self._vocab) >= CACHE_SIZE:
                self._vocab.clear()
            # Written with the step's creation, so once there it is final, 0 (not checked)
            # included: not caching 0 cost a Redis round trip per entry of such runs.
            if stored is not None:
                self._vocab[skey] = size
        return size

    async def _spec(self, run_id: str) -> RunSpec | None:
        spec = self._specs.get(run_id)
        if spec is None:
            spec = await self.runs.spec(run_id)  # a read and a decode: once, not per group
            if spec is not None:
                if len(self._specs) >= CACHE_SIZE:
                    self._specs.clear()
                self._specs[run_id] = spec
        return spec

    async def _announce_groups(self, groups: list[tuple[str, int, int]]) -> None:
        """Tell the trainer these groups are complete, each with its samples when they fit."""
        wanted: list[tuple[tuple[str, int, int], int]] = []
        for group in groups:
            spec = await self._spec(group[0])
            if spec is not None:  # else the run's record is gone: nobody trains the group
                wanted.append((group, spec.samples_per_prompt))
        rids = [request_id(*group, s) for group, n in wanted for s in range(n)]
        by_group: dict[tuple[str, int, int], list[Sample]] = {}
        for sample in await self.ledger.samples(rids):  # in (prompt, sample) order
            run_id, step, prompt, _ = names.parse_request_id(sample.request_id)
            by_group.setdefault((run_id, step, prompt), []).append(sample)
        for (run_id, step, prompt), _ in wanted:
            event = encode(GroupDone(run_id=run_id, step=step, prompt_index=prompt,
                                     samples=by_group.get((run_id, step, prompt), [])))
            if len(event) > MESSAGE_BUDGET:  # the trainer pages it in after the barrier
                event = encode(GroupDone(run_id=run_id, step=step, prompt_index=prompt))
            await self.nc.publish(names.group_subject(run_id), event)

    async def barrier(self, run_id: str, step: int) -> None:
        """Every response of the step is complete, once: freeze the digest and announce it.

        Ingest (the commit that completed the step) and the dispatcher (a complete step still
        in rollout) both call this; until the state says training, the dispatcher's every
        pass found the step complete and read all of it again alongside ingest. A barrier
        this replica is already making is waited for, not made twice."""
        key = (run_id, step)
        running = self._barriers.get(key)
        if running is None:
            running = self._barriers[key] = asyncio.ensure_future(self._barrier(run_id, step))
            running.add_done_callback(lambda _: self._barriers.pop(key, None))
        await asyncio.shield(running)

    async def _barrier(self, run_id: str, step: int) -> None:
        digest = await self.ledger.done_digest(run_id, step)
        await self.redis.hset(Keys.step(run_id, step), mapping={
            "state": "training", "rollout_done_at": time.time(),
            "digest": msgspec.json.encode(digest).decode(),
        })
        log.info("barrier %s step %d: %d responses, %d tokens", run_id, step,
                 digest.responses, digest.tokens)
        await self.nc.publish(names.barrier_subject(run_id),
                              encode(Barrier(run_id=run_id, step=step, digest=digest)))

