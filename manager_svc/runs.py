"""Runs: the spec users submit, and their lifecycle in Redis.

Contract: a run is created from a validated :class:`~shared.protocol.RunSpec` and stored with
it; :meth:`RunStore.spec` gives the manager's parts that spec typed, while :meth:`RunStore.get`
serves the record, spec included, as the JSON the REST API returns. A run is created
``queued``, becomes ``running`` when the manager activates it (one at a time, FIFO), and ends
``succeeded``, ``failed`` or ``cancelled``. Its record, its finished steps and the samples each
step trained on are Redis data, so a restarted manager serves them unchanged.
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

from manager_svc.scripts import register
from shared.errors import RlboostError
from shared.names import Keys
from shared.protocol import RunSpec, decode, encode

RunState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
TERMINAL = ("succeeded", "failed", "cancelled")
# Step counters that can still move after the step's record is written (a zombie's late chunks).
LIVE_COUNTERS = ("migrations", "preemptions", "preempted_responses", "duplicate_chunks_dropped",
                 "stale_chunks_rejected", "tokens_regenerated", "forged_chunks_rejected",
                 "invalid_chunks_dropped")
WARNINGS_MAX = 50  # warnings kept per run


class RunConflict(RlboostError):
    """What was asked does not fit the run's state (the REST layer answers 409)."""


class RunStore:
    def __init__(self, redis: aioredis.Redis) -> None:
        self.r = redis
        self._activate = register(redis, "activate.lua")

    async def create(self, spec: RunSpec) -> dict[str, Any]:
        run_id = "run-" + uuid.uuid4().hex[:12]
        now = time.time()
        record = {"id": run_id, "state": "queued", "step": 0, "steps": spec.steps,
                  "spec": encode(spec).decode(), "created_at": now, "updated_at": now,
                  "error": ""}
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(Keys.run(run_id), mapping=record)
        pipe.zadd(Keys.runs, {run_id: now})
        pipe.rpush(Keys.queue, run_id)
        await pipe.execute()
        return await self.get(run_id) or {}

    async def get(self, run_id: str) -> dict[str, Any] | None:
        raw = await self.r.hgetall(Keys.run(run_id))
        if not raw:
            return None
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

    async def list_runs(self, limit: int = 100) -> list[dict[str, Any]]:
        ids = await self.r.zrevrange(Keys.runs, 0, limit - 1)
        runs = [await self.get(i) for i in ids]
        return [r for r in runs if r]

    async def set_state(self, run_id: str, state: RunState, error: str = "") -> None:
        await self.r.hset(Keys.run(run_id), mapping={"state": state, "updated_at": time.time(),
                                                     "error": error})

    async def active(self) -> str | None:
        """The running run, activating the next queued one if none is running.

        One atomic script (``lua/activate.lua``): the manager's handlers call this
        concurrently, and a check-then-act in Python let one caller see a half-activated run
        and deactivate it for good.
        """
        got = await self._activate(keys=[Keys.active, Keys.queue],
                                   args=[Keys.run(""), time.time()])
        return str(got) if got else None

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
            await self.set_state(run_id, "cancelled")
            if await self.r.get(Keys.active) == run_id:
                await self.r.delete(Keys.active)
        return await self.get(run_id)

    async def resume(self, run_id: str) -> dict[str, Any] | None:
        """Queue a failed or cancelled run again; None for an unknown run.

        It goes on at its step, the one after the last finished step: the trainer restores the
        checkpoint it wrote after that step, and the step's responses committed before the run
        stopped are kept (they were generated with that same version, so they stay on-policy
        and each is still trained on once). A run that finished no step has no checkpoint:
        :class:`RunConflict`, as for a run that is not failed or cancelled. Watched, so two
        concurrent resumes queue it once.
        """
        key = Keys.run(run_id)
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
                    pipe.rpush(Keys.queue, run_id)
                    await pipe.execute()
                    break
                except WatchError:
                    continue
        return await self.get(run_id)

    async def finish_step(
        self, run_id: str, step: int, record: dict[str, Any], samples_json: str, steps: int,
        checkpoints: list[int] | None = None,
    ) -> None:
        """Record step ``step`` and advance the run; the run succeeds after its last step.
        ``checkpoints``: the versions the trainer keeps for the user after this step."""
        pipe = self.r.pipeline(transaction=True)
        pipe.set(Keys.samples(run_id, step), samples_json)
        pipe.rpush(Keys.step_records(run_id), json.dumps(record))
        pipe.hset(Keys.run(run_id), mapping={"step": step + 1, "updated_at": time.time()})
        if checkpoints is not None:
            pipe.hset(Keys.run(run_id), "checkpoints", json.dumps(checkpoints))
        if step + 1 >= steps:
            pipe.hset(Keys.run(run_id), "state", "succeeded")
            pipe.delete(Keys.active)
        await pipe.execute()

    async def checkpoints(self, run_id: str) -> list[dict[str, Any]] | None:
        """The versions kept for the user, oldest first, each with the step that made it
        (version v holds the weights after step v - 1); None for an unknown run."""
        raw = await self.r.hmget(Keys.run(run_id), ["id", "checkpoints"])
        if raw[0] is None:
            return None
        found = []
        for version in json.loads(raw[1] or "[]"):
            [record] = await self.steps(run_id, version - 1, version - 1) or [{}]
            found.append({"version": version, "step": version - 1,
                          "reward_mean": record.get("reward_mean"),
                          "saved_at": record.get("finished_at")})
        return found

    async def steps(self, run_id: str, start: int = 0, end: int = -1) -> list[dict[str, Any]]:
        return [json.loads(x)
                for x in await self.r.lrange(Keys.step_records(run_id), start, end)]

    async def step_records(self, run_id: str, start: int = 0,
                           end: int = -1) -> list[dict[str, Any]]:
        """Finished-step records ``start..end`` (inclusive, -1 = the last) with their fault
        counters read live: a zombie that wakes after its step finished still has its
        rejected chunks counted against that step."""
        records = await self.steps(run_id, start, end)
        pipe = self.r.pipeline(transaction=False)
        for rec in records:
            pipe.hmget(Keys.step(run_id, rec["step"]), list(LIVE_COUNTERS))
        for rec, values in zip(records, await pipe.execute(), strict=True):
            for key, value in zip(LIVE_COUNTERS, values, strict=True):
                if value is not None:
                    rec[key] = int(value)
        return records

    async def warn(self, run_id: str, warning: str) -> None:
        """Note something the run goes on without; a warning already noted is not repeated."""
        key = Keys.run_warnings(run_id)
        if warning[:2000] not in await self.r.lrange(key, 0, WARNINGS_MAX - 1):
            pipe = self.r.pipeline(transaction=True)
            pipe.rpush(key, warning[:2000])
            pipe.ltrim(key, 0, WARNINGS_MAX - 1)
            await pipe.execute()

    async def warnings(self, run_id: str) -> list[str]:
        return list(await self.r.lrange(Keys.run_warnings(run_id), 0, -1))

    async def step_progress(self, run_id: str, step: int) -> dict[str, Any]:
        info = await self.r.hgetall(Keys.step(run_id, step))
        if not info:
            return {}
        total = int(info.get("total", 0))
        return {"step": step, "state": info.get("state"), "responses_total": total,
                "responses_done": total - int(info.get("remaining", total)),
                "tokens": int(info.get("tokens", 0))}

    async def samples(self, run_id: str, step: int) -> list[dict[str, Any]] | None:
        raw = await self.r.get(Keys.samples(run_id, step))
        return None if raw is None else list(json.loads(raw))
