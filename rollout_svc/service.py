"""One rollout instance: join, pull the step's weights, generate, stream token frames, leave.

Contract: the instance holds nothing the system needs. Its work arrives as leased assignments;
once any response has ``chunk_tokens`` new tokens (or ends) it flushes: one frame to the
durable chunk stream carrying the new tokens of all its responses, each entry stamped with its
lease epoch and a MAC under its lease's key; it renews its leases with each heartbeat.
It logs in to NATS with a key pair made for this process (:mod:`shared.identity`), under which
the manager's auth callout lets it use its own subjects only, each naming its id and its key's
fingerprint (:mod:`shared.names`); it holds the weights read token.
SIGTERM is a preemption notice: it stops taking work, commits what it has generated, hands its
responses back and exits within the grace period. SIGKILL is safe too: its leases expire and its
responses continue elsewhere from their last committed token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from nats.aio.client import Client as Nats
from nats.aio.msg import Msg as NatsMsg
from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry, Counter, Histogram

from rollout_svc.engines import Engine, EngineError, GenRequest
from rollout_svc.notice import NoticePoller
from shared import names
from shared.bus import connect_nats, request, request_bytes
from shared.config import RolloutConfig
from shared.errors import ProtocolError, RlboostError
from shared.identity import new_user_seed, public_key
from shared.mac import entry_mac
from shared.metrics import serve_metrics
from shared.process import cancel_and_wait, wait_event
from shared.protocol import (
    MESSAGE_BUDGET,
    Ack,
    Assignment,
    FrameEntry,
    Heartbeat,
    Held,
    Refused,
    Release,
    Revoke,
    TokenFrame,
    WeightsAnnounce,
    decode,
    decode_beat_reply,
    decode_command,
    encode,
)
from shared.settings import reveal
from shared.weights import PeerServer, PullStats, pull_version

log = logging.getLogger("rollout")


class RolloutMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.tokens = Counter("rlboost_rollout_tokens_generated_total", "Tokens generated",
                              registry=self.registry)
        self.chunks = Counter("rlboost_rollout_chunks_published_total",
                              "Response entries published (in token frames)",
                              registry=self.registry)
        self.frames = Counter("rlboost_rollout_frames_published_total", "Token frames published",
                              registry=self.registry)
        self.assigned = Counter("rlboost_rollout_assignments_total", "Responses assigned",
                                registry=self.registry)
        self.revoked = Counter("rlboost_rollout_revoked_total", "Responses whose lease was lost",
                               registry=self.registry)
        self.load_seconds = Histogram("rlboost_rollout_weight_load_seconds",
                                      "Pull + load time of a weight version",
                                      registry=self.registry)
        self.pulls = Counter("rlboost_rollout_weight_pulls_total",
                             "Weight versions pulled, by kind: full, delta, adapter or local",
                             ["kind"], registry=self.registry)
        self.pulled_bytes = Counter("rlboost_rollout_weight_pulled_bytes_total",
                                    "Bytes a pull fetched, by what: delta, service or peers",
                                    ["what"], registry=self.registry)
        self.delta_fallbacks = Counter(
            "rlboost_rollout_delta_fallbacks_total",
            "Offered deltas not used (a full pull instead), by reason: no_base, corrupt, "
            "error, mismatch", ["reason"], registry=self.registry)
        self.adapter_bases = Counter(
            "rlboost_rollout_adapter_bases_total",
            "Adapter versions loaded, by where their base came from: disk (held and verified),"
            " seeded (RLBOOST_SEEDED_BASES_DIR), pulled (none held) or replaced (the one held"
            " was not it)", ["source"],
            registry=self.registry)

    def count_pull(self, stats: PullStats) -> None:
        if stats.base is not None:  # an adapter version's base, pulled first
            self.count_pull(stats.base)
        if stats.base_source is not None:
            self.adapter_bases.labels(stats.base_source).inc()
        self.pulls.labels(stats.kind).inc()
        for what, n in (("delta", stats.delta_bytes), ("service", stats.bytes_from_service),
                        ("peers", stats.bytes_from_peers)):
            self.pulled_bytes.labels(what).inc(n)


@dataclass(slots=True)
class InFlight:
    """A response this instance generates under a lease."""

    assignment: Assignment
    offset: int  # next response position to publish (committed tokens count)
    buffer: list[int] = field(default_factory=list)
    # The buffered tokens' behaviour log-probs, while the engine gives one for every token
    # (once one is missing the response's would be incomplete, and none are sent).
    logprobs: list[float] | None = field(default_factory=list)
    final: bool = False
    finish_reason: str | None = None
    frozen: bool = False  # being handed back: generation stopped, only its buffer goes out
    # The frame in flight carries buffer[:sending] (kept in the buffer until acked, so that
    # positions still count from offset), and the final entry once final_sent.
    sending: int = 0
    final_sent: bool = False

    def flush_due(self, chunk_tokens: int) -> bool:
        """Enough new tokens for a flush (those in flight not counted), or its end unsent."""
        return not self.frozen and (
            (self.final and not self.final_sent) or len(self.buffer) - self.sending >= chunk_tokens)


class RolloutService:
    def __init__(self, cfg: RolloutConfig, engine: Engine) -> None:
        self.cfg = cfg
        self.engine = engine
        self.inflight: dict[str, InFlight] = {}
        # Responses whose final chunk is published but maybe not yet committed: they stay in the
        # heartbeat (keeping their lease alive) until the manager answers that the lease is
        # gone, so a slow commit is never mistaken for a lost assignment.
        self.finished: dict[str, int] = {}
        self.state = "starting"
        self._loading: asyncio.Task[None] | None = None
        self._target: tuple[str, int] | None = None  # what the manager last asked for
        self._wake = asyncio.Event()
        # Held while a frame goes out: a hand-back publishes a buffer only once no other publish
        # of it is in flight, so a response's entries and its offset stay in step.
        self._publishing = asyncio.Lock()
        self._flushing: asyncio.Task[None] | None = None  # the flush whose ack is awaited
        self._beat = asyncio.Event()  # set to send a heartbeat now rather than on the period
        self._stop = asyncio.Event()
        self._reason: str = "shutdown"
        self.weights_dir = cfg.common.data_dir / "rollout" / cfg.instance_id
        self._base_dir: Path | None = None  # the loaded adapter version's base, when it is one
        self.metrics = RolloutMetrics()
        self.metrics_port = 0
        self.session = secrets.token_hex(8)
        self.refused: str | None = None  # why the manager refused this instance, if it did
        self._nkey_seed = new_user_seed()  # this process's NATS identity, never written down
        # Its subjects name its key: another process that held the id before it, and is still
        # connected, can read none of its assignments (their lease keys) nor speak for it.
        self._key = names.fingerprint(public_key(self._nkey_seed))
        self._assigns = names.assign_subject(cfg.instance_id, self._key)
        self._beats = names.heartbeat_subject(cfg.instance_id, self._key)
        self._releases = names.release_subject(cfg.instance_id, self._key)
        self.nc: Nats
        self.js: JetStreamContext

    async def run(self) -> None:
        common = self.cfg.common
        self.metrics_port = serve_metrics(self.metrics.registry, common.metrics_addr,
                                          common.metrics_port)
        # Serves this instance's verified weight chunks to joining peers (shared.weights.peer).
        self.peer = PeerServer.from_config(self.weights_dir, reveal(common.weights_read_token),
                                           self.cfg.peer, common.tls)
        self.peer.start()
        # Long deadline: a login waits for the manager's auth callout, which may start later.
        self.nc = await connect_nats(common.nats_url, self.cfg.instance_id, deadline_s=120.0,
                                     nkey_seed=self._nkey_seed,
                                     inbox_prefix=names.inbox_prefix(self.cfg.instance_id),
                                     tls=common.tls.client())
        self.js = self.nc.jetstream()
        await self.nc.subscribe(self._assigns, cb=self._on_assign)
        await self.nc.subscribe(names.WEIGHTS_ANNOUNCE, cb=self._on_announce)
        log.info("instance %s (%s, %s engine) joining", self.cfg.instance_id, self.cfg.kind,
                 self.engine.name)
        tasks = [asyncio.create_task(self._heartbeat_loop()),
                 asyncio.create_task(self._generate_loop())]
        if self.cfg.notice != "off":
            poller = NoticePoller(self.cfg.notice, self.cfg.metadata_url, self.cfg.notice_poll_s)
            tasks.append(asyncio.create_task(poller.run(lambda: self.notice("preempt"))))
        stopper = asyncio.create_task(self._stop.wait())
        done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is not stopper and task.exception():
                log.error("background task died: %r", task.exception())
        try:
            await asyncio.wait_for(self._leave(tasks), timeout=max(self.cfg.grace_s, 1.0))
        except TimeoutError:
            log.warning("grace period of %.1fs ran out; leaving anyway", self.cfg.grace_s)
        with contextlib.suppress(Exception):
            await self.nc.close()
        await asyncio.to_thread(self.peer.close)

    def notice(self, reason: str = "preempt") -> None:
        """Preemption notice (SIGTERM) or operator stop (SIGINT): drain and leave."""
        if not self._stop.is_set():
            log.info("%s notice: draining", reason)
            self._reason = reason
            self.state = "draining"
            self._stop.set()
            self._wake.set()

    async def _leave(self, tasks: list[asyncio.Task[None]]) -> None:
        for task in tasks:
            await cancel_and_wait(task)
        await self._flushed()
        self.engine.drain()
        # Commit whatever was generated, so the next owner resumes after it, not before.
        await self._publish([(rid, item) for rid, item in self.inflight.items()
                             if item.buffer or item.final])
        held = [Held(request_id=rid, epoch=i.assignment.epoch, published=i.offset)
                for rid, i in self.inflight.items()]
        with contextlib.suppress(RlboostError):
            await request(self.nc, self._releases, Release(
                instance_id=self.cfg.instance_id, held=held, leaving=True,
                reason="preempt" if self._reason == "preempt" else "shutdown",
                session=self.session), Ack, 5.0)
        log.info("left; handed back %d responses", len(held))

    # --- heartbeat and weights -------------------------------------------------------------

    def _heartbeat(self) -> Heartbeat:
        loaded = self.engine.loaded
        return Heartbeat(
            instance_id=self.cfg.instance_id, kind=self.cfg.kind, engine=self.engine.name,
            state=self.state,  # type: ignore[arg-type]
            run_id=loaded[0] if loaded else None, weight_version=loaded[1] if loaded else None,
            held=[Held(request_id=r, epoch=i.assignment.epoch,
                       buffered=len(i.buffer), published=i.offset)
                  for r, i in self.inflight.items()]
            + [Held(request_id=r, epoch=e) for r, e in self.finished.items()],
            capacity=self.cfg.max_batch, pid=os.getpid(), metrics_port=self.metrics_port,
            session=self.session, decode_steps=self.engine.decode_steps,
        )

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                reply = decode_beat_reply(await request_bytes(
                    self.nc, self._beats, self._heartbeat(),
                    timeout_s=max(1.0, self.cfg.heartbeat_s * 2)))
            except (RlboostError, ProtocolError) as exc:
                log.debug("heartbeat: %s", exc)
            else:
                if isinstance(reply, Refused):  # another protocol version: this image is stale
                    self.refused = reply.detail
                    log.error("the manager refused this instance: %s", reply.detail)
                    self.notice("shutdown")
                    return
                for rid in reply.revoke:
                    self.finished.pop(rid, None)
                    if self.inflight.pop(rid, None) is not None:
                        self.engine.abort(rid)
                        self.metrics.revoked.inc()
                        log.info("lease of %s lost; dropped it", rid)
                if reply.target:
                    self._target = (reply.target.run_id, reply.target.weight_version)
                    self._want(*self._target)
            self._beat.clear()
            await wait_event(self._beat, self.cfg.heartbeat_s)

    def _want(self, run_id: str, version: int) -> None:
        """Start loading ``version`` unless it is loaded, being loaded, or we are leaving.
        With responses in flight of the same run (an asynchronous run: the manager leases
        an older version's instance work while its version may still make tokens of some
        step) it waits until they are done: the engines swap weights only when idle, and a
        response never mixes versions within one lease."""
        loaded = self.engine.loaded
        if (run_id, version) == loaded or self.state == "draining" or \
                (self._loading is not None and not self._loading.done()):
            return
        if self.inflight and loaded is not None and loaded[0] == run_id:
            if version > loaded[1]:
                self._loading = asyncio.create_task(self._update(run_id, version))
            return
        self._loading = asyncio.create_task(self._load(run_id, version))

    async def _update(self, run_id: str, version: int) -> None:
        """An asynchronous run's newer version while responses are in flight (AReaL's
        interruptible rollout): hand them back after their buffered tokens, as a seeding
        hand-off does, then load. Each continues from its committed tokens on whichever
        instance leases it next, at that instance's version: a partial rollout, its token
        runs recorded per version by the manager."""
        self.state = "loading"  # taking no new work meanwhile (nor its own back, at once)
        await self._hand_back(list(self.inflight), reason="update")
        if self.inflight:  # a release that was not answered: they stay here, and so do we
            self.state = "ready"
            return
        await self._load(run_id, version)

    async def _on_announce(self, msg: NatsMsg) -> None:
        """A new version exists: in synchronous training that means the step that used the
        previous one is over, so pulling it now overlaps the pull with the trainer's report."""
        try:
            announce = decode(msg.data, WeightsAnnounce)
        except ProtocolError as exc:
            log.warning("dropped %s", exc)
            return
        loaded = self.engine.loaded
        newer = loaded is not None and loaded[0] == announce.run_id and \
            announce.weight_version > loaded[1] and not self.inflight
        if newer or self._target == (announce.run_id, announce.weight_version):
            self._want(announce.run_id, announce.weight_version)

    async def _load(self, run_id: str, version: int) -> None:
        """Pull the version (verified, atomic; chunks from peers too), then swap it into the
        engine; the peer server then offers it to instances that join later. (An emulated
        reserved instance with RLBOOST_EMU_LINK on swaps it in place: :meth:`_swaps_in_place`.)"""
        previous = self.state
        self.state = "loading"
        try:
            common = self.cfg.common
            stats = PullStats()
            if self._swaps_in_place():
                await asyncio.to_thread(self.engine.load, None, run_id, version)
                self.state = "draining" if self._stop.is_set() else "ready"
                self._beat.set()
                log.info("loaded %s v%d (swapped in place)", run_id, version)
                return
            try:
                path = await pull_version(common.weights_url, reveal(common.weights_read_token),
                                          run_id, version, self.weights_dir, timeout_s=30.0,
                                          peers=True, serve=self.peer, tls=common.tls,
                                          stats=stats, seeded=self.cfg.seeded_bases)
            finally:  # a pull that failed after its delta fell short counts that too
                if stats.fallback is not None:
                    self.metrics.delta_fallbacks.labels(stats.fallback).inc()
            self.metrics.count_pull(stats)
            with self.metrics.load_seconds.time():
                if stats.base_dir is not None:
                    await asyncio.to_thread(self.engine.load_adapter, stats.base_dir, path,
                                            run_id, version)
                else:
                    await asyncio.to_thread(self.engine.load, path, run_id, version)
            self._base_dir = stats.base_dir
        except Exception as exc:  # the next heartbeat retries; the instance stays usable
            # Not yet published is the normal state of a version the trainer is still writing.
            level = logging.INFO if getattr(exc, "retryable", False) else logging.WARNING
            log.log(level, "loading %s v%d failed: %s", run_id, version, exc)
            self.state = previous if previous != "loading" else "starting"
            await asyncio.sleep(0.5)
            return
        self.state = "draining" if self._stop.is_set() else "ready"
        self._beat.set()  # tell the manager at once: it dispatches only to ready instances
        log.info("loaded %s v%d", run_id, version)
        self._collect_old(run_id, version)

    def _swaps_in_place(self) -> bool:
        """An emulated reserved instance with RLBOOST_EMU_LINK on: it shares GPUs with the
        trainer, which swaps the weights in device memory (the simulator's model), so it pulls
        nothing; the engine's load is that swap."""
        return self.cfg.engine == "emu" and self.cfg.kind == "reserved" and self.cfg.emu_link

    def _collect_old(self, run_id: str, version: int) -> None:
        root = self.weights_dir / run_id
        if not root.is_dir():
            return
        for child in root.iterdir():
            if child == self._base_dir:
                continue  # the base of the adapter versions this instance loads
            if child.name.isdigit() and int(child.name) < version:
                shutil.rmtree(child, ignore_errors=True)

    # --- work ------------------------------------------------------------------------------

    async def _on_assign(self, msg: NatsMsg) -> None:
        try:
            command = decode_command(msg.data)
        except ProtocolError as exc:
            log.warning("dropped %s", exc)
            return
        if isinstance(command, Revoke) and command.flush:
            await self._hand_back(command.request_ids)
            return
        if isinstance(command, Revoke):
            for rid in command.request_ids:
                if self.inflight.pop(rid, None) is not None:
                    self.engine.abort(rid)
                    self.metrics.revoked.inc()
            return
        for a in command.items:
            current = self.inflight.get(a.request_id)
            if self.state != "ready" or (a.run_id, a.weight_version) != self.engine.loaded or \
                    (current is not None and current.assignment.epoch >= a.epoch):
                continue  # not reported in the next heartbeat, so the manager takes it back
            if current is not None:
                self.engine.abort(a.request_id)
            # An agentic response comes back for its next model turn under a new lease: the
            # last turn's epoch is no longer this instance's to report.
            self.finished.pop(a.request_id, None)
            try:
                self.engine.add(self._request(a))
            except EngineError as exc:  # e.g. a weight swap raced the check above
                log.warning("refused %s: %s", a.request_id, exc)
                continue
            self.inflight[a.request_id] = InFlight(a, offset=len(a.committed_token_ids))
            self.metrics.assigned.inc()
        self._wake.set()

    async def _hand_back(self, rids: list[str], reason: Literal["handoff", "update"] = "handoff"
                         ) -> None:
        """The seeding window is over: publish what is buffered for ``rids``, then hand them
        back (a release that the manager answers once those chunks are committed), so the next
        owner resumes after every token generated here, not after the last full chunk."""
        items = {rid: item for rid in rids if (item := self.inflight.get(rid)) is not None}
        for rid, item in items.items():
            item.frozen = True  # the generate loop adds nothing to it from now on
            self.engine.abort(rid)
        async with self._publishing:
            # Not published (dropped): the manager takes those back from their last commit.
            await self._publish([(rid, item) for rid, item in items.items()
                                 if item.buffer or item.final])
        held = [Held(request_id=rid, epoch=item.assignment.epoch, published=item.offset)
                for rid, item in items.items() if not item.final and rid in self.inflight]
        if held:
            with contextlib.suppress(RlboostError):
                await request(self.nc, self._releases, Release(
                    instance_id=self.cfg.instance_id, held=held, leaving=False,
                    reason=reason, session=self.session), Ack, 5.0)
        for h in held:  # reported (and renewed) by heartbeats until the manager took them
            if self.inflight.pop(h.request_id, None) is not None:
                self.metrics.revoked.inc()
        log.info("handed back %d responses (%s)", len(held), reason)

    @staticmethod
    def _request(a: Assignment) -> GenRequest:
        return GenRequest(
            request_id=a.request_id, prompt_token_ids=a.prompt_token_ids,
            committed_token_ids=a.committed_token_ids, max_new_tokens=a.max_new_tokens,
            temperature=a.temperature, seed=a.seed, step=a.step,
            prompt_index=a.prompt_index, sample_index=a.sample_index,
            eos_token_id=a.eos_token_id, weight_version=a.weight_version,
        )

    async def _generate_loop(self) -> None:
        while True:
            self._wake.clear()  # before the check, so an add() racing it still wakes us
            if not self.engine.has_work():
                await wait_event(self._wake, 0.5)
                continue
            events = await asyncio.to_thread(self.engine.step)
            self.metrics.tokens.inc(len(events))
            for ev in events:
                item = self.inflight.get(ev.request_id)
                if item is None or item.frozen:
                    continue  # revoked (or being handed back) while the step ran
                # An engine re-reports the last committed token of a response that was already
                # complete on arrival; only a token at the next position is new.
                if ev.position == item.offset + len(item.buffer):
                    item.buffer.append(ev.token_id)
                    if item.logprobs is not None:
                        if ev.logprob is None:
                            item.logprobs = None
                        else:
                            item.logprobs.append(ev.logprob)
                if ev.finished:
                    item.final, item.finish_reason = True, ev.finish_reason
            if not any(i.flush_due(self.cfg.chunk_tokens) for i in self.inflight.values()):
                continue
            # A flush: every response's new tokens in one frame (one message, one commit
            # script), so the message rate is per instance and flush, not per response; no
            # response's unsent tokens outgrow chunk_tokens, which bounds what a preemption
            # wastes. The engine goes on while the frame's ack is awaited (waiting for it
            # idled the GPU for a round trip to the stream every flush); the next flush waits
            # for it, so one frame is in flight at a time and a response's entries stay in
            # order.
            await self._flushed()
            due = [(rid, item) for rid, item in self.inflight.items()
                   if not item.frozen and (item.buffer or item.final)]
            self._flushing = asyncio.create_task(self._flush(due))

    async def _flush(self, due: list[tuple[str, InFlight]]) -> None:
        async with self._publishing:
            await self._publish(due)

    async def _flushed(self) -> None:
        """The frame in flight has its ack (or was given up on); shielded, so that a task
        cancelled while waiting does not cancel the publish under it."""
        if self._flushing is not None:
            try:
                await asyncio.shield(self._flushing)
            except Exception as exc:  # _publish gives up on a frame by itself; this is a bug
                log.error("flushing a frame failed: %r", exc)
            self._flushing = None

    async def _publish(self, items: list[tuple[str, InFlight]]) -> None:
        """Publish ``items``' buffers as one frame (more where one would pass MESSAGE_BUDGET).
        A frame that cannot be published drops its responses: the manager re-dispatches them
        from their last commit."""
        runs = {item.assignment.run_id for _, item in items}
        if len(runs) > 1:  # a frame's subject names one run (a weight swap can leave two)
            for run in sorted(runs):
                await self._publish([x for x in items if x[1].assignment.run_id == run])
            return
        if not items:
            return
        # What each buffer holds now is what this frame carries: the engine may add to it
        # before the ack, and those tokens go in the next frame.
        entries = [self._entry(rid, item) for rid, item in items]
        for (_, item), entry in zip(items, entries, strict=True):
            item.sending, item.final_sent = entry.n_tokens, entry.final
        frame = TokenFrame(instance_id=self.cfg.instance_id, kind=self.cfg.kind, entries=entries)
        data = encode(frame)
        if len(data) > MESSAGE_BUDGET and len(items) > 1:
            half = len(items) // 2
            await self._publish(items[:half])
            await self._publish(items[half:])
            return
        subject = names.chunk_subject(items[0][1].assignment.run_id, self.cfg.instance_id,
                                      self._key)
        for attempt in range(20):
            try:
                await self.js.publish(subject, data, timeout=2.0)
                break
            except Exception as exc:  # broker restart: retry while the leases may still hold
                log.warning("publishing a frame of %d responses failed (%s); retrying",
                            len(items), exc)
                await asyncio.sleep(min(0.1 * (attempt + 1), 1.0))
        else:
            for rid, _ in items:
                self.inflight.pop(rid, None)
                self.engine.abort(rid)
            return
        self.metrics.frames.inc()
        self.metrics.chunks.inc(len(items))
        for (rid, item), entry in zip(items, entries, strict=True):
            item.offset += entry.n_tokens
            del item.buffer[:entry.n_tokens]
            if item.logprobs is not None:
                del item.logprobs[:entry.n_tokens]
            item.sending = 0
            if entry.final:
                self.inflight.pop(rid, None)
                self.finished[rid] = item.assignment.epoch

    def _entry(self, rid: str, item: InFlight) -> FrameEntry:
        a = item.assignment
        entry = FrameEntry.of(
            request_id=rid, epoch=a.epoch, weight_version=a.weight_version, offset=item.offset,
            token_ids=item.buffer, final=item.final,
            finish_reason=item.finish_reason if item.final else None,  # type: ignore[arg-type]
            logprobs=item.logprobs if item.logprobs is not None else (),
        )
        entry.mac = entry_mac(a.lease_key, self.cfg.instance_id, entry)
        return entry
