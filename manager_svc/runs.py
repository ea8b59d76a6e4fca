"""Runs: the spec users submit, and their lifecycle in Redis.

Contract: a run is created from a validated :class:`~shared.spec.RunSpec` and stored with
it; :meth:`RunStore.spec` gives the manager's parts that spec typed, while :meth:`RunStore.get`
serves the record, spec included, as the JSON the REST API returns. A run is created
``queued``, becomes ``running`` when the manager activates it (one at a time, FIFO), and ends
``succeeded``, ``failed`` or ``cancelled``. Its record, its finished steps and the samples each
step trained on are Redis data, so a restarted manager serves them unchanged; each finished
step is archived in the data dir too (:mod:`manager_svc.archive`), and once the run ends its
keys expire after the retention time and the archive serves it. A resumed run keeps its keys.
:meth:`RunStore.target` is what every instance should serve now (the running run at its current
step); the step records it serves carry their fault counters read live.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from manager_svc.archive import Archive
from manager_svc.run_history import RunHistory
from manager_svc.scripts import Call, register, run_batch
from shared.errors import RlboostError
from shared.names import Keys
from shared.protocol import decode, encode
from shared.spec import RunSpec

RunState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
TERMINAL = ("succeeded", "failed", "cancelled")
DROP_BATCH = 1024  # responses (two keys each) per DEL when a finished step leaves Redis
# Activations tried in one call: each refused one (cancelled while queued) is cleared first.
ACTIVATE_TRIES = 64


class QueueFull(Exception):
    """More runs are queued than RLBOOST_MAX_QUEUED_RUNS allows."""


class RunConflict(RlboostError):
    """What was asked does not fit the run's state (the REST layer answers 409)."""


