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
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import redis.asyncio as aioredis
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg as NatsMsg
from nats.js.api import AckPolicy, ConsumerConfig
from redis.exceptions import RedisError

from manager_svc.accounting import CommitResult, Ledger
from manager_svc.metrics import ManagerMetrics
from manager_svc.runs import RunStore
from manager_svc.seeding import DEFAULT_WINDOW_S, SeedingState, next_window, observe
from shared import names
from shared.bus import connect_nats, connect_redis, ensure_chunk_stream
from shared.config import ManagerConfig
from shared.errors import ProtocolError
from shared.names import Keys
from shared.protocol import (
    Ack,
    ActiveRun,
    Assign,
    Barrier,
    Digest,
    GroupDone,
    Handoff,
    Heartbeat,
    HeartbeatReply,
    Release,
    Revoke,
    RunFailed,
    StepFinish,
    StepSamples,
    StepSamplesQuery,
    StepStart,
    Target,
    TokenChunk,
    TrainerPoll,
    decode,
    encode,
    sample_digest,
)

log = logging.getLogger("manager")
M = TypeVar("M", bound=msgspec.Struct)
# An assignment the instance has not confirmed in a heartbeat after this long is taken back.
LOST_ASSIGNMENT_S = 1.5
# Do not move work off the same instance more often than this: moved work needs a moment to land.
REBALANCE_COOLDOWN_S = 2.0
REBALANCE_IDLE_S = 1.0  # an instance must have been idle this long before work moves to it
LIVE_COUNTERS = ("migrations", "preemptions", "preempted_responses", "duplicate_chunks_dropped",
                 "stale_chunks_rejected", "tokens_regenerated")


