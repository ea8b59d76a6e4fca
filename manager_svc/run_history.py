"""What a run has done, as the REST API and the trainer read it: finished-step records with
their live fault counters, checkpoints, warnings, a step's progress and the samples it trained
on. Redis serves them while the run's keys live, the archive (:mod:`manager_svc.archive`) once
they have expired. :class:`~manager_svc.runs.RunStore` is one, with the run's lifecycle on top.
"""

from __future__ import annotations

import json
from typing import Any

import redis.asyncio as aioredis

from manager_svc.archive import Archive
from manager_svc.scripts import register
from shared.names import Keys

# Step counters that can still move after the step's record is written (a zombie's late chunks).
LIVE_COUNTERS = ("migrations", "preemptions", "preempted_responses", "duplicate_chunks_dropped",
                 "stale_chunks_rejected", "tokens_regenerated", "forged_chunks_rejected",
                 "invalid_chunks_dropped", "tokens_discarded",
                 # agentic runs (manager_svc/turns.py): environment answers committed, and the
                 # observation tokens they added
                 "tool_calls_committed", "tokens_observed")
WARNINGS_MAX = 50  # warnings kept per run


class RunHistory:
    def __init__(self, redis: aioredis.Redis, archive: Archive) -> None:
        self.r = redis
        self.archive = archive
        self._expire_late = register(redis, "expire_with_run.lua")

    async def checkpoints(self, run_id: str) -> list[dict[str, Any]] | None:
        """The versions kept for the user, oldest first, each with the step that made it
        (version v holds the weights after step v - 1); None for an unknown run."""
        raw = await self.r.hmget(Keys.run(run_id), ["id", "checkpoints"])
        if raw[0] is not None:
            versions = json.loads(raw[1] or "[]")
        else:  # expired: the archive's (and its step records come from there too)
            archived = await self.archive.run(run_id)
            if archived is None:
                return None
            versions = archived.get("checkpoints", [])
        found = []
        for version in versions:
            [record] = await self.step_records(run_id, version - 1, version - 1) or [{}]
            found.append({"version": version, "step": version - 1,
                          "reward_mean": record.get("reward_mean"),
                          "saved_at": record.get("finished_at")})
        return found

    async def steps(self, run_id: str, start: int = 0, end: int = -1) -> list[dict[str, Any]]:
        return [json.loads(x)
                for x in await self.r.lrange(Keys.step_records(run_id), start, end)]

    async def _archived_records(self, run_id: str, start: int, end: int
                                ) -> list[dict[str, Any]] | None:
        archived = None if await self.r.exists(Keys.step_records(run_id)) else \
            await self.archive.run(run_id)
        if archived is None:
            return None
        records: list[dict[str, Any]] = archived["records"]
        return records[start:None if end == -1 else end + 1]

    async def step_records(self, run_id: str, start: int = 0,
                           end: int = -1) -> list[dict[str, Any]]:
        """Finished-step records ``start..end`` (inclusive, -1 = the last) with their fault
        counters read live: a zombie that wakes after its step finished still has its
        rejected chunks counted against that step. After the run's keys expired, the
        archive's records, with the counters as they were when the run ended."""
        archived = await self._archived_records(run_id, start, end)
        if archived is not None:
            return archived
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
            # A warning noted as the run ends expires with it (as events do: InstanceEvents).
            await self._expire_late(keys=[Keys.run(run_id), key])

    async def warnings(self, run_id: str) -> list[str]:
        found = list(await self.r.lrange(Keys.run_warnings(run_id), 0, -1))
        if found or await self.r.exists(Keys.run(run_id)):
            return found
        archived = await self.archive.run(run_id)
        return list(archived["warnings"]) if archived else []

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
        if raw is None:
            archived = await self.archive.step(run_id, step)
            raw = None if archived is None else archived["samples"]
        return None if raw is None else list(json.loads(raw))