class RunStore(RunHistory):
    def __init__(self, redis: aioredis.Redis, archive: Archive, retention_s: float = 86_400.0,
                 max_queued: int = 1_000_000, replica_acks: int = 0) -> None:
        super().__init__(redis, archive)
        # Replicas a finished step's record must reach before the trainer is told it is
        # recorded (RLBOOST_REDIS_REPLICA_ACKS): one lost in a failover would have the run
        # step back, and the trainer train that step's samples again with the next weights.
        self.replica_acks = replica_acks
        self.retention_ms = max(1, int(retention_s * 1000))
        self.max_queued = max_queued
        self._activate = register(redis, "activate.lua")
        self._start_run = register(redis, "start_run.lua")
        self._clear_active = register(redis, "clear_active.lua")
        self._enqueue = register(redis, "enqueue.lua")
        self._finish_step = register(redis, "finish_step.lua")

    async def create(self, spec: RunSpec) -> dict[str, Any]:
        run_id = "run-" + uuid.uuid4().hex[:12]
        now = time.time()
        record = {"id": run_id, "state": "queued", "step": 0, "steps": spec.steps,
                  "spec": encode(spec).decode(), "created_at": now, "updated_at": now,
                  "error": ""}
        # The queue holds queued runs only (a cancel takes its run out), so its length is the
        # count; the check and the queueing are one script, so racing POSTs never pass the
        # limit. The record is written first, in its run's slot: nothing reads a run before
        # the index and the queue list it (a crash between leaves a record nobody lists).
        await self.r.hset(Keys.run(run_id), mapping=record)
        if not await self._enqueue(keys=[Keys.runs, Keys.queue],
                                   args=[self.max_queued, run_id, repr(now)]):
            await self.r.delete(Keys.run(run_id))
            raise QueueFull(f"{self.max_queued} runs are queued already "
                            "(RLBOOST_MAX_QUEUED_RUNS); retry when one has started")
        return await self.get(run_id) or {}

    async def get(self, run_id: str) -> dict[str, Any] | None:
        raw = await self.r.hgetall(Keys.run(run_id))
        if not raw:
            return await self.archive.record(run_id)  # its keys expired: the archive's copy
        return {
            "id": raw["id"], "state": raw["state"], "step": int(raw["step"]),
            "steps": int(raw["steps"]), "spec": json.loads(raw["spec"]),
            "created_at": float(raw["created_at"]), "updated_at": float(raw["updated_at"]),
            "error": raw.get("error") or None,
        }

    async def spec(self, run_id: str) -> RunSpec | None:
        """The run's spec, typed; None for an unknown run."""
        raw = await self.r.hget(Keys.run(run_id), "spec")
        return None if raw is None else decode(raw.encode(), RunSpec)

    async def list_runs(self, limit: int = 100, before: float | None = None
                        ) -> tuple[list[dict[str, Any]], float | None]:
        """The newest ``limit`` runs created before ``before`` (a cursor: the creation time of
        the last run of the previous page), newest first, and the next page's cursor (None:
        this was the last page)."""
        top = "+inf" if before is None else f"({before!r}"
        live = await self.r.zrevrangebyscore(Keys.runs, top, "-inf", start=0, num=limit + 1,
                                             withscores=True)
        # A run whose keys expired left the index above; the archive's index lists it.
        found = dict(await self.archive.listed(before, limit + 1))
        found.update((str(run_id), float(at)) for run_id, at in live)
        rows = sorted(found.items(), key=lambda kv: kv[1], reverse=True)[:limit + 1]
        runs = [await self.get(i) for i, _ in rows[:limit]]
        return [r for r in runs if r], (rows[limit - 1][1] if len(rows) > limit else None)

    async def set_state(self, run_id: str, state: RunState, error: str = "") -> None:
        await self.r.hset(Keys.run(run_id), mapping={"state": state, "updated_at": time.time(),
                                                     "error": error})
        if state in TERMINAL:
            await self.retire(run_id)

    async def active(self) -> str | None:
        """The running run, activating the next queued one if none is running.

        Two atomic scripts, one per slot: ``lua/activate.lua`` makes the head of the queue
        the active run if none is, ``lua/start_run.lua`` marks the active run running. Each
        is safe to repeat, so an activation cut between them (a crash) is finished by the
        next call, whoever makes it: the manager's handlers call this concurrently, and a
        check-then-act in Python let one caller see a half-activated run and deactivate it
        for good. A run that cannot run (cancelled while queued) stops being active, and the
        next one is tried.
        """
        for _ in range(ACTIVATE_TRIES):
            run_id = await self._activate(keys=[Keys.active, Keys.queue])
            if not run_id:
                return None
            if await self._start_run(keys=[Keys.run(run_id)], args=[time.time()]):
                return str(run_id)
            await self.clear_active(run_id)
        return None

    async def clear_active(self, run_id: str) -> None:
        """The run, ended or cancelled, is no longer the active one (if it still is)."""
        await self._clear_active(keys=[Keys.active], args=[run_id])

    async def target(self) -> tuple[str, int] | None:
        """The running run and the step it is at: what rollout instances should serve now."""
        run_id = await self.active()
        if not run_id:
            return None
        step = await self.r.hget(Keys.run(run_id), "step")
        return (run_id, int(step or 0))

    async def cancel(self, run_id: str) -> dict[str, Any] | None:
        run = await self.get(run_id)
        if run is None:
            return None
        if run["state"] in ("queued", "running"):
            await self.r.lrem(Keys.queue, 0, run_id)
            await self.clear_active(run_id)
            await self.set_state(run_id, "cancelled")
        return await self.get(run_id)

    async def resume(self, run_id: str) -> dict[str, Any] | None:
        """Queue a failed or cancelled run again; None for an unknown run.

        It goes on at its step, the one after the last finished step: the trainer restores the
        checkpoint it wrote after that step, and the step's responses committed before the run
        stopped are kept (they were generated with that same version, so they stay on-policy
        and each is still trained on once). A run that finished no step has no checkpoint:
        :class:`RunConflict`, as for a run that is not failed or cancelled. Watched, so two
        concurrent resumes queue it once. The run's record changes first, in its slot; the
        queue after (a crash between leaves it queued and unlisted: :meth:`sweep` queues it).
        """
        key = Keys.run(run_id)
        # Retiring it set its keys to expire; the resumed run keeps them (read before the
        # watch: an ended run's keys do not change).
        kept = await self._keys(run_id, int(await self.r.hget(key, "step") or 0))
        async with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    state, step, steps = await pipe.hmget(key, ["state", "step", "steps"])
                    if state is None:
                        return None
                    if state not in ("failed", "cancelled"):
                        raise RunConflict(f"run {run_id} is {state}: only a failed or cancelled "
                                          "run can be resumed")
                    if int(step) == 0:
                        raise RunConflict(f"run {run_id} has no checkpoint to resume from: it "
                                          "finished no step; submit its spec again")
                    if int(step) >= int(steps):
                        raise RunConflict(f"run {run_id} finished all {steps} steps")
                    pipe.multi()
                    pipe.hset(key, mapping={"state": "queued", "error": "",
                                            "updated_at": time.time()})
                    for k in (key, *kept):
                        pipe.persist(k)
                    pipe.hdel(key, "retired")
                    await pipe.execute()
                    break
                except WatchError:
                    continue
        await self._requeue(run_id)
        return await self.get(run_id)

    async def _requeue(self, run_id: str) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.rpush(Keys.queue, run_id)
        pipe.zrem(Keys.expiring, run_id)
        await pipe.execute()

    async def finish_step(
        self, run_id: str, step: int, record: dict[str, Any], samples_json: str, steps: int,
        checkpoints: list[int] | None = None,
    ) -> None:
        """Record step ``step`` and advance the run; the run succeeds after its last step.
        ``checkpoints``: the versions the trainer keeps for the user after this step.

        The step goes to the archive first, then to Redis in one transaction: a retry after a
        crash between the two writes the archive again with the retry's record, the one Redis
        then keeps. The step before it is then dropped from Redis (its archive serves it): a
        run holds the responses of its active step and the last finished one, whatever its
        length. A late chunk for a dropped response is refused as unknown. It records nothing
        if the run is no longer at ``step`` when its script runs (finish_step.lua)."""
        text = json.dumps(record)
        await self.archive.write_step(run_id, step, text, samples_json)
        [recorded] = await run_batch(self.r, [Call(
            self._finish_step,
            [Keys.run(run_id), Keys.samples(run_id, step), Keys.step_records(run_id)],
            [step, samples_json, text, time.time(),
             "" if checkpoints is None else json.dumps(checkpoints), int(step + 1 >= steps)])],
            self.replica_acks)
        if not recorded:
            # Another finish of this step got there first (this one's commands arrived late,
            # or it is a retry): the archive keeps the record Redis keeps.
            kept = [x for x in await self.r.lrange(Keys.step_records(run_id), 0, -1)
                    if json.loads(x).get("step") == step]
            kept_samples = await self.r.get(Keys.samples(run_id, step))
            if kept and kept_samples is not None:
                await self.archive.write_step(run_id, step, kept[-1], kept_samples)
            return
        await self.after_finish(run_id, step, steps)

    async def after_finish(self, run_id: str, step: int, steps: int) -> None:
        """What follows step ``step``'s record, each part safe to repeat: a finish retried
        after its record was written (a reply lost, a failover while the record waited for
        its replica) does it again."""
        if step + 1 >= steps:
            await self.clear_active(run_id)
        if step > 0:
            await self._drop_step(run_id, step - 1)
        if step + 1 >= steps:
            await self.retire(run_id)

    async def _drop_step(self, run_id: str, step: int) -> None:
        """Delete a finished, archived step's responses and samples (its hash stays until
        the run retires: it is small, and its fault counters may still move)."""
        sets = Keys.step_sets(run_id, step)
        pipe = self.r.pipeline(transaction=False)
        for key in sets:
            pipe.smembers(key)
        rids = sorted(set().union(*await pipe.execute()))
        for i in range(0, len(rids), DROP_BATCH):
            await self.r.delete(*[k for r in rids[i:i + DROP_BATCH]
                                  for k in Keys.response(r)])
        await self.r.delete(Keys.samples(run_id, step), *sets)

    async def retire(self, run_id: str) -> None:
        """An ended run: archive what Redis still holds of it (its record, step records with
        their final counters, warnings, events), then let every key of it expire after the
        retention time. Re-run harmlessly after a crash (the startup sweep does). A write for
        the run after this (a late chunk, hand-back, event, step) gives each key it creates
        the record's time left, in the script that writes it (lua/retired.lua)."""
        raw = await self.r.hgetall(Keys.run(run_id))
        run = await self.get(run_id)
        if not raw or run is None:
            return
        events = await self.r.xrange(Keys.events(run_id))
        await self.archive.write_run(run_id, {
            "run": run, "records": await self.step_records(run_id),
            "warnings": await self.warnings(run_id),
            "checkpoints": json.loads(raw.get("checkpoints") or "[]"),
            "events": [[entry_id, fields] for entry_id, fields in events]})
        # Listed as expiring first: a crash before the run's own keys are set to expire
        # leaves it unretired, and the startup sweep retires it again.
        await self.r.zadd(Keys.expiring, {run_id: int(time.time() * 1000) + self.retention_ms})
        pipe = self.r.pipeline(transaction=True)  # the run's keys: one slot
        for key in await self._keys(run_id, int(raw["step"])):
            pipe.pexpire(key, self.retention_ms)
        pipe.hset(Keys.run(run_id), "retired", 1)
        pipe.pexpire(Keys.run(run_id), self.retention_ms)
        await pipe.execute()

    async def prune(self, batch: int = 1000) -> int:
        """Take runs whose keys expired out of the runs index (the archive lists them now);
        how many left. The manager calls this periodically. A run whose record still lives
        (resumed) stays listed."""
        due = await self.r.zrangebyscore(Keys.expiring, "-inf", int(time.time() * 1000),
                                         start=0, num=batch)
        if not due:
            return 0
        pipe = self.r.pipeline(transaction=False)
        for run_id in due:
            pipe.exists(Keys.run(run_id))
        gone = [run_id for run_id, alive in zip(due, await pipe.execute(), strict=True)
                if not alive]
        if gone:
            pipe = self.r.pipeline(transaction=False)
            pipe.zrem(Keys.runs, *gone)
            pipe.zrem(Keys.expiring, *gone)
            await pipe.execute()
        return len(gone)

    async def _keys(self, run_id: str, step: int) -> list[str]:
        """Every key of the run but its hash, for steps up to ``step`` (leases are left to
        their own short TTL)."""
        keys = [Keys.step_records(run_id), Keys.run_warnings(run_id), Keys.events(run_id),
                Keys.run_instances(run_id), Keys.seeding(run_id), Keys.holders(run_id)]
        keys += [Keys.held(run_id, i) for i in await self.r.smembers(Keys.holders(run_id))]
        for n in range(step + 1):  # the current step too, if the run ended inside it
            sets = Keys.step_sets(run_id, n)
            pipe = self.r.pipeline(transaction=False)
            for key in sets:
                pipe.smembers(key)
            keys += [k for rid in set().union(*await pipe.execute())
                     for k in Keys.response(rid)]
            keys += [Keys.step(run_id, n), Keys.samples(run_id, n), *sets]
        return keys

    async def sweep(self, recent: int = 1000) -> None:
        """Retire the ended runs a killed manager never retired, and queue the queued runs
        it never queued (a resume cut before its queueing), among the newest."""
        queued = set(await self.r.lrange(Keys.queue, 0, -1))
        queued.add(await self.r.get(Keys.active) or "")
        for run_id in await self.r.zrevrange(Keys.runs, 0, recent - 1):
            state, retired = await self.r.hmget(Keys.run(run_id), ["state", "retired"])
            if state in TERMINAL and not retired:
                await self.retire(run_id)
            elif (state == "queued" and run_id not in queued
                  and await self.r.lpos(Keys.queue, run_id) is None
                  and await self.r.get(Keys.active) != run_id):  # queued since the snapshot
                await self._requeue(run_id)