class ManagerService:
    def __init__(self, cfg: ManagerConfig) -> None:
        self.cfg = cfg
        self.metrics = ManagerMetrics()
        self._tasks: list[asyncio.Task[None]] = []
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
        js = self.nc.jetstream()
        await ensure_chunk_stream(js)
        await self._serve(names.HEARTBEAT, Heartbeat, self.on_heartbeat)
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
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):
            await self.nc.drain()
        with contextlib.suppress(Exception):
            await self.redis.aclose()

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

    async def _serve(
        self, subject: str, kind: type[M], handler: Callable[[M], Awaitable[Any]]
    ) -> None:
        async def callback(msg: NatsMsg) -> None:
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

        await self.nc.subscribe(subject, cb=callback)

    # --- instances -------------------------------------------------------------------------

    async def current_target(self) -> tuple[str, int] | None:
        run_id = await self.runs.active()
        if not run_id:
            return None
        step = await self.redis.hget(Keys.run(run_id), "step")
        return (run_id, int(step or 0))

    async def on_heartbeat(self, hb: Heartbeat) -> HeartbeatReply:
        key = Keys.instance(hb.instance_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(key, mapping={
            "id": hb.instance_id, "kind": hb.kind, "engine": hb.engine, "state": hb.state,
            "run_id": hb.run_id or "", "weight_version": -1 if hb.weight_version is None
            else hb.weight_version, "capacity": hb.capacity, "pid": hb.pid,
            "metrics_port": hb.metrics_port,
            "last_seen": time.time(),
        })
        pipe.pexpire(key, int(self.cfg.instance_ttl_s * 1000))
        pipe.sadd(Keys.instances, hb.instance_id)
        pipe.smembers(Keys.instance_held(hb.instance_id))
        server_held: set[str] = (await pipe.execute())[-1]
        target = await self.current_target()
        revoke: list[str] = []
        reported = set()
        for held in hb.held:
            reported.add(held.request_id)
            wrong_run = target is None or not held.request_id.startswith(target[0] + ":")
            if wrong_run or not await self.ledger.renew(held.request_id, hb.instance_id,
                                                        held.epoch, held.generated):
                revoke.append(held.request_id)
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
        revoked = 0
        for held in rel.held:
            if await self.ledger.revoke(held.request_id, held.epoch):
                self.metrics.revocations.labels(rel.reason).inc()
                revoked += 1
        if rel.held and rel.reason == "preempt":
            await self._count_preemption(revoked)
        if rel.leaving:
            await self._forget_instance(rel.instance_id)
        self._wake.set()
        return Ack()

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
            })
        return out

    async def _reap_instances(self) -> None:
        """An instance whose heartbeat key expired is dead: take its work back (hard loss)."""
        for instance_id in await self.redis.smembers(Keys.instances):
            if await self.redis.exists(Keys.instance(instance_id)):
                continue
            revoked = await self._forget_instance(instance_id)
            log.warning("instance %s is gone; %d responses go back to the queue",
                        instance_id, revoked)
            if revoked:
                await self._count_preemption(revoked)

    # --- dispatch --------------------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        last_reap = 0.0
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.cfg.dispatch_interval_s)
            self._wake.clear()
            if time.monotonic() - last_reap > min(0.5, self.cfg.instance_ttl_s / 2):
                last_reap = time.monotonic()
                await self._reap_instances()
                await self._expire_leases()
            await self.dispatch_once()

    async def _active_step(self) -> tuple[str, int, dict[str, str]] | None:
        target = await self.current_target()
        if target is None:
            return None
        info = await self.redis.hgetall(Keys.step(*target))
        if not info or info.get("state") != "rollout":
            return None
        return target[0], target[1], info

    async def _expire_leases(self) -> None:
        active = await self._active_step()
        if active is None:
            return
        run_id, step, _ = active
        leased = sorted(await self.redis.smembers(Keys.leased(run_id, step)))
        if not leased:
            return
        pipe = self.redis.pipeline(transaction=False)
        for rid in leased:
            pipe.exists(Keys.lease(rid))
        for rid, alive in zip(leased, await pipe.execute(), strict=True):
            if not alive and await self.ledger.revoke(rid):
                self.metrics.revocations.labels("expired").inc()
                log.info("lease of %s expired; taken back", rid)

    async def dispatch_once(self) -> int:
        """Lease pending responses of the active step to ready instances; returns how many."""
        active = await self._active_step()
        if active is None:
            return 0
        run_id, step, info = active
        if int(info.get("remaining", 1)) <= 0:
            await self._barrier(run_id, step)
            return 0
        version = int(info["version"])
        everyone = await self.instances()
        ready = await self._eligible(run_id, step, info, everyone, [
            i for i in everyone if i["state"] == "ready" and i["run_id"] == run_id
            and i["weight_version"] == version])
        pending = await self.redis.smembers(Keys.pending(run_id, step))
        if not ready or not pending:
            return 0
        spec = (await self.runs.get(run_id) or {}).get("spec", {})
        queue = sorted(pending, key=lambda r: names.parse_request_id(r)[2:])
        # Fair share of all outstanding work, so one fast-joining instance does not take it all;
        # reserved instances come first, as the design's seeding order asks.
        outstanding = len(queue) + sum(i["held"] for i in ready)
        share = math.ceil(outstanding / len(ready))
        ready.sort(key=lambda i: (i["kind"] != "reserved", i["held"]))
        sent = 0
        for inst in ready:
            room = min(inst["capacity"], share) - inst["held"]
            batch = []
            while room > 0 and queue:
                rid = queue.pop(0)
                assignment = await self.ledger.assign(
                    rid, inst["id"], float(spec.get("temperature", 1.0)),
                    int(spec.get("seed", 0)), int(info.get("eos", 0)),
                )
                if assignment is not None:
                    batch.append(assignment)
                    room -= 1
            if batch:
                self.metrics.assignments.inc(len(batch))
                await self.nc.publish(names.assign_subject(inst["id"]), encode(Assign(items=batch)))
                sent += len(batch)
        if not queue and self.cfg.rebalance_skew:
            await self._rebalance(ready)
        return sent

    async def _eligible(self, run_id: str, step: int, info: dict[str, str],
                        everyone: list[dict[str, Any]], ready: list[dict[str, Any]]
                        ) -> list[dict[str, Any]]:
        """Who may take work now. During the seeding window everyone ready (reserved first);
        after it, or with seeding off, only spot instances, unless no spot instance is alive
        at all, in which case the reserved side generates everything (co-located)."""
        mode = info.get("mode", "off")
        if mode != "off" and time.time() < float(info.get("window_end", 0.0)):
            return ready
        spot_alive = any(i["kind"] == "spot" and i["state"] != "draining" for i in everyone)
        if mode != "off" and not info.get("handoff_at"):
            await self._handoff(run_id, step, everyone, spot_alive)
        return [i for i in ready if i["kind"] == "spot"] if spot_alive else ready

    async def _handoff(self, run_id: str, step: int, everyone: list[dict[str, Any]],
                       spot_alive: bool) -> None:
        """End of the seeding window: the reserved side's unfinished responses move to spot
        instances (token-level, the preemption path) and the reserved side starts training."""
        skey = Keys.step(run_id, step)
        if not await self.redis.hsetnx(skey, "handoff_at", time.time()):
            return
        if not spot_alive:
            return  # nobody to hand to: the reserved side keeps generating, trains after
        prefix = f"{run_id}:{step}:"
        for inst in everyone:
            if inst["kind"] != "reserved":
                continue
            held = [r for r in await self.redis.smembers(Keys.instance_held(inst["id"]))
                    if r.startswith(prefix)]
            moved = [rid for rid in held if await self.ledger.revoke(rid)]
            if moved:
                self.metrics.revocations.labels("handoff").inc(len(moved))
                await self.nc.publish(names.assign_subject(inst["id"]),
                                      encode(Revoke(request_ids=moved)))
        await self.redis.hset(skey, "reserved_free", 1)
        await self.nc.publish(names.handoff_subject(run_id),
                              encode(Handoff(run_id=run_id, step=step)))

    async def _rebalance(self, ready: list[dict[str, Any]]) -> None:
        """Token-level load balancing: when the busiest instance holds more than
        ``rebalance_skew`` responses over the idlest (an instance joined mid-step, or its
        responses ran long), move half the difference, least-advanced responses first. They
        continue from their committed tokens on the next dispatch, by the migration path."""
        if len(ready) < 2:
            return
        ids = {i["id"] for i in ready}  # re-read: the held counts changed as work went out
        ready = [i for i in await self.instances() if i["id"] in ids]
        ready.sort(key=lambda i: i["held"])
        idle, busy = ready[0], ready[-1]
        now = time.monotonic()
        for inst in ready:
            if inst["held"] == 0:
                self._idle_since.setdefault(inst["id"], now)
            else:
                self._idle_since.pop(inst["id"], None)
        # Only an instance idle for a while is worth feeding: short responses finish before a
        # move would pay for its re-prefill, and moving them anyway just churns leases.
        if now - self._idle_since.get(idle["id"], now) < REBALANCE_IDLE_S or \
                busy["held"] - idle["held"] <= self.cfg.rebalance_skew or \
                now - self._rebalanced.get(busy["id"], 0.0) < REBALANCE_COOLDOWN_S:
            return
        self._rebalanced[busy["id"]] = now
        held = sorted(await self.redis.smembers(Keys.instance_held(busy["id"])))
        pipe = self.redis.pipeline(transaction=False)
        for rid in held:
            pipe.hget(Keys.request(rid), "n")
        progress = [int(n or 0) for n in await pipe.execute()]
        move = [rid for _, rid in sorted(zip(progress, held, strict=True))]
        move = move[:(busy["held"] - idle["held"]) // 2]
        moved = [rid for rid in move if await self.ledger.revoke(rid)]
        if moved:
            self.metrics.revocations.labels("rebalance").inc(len(moved))
            await self.nc.publish(names.assign_subject(busy["id"]),
                                  encode(Revoke(request_ids=moved)))
            log.info("moving %d responses off %s (holds %d, %s holds %d)", len(moved),
                     busy["id"], busy["held"], idle["id"], idle["held"])
            self._wake.set()

    # --- chunks and the barrier ------------------------------------------------------------

    async def _consume_chunks(self) -> None:
        js = self.nc.jetstream()
        sub = await js.pull_subscribe(
            names.CHUNK_WILDCARD, durable=names.CHUNK_CONSUMER, stream=names.CHUNK_STREAM,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30.0,
                                  max_ack_pending=65536),
        )
        while True:
            try:
                batch = await sub.fetch(512, timeout=0.5)
            except TimeoutError:
                continue
            except Exception as exc:  # a broker restart surfaces here; the consumer is durable
                if "timeout" not in type(exc).__name__.lower():
                    log.warning("chunk fetch: %s", exc)
                    await asyncio.sleep(0.2)
                continue
            for msg in batch:
                await self._ingest(msg)

    async def _ingest(self, msg: NatsMsg) -> None:
        try:
            chunk = decode(msg.data, TokenChunk)
            names.parse_request_id(chunk.request_id)
        except (ProtocolError, ValueError) as exc:
            self.metrics.malformed.labels(names.CHUNK_WILDCARD).inc()
            log.warning("dropped chunk: %s", exc)
            await msg.term()
            return
        result = await self._commit(chunk)
        self.metrics.chunks.labels(result.status).inc()
        if result.status in ("ok", "final", "group", "step"):
            self.metrics.tokens.inc(len(chunk.token_ids))
        elif result.status in ("gap", "wrong_version", "overlong"):
            self.metrics.revocations.labels(result.status).inc()
            log.info("chunk of %s from %s: %s; taken back", chunk.request_id,
                     chunk.instance_id, result.status)
            self._wake.set()
        if result.status in ("group", "step"):
            run_id, step, prompt, _ = names.parse_request_id(chunk.request_id)
            spec = (await self.runs.get(run_id) or {}).get("spec", {})
            samples = await self.ledger.group_samples(run_id, step, prompt,
                                                      int(spec.get("samples_per_prompt", 1)))
            await self.nc.publish(names.group_subject(run_id), encode(
                GroupDone(run_id=run_id, step=step, prompt_index=prompt, samples=samples)))
            if result.status == "step":
                await self._barrier(run_id, step)
        await msg.ack()

    async def _commit(self, chunk: TokenChunk) -> CommitResult:
        """Commit, waiting out a Redis restart: the stream keeps later chunks in order behind
        this one, so retrying here (not nak-ing) is what keeps every offset in sequence."""
        delay = 0.05
        while True:
            try:
                return await self.ledger.commit(chunk)
            except RedisError as exc:
                log.warning("commit waits for Redis: %s", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _barrier(self, run_id: str, step: int) -> None:
        """Every response of the step is complete, once: freeze the digest and announce it."""
        samples = await self.ledger.done_samples(run_id, step)
        digest = sample_digest(samples)
        await self.redis.hset(Keys.step(run_id, step), mapping={
            "state": "training", "rollout_done_at": time.time(),
            "digest": msgspec.json.encode(digest).decode(),
        })
        log.info("barrier %s step %d: %d responses, %d tokens", run_id, step,
                 digest.responses, digest.tokens)
        await self.nc.publish(names.barrier_subject(run_id),
                              encode(Barrier(run_id=run_id, step=step, digest=digest)))

    # --- trainer protocol ------------------------------------------------------------------

    async def on_poll(self, poll: TrainerPoll) -> ActiveRun:
        run_id = await self.runs.active()
        if not run_id:
            return ActiveRun()
        run = await self.runs.get(run_id) or {}
        return ActiveRun(run_id=run_id, spec=run["spec"], step=run["step"], state=run["state"])

    async def on_step_start(self, msg: StepStart) -> Ack:
        run = await self.runs.get(msg.run_id)
        if run is None or run["state"] != "running":
            return Ack(ok=False, detail=f"run {msg.run_id} is not running")
        if msg.step != run["step"] or msg.weight_version != msg.step:
            return Ack(ok=False, detail=f"run is at step {run['step']}, not {msg.step}")
        spec = run["spec"]
        if len(msg.prompt_token_ids) != spec["prompts_per_step"]:
            return Ack(ok=False, detail="prompt count differs from prompts_per_step")
        seeding = await self._seeding(msg.run_id)
        mode = spec["seeding"]["mode"]
        spot_alive = sum(1 for i in await self.instances()
                         if i["kind"] == "spot" and i["state"] != "draining")
        if mode == "adaptive":
            window = next_window(seeding, spot_alive)
        else:
            window = float(spec["seeding"]["window_s"]) if mode == "fixed" else 0.0
        created = await self.ledger.create_step(
            msg.run_id, msg.step, msg.weight_version, msg.prompt_token_ids,
            spec["samples_per_prompt"], spec["max_new_tokens"],
            extra={"eos": msg.eos_token_id, "mode": mode, "window_s": window,
                   # Seeding off and spot capacity present: the reserved side only trains.
                   "reserved_free": int(mode == "off" and spot_alive > 0)},
        )
        if created:
            seeding.window_s, seeding.spot_count = window, spot_alive
            await self.redis.hset(Keys.seeding(msg.run_id), mapping=seeding.dump())
            log.info("step %d of %s started (seeding %s, window %.2fs, %d spot)", msg.step,
                     msg.run_id, mode, window, spot_alive)
        self._wake.set()
        return Ack()

    async def _seeding(self, run_id: str) -> SeedingState:
        raw = await self.redis.hgetall(Keys.seeding(run_id))
        if raw:
            return SeedingState.load(raw)
        run = await self.runs.get(run_id) or {}
        initial = float(run.get("spec", {}).get("seeding", {}).get("window_s") or 0.0)
        return SeedingState(window_s=initial or DEFAULT_WINDOW_S)

    async def _barrier_digest(self, run_id: str, step: int) -> Digest | None:
        raw = await self.redis.hget(Keys.step(run_id, step), "digest")
        return msgspec.json.decode(raw, type=Digest) if raw else None

    async def on_samples(self, query: StepSamplesQuery) -> StepSamples:
        digest = await self._barrier_digest(query.run_id, query.step)
        samples = await self.ledger.done_samples(query.run_id, query.step)
        free = await self.redis.hget(Keys.step(query.run_id, query.step), "reserved_free")
        return StepSamples(run_id=query.run_id, step=query.step, complete=digest is not None,
                           train_now=digest is not None or free == "1", samples=samples,
                           digest=digest)

    async def on_finish(self, fin: StepFinish) -> Ack:
        run = await self.runs.get(fin.run_id)
        if run is None:
            return Ack(ok=False, detail=f"unknown run {fin.run_id}")
        if run["step"] > fin.step:
            return Ack(detail="already recorded")  # a retried finish after a lost reply
        if run["state"] != "running" or run["step"] != fin.step:
            return Ack(ok=False, detail=f"run is {run['state']} at step {run['step']}")
        digest = await self._barrier_digest(fin.run_id, fin.step)
        if digest is None or digest != fin.digest:
            # The trainer trained on something other than the barrier's data: invariant 3.
            await self.runs.set_state(fin.run_id, "failed", "barrier digest mismatch")
            await self.redis.delete(Keys.active)
            return Ack(ok=False, detail="digest does not match the barrier's")
        samples = await self.ledger.done_samples(fin.run_id, fin.step)
        rewards = {(r.prompt_index, r.sample_index): r.reward for r in fin.rewards}
        for s in samples:
            s.reward = rewards.get((s.prompt_index, s.sample_index))
        info = await self.redis.hgetall(Keys.step(fin.run_id, fin.step))
        now = time.time()
        started = float(info["started_at"])
        await self._observe_seeding(fin, info, now)
        values = [r for r in rewards.values()]
        record = {
            "step": fin.step, "weight_version": int(info["version"]),
            "new_weight_version": fin.new_version, "responses": digest.responses,
            "tokens": digest.tokens,
            "reward_mean": sum(values) / len(values) if values else 0.0,
            "step_s": now - started,
            "rollout_s": float(info.get("rollout_done_at", now)) - started,
            "train_s": fin.train_s, "trainer_idle_s": fin.trainer_idle_s,
            # After the barrier the rollout side waits for the optimizer step and new weights.
            "rollout_idle_s": max(0.0, now - float(info.get("rollout_done_at", now))),
            "seeding_window_s": float(info.get("window_s", 0.0)),
            "seeding_mode": info.get("mode", "off"),
            "tokens_reserved": int(info.get("tokens_reserved", 0)),
            "tokens_spot": int(info.get("tokens_spot", 0)), "loss": fin.loss,
            "instances": len(await self.instances()),
            **{k: int(info.get(k, 0)) for k in LIVE_COUNTERS},
        }
        await self.runs.finish_step(fin.run_id, fin.step, record,
                                    msgspec.json.encode(samples).decode(), run["steps"])
        await self.redis.hset(Keys.step(fin.run_id, fin.step), "state", "finished")
        self.metrics.steps.inc()
        self.metrics.step_seconds.observe(record["step_s"])
        log.info("step %d of %s finished: reward %.3f, %.2fs", fin.step, fin.run_id,
                 record["reward_mean"], record["step_s"])
        self._wake.set()
        return Ack()

    async def _observe_seeding(self, fin: StepFinish, info: dict[str, str], now: float) -> None:
        started = float(info["started_at"])
        done = float(info.get("rollout_done_at", now))
        spot_first = float(info.get("spot_first_at", done))
        spot = [i for i in await self.instances() if i["kind"] == "spot"]
        # The window actually seen by the reserved side: it ends early at the barrier.
        window = min(float(info.get("window_s", 0.0)), done - started)
        state = await self._seeding(fin.run_id)
        observe(state, {
            "tokens": fin.digest.tokens, "tokens_reserved": int(info.get("tokens_reserved", 0)),
            "tokens_spot": int(info.get("tokens_spot", 0)), "window_s": window,
            "train_s": fin.train_s, "spot_ready_s": spot_first - started,
            "spot_busy_s": done - spot_first, "spot_count": len(spot),
        })
        await self.redis.hset(Keys.seeding(fin.run_id), mapping=state.dump())

    async def on_run_failed(self, msg: RunFailed) -> Ack:
        await self.runs.set_state(msg.run_id, "failed", msg.error[:2000])
        if await self.redis.get(Keys.active) == msg.run_id:
            await self.redis.delete(Keys.active)
        return Ack()

    async def cancel(self, run_id: str) -> dict[str, Any] | None:
        run = await self.runs.get(run_id)
        if run is None:
            return None
        if run["state"] in ("queued", "running"):
            await self.runs.set_state(run_id, "cancelled")
            if await self.redis.get(Keys.active) == run_id:
                await self.redis.delete(Keys.active)
        return await self.runs.get(run_id)

    async def step_records(self, run_id: str) -> list[dict[str, Any]]:
        """Finished-step records with their fault counters read live: a zombie that wakes
        after its step finished still has its rejected chunks counted against that step."""
        records = await self.runs.steps(run_id)
        pipe = self.redis.pipeline(transaction=False)
        for rec in records:
            pipe.hmget(Keys.step(run_id, rec["step"]), list(LIVE_COUNTERS))
        for rec, values in zip(records, await pipe.execute(), strict=True):
            for key, value in zip(LIVE_COUNTERS, values, strict=True):
                if value is not None:
                    rec[key] = int(value)
        return records

    async def step_progress(self, run_id: str, step: int) -> dict[str, Any]:
        info = await self.redis.hgetall(Keys.step(run_id, step))
        if not info:
            return {}
        total = int(info.get("total", 0))
        return {"step": step, "state": info.get("state"), "responses_total": total,
                "responses_done": total - int(info.get("remaining", total)),
                "tokens": int(info.get("tokens", 0))}
