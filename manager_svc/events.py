"""Instance events of a run: who joined, which weight version each loaded, who left and how.

Contract: each event is one entry of the run's capped Redis stream (``Keys.events``), written
where the manager learns of it: a *join* is an instance's first heartbeat under a process
session while the run is active (instances already up when a run starts join it at its first
beat), a *version* is a heartbeat reporting a newly loaded weight version of the run, a
*leave* is a release (``reason`` preempt, shutdown or abort), a *death* is the reaper finding
a heartbeat expired, a *quarantine* an instance given no more work (``reason`` says why).
Join and version are recorded by the heartbeat's own script (``lua/observe.lua`` inside
``lua/beat_run.lua``, :mod:`manager_svc.registry`), so a change is recorded once however
beats interleave. Stream ids are Redis's clock in ms, so an event's time is its id;
:meth:`InstanceEvents.read` pages by id. The stream is capped at
:data:`MAX_EVENTS` (trimmed approximately, oldest first): 1,000 steps of 100 instances each
loading every version fit. When an ended run's stream expires, :meth:`InstanceEvents.read`
pages the same events from its archive (:mod:`manager_svc.archive`). Events are for people
(the dashboard's timeline); nothing in the control plane reads them back.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from manager_svc.archive import Archive
from manager_svc.scripts import register
from shared.names import Keys

MAX_EVENTS = 120_000
PAGE_MAX = 20_000


def _event(entry_id: str, fields: dict[str, str]) -> dict[str, Any]:
    version = int(fields.get("version", "-1"))
    return {"id": entry_id, "t": int(entry_id.split("-", 1)[0]) / 1000.0,
            "type": fields.get("type", ""), "instance": fields.get("instance", ""),
            "kind": fields.get("kind") or None, "version": None if version < 0 else version,
            "reason": fields.get("reason") or None}


class InstanceEvents:
    def __init__(self, redis: aioredis.Redis, archive: Archive) -> None:
        self.redis = redis
        self.archive = archive  # an ended run's events, once its stream expired
        self._expire_late = register(redis, "expire_with_run.lua")

    async def left(self, run_id: str, instance_id: str, kind: str | None, reason: str,
                   session: str = "") -> None:
        """The process ``session`` released its work and left: a beat of it that arrives
        after this is no join (lua/observe.lua), a later process under the id is one."""
        await self._add(run_id, {"type": "leave", "instance": instance_id, "kind": kind or "",
                                 "reason": reason}, f"{session}|left" if session else None)

    async def died(self, run_id: str, instance_id: str) -> None:
        await self._add(run_id, {"type": "death", "instance": instance_id, "reason": "silent"})

    async def quarantined(self, run_id: str, instance_id: str, reason: str) -> None:
        """The instance gets no more work in the run (:mod:`manager_svc.quarantine`). It is
        still up, so its join mark stays: its next beat is no new join."""
        await self.redis.xadd(Keys.events(run_id), {
            "type": "quarantine", "instance": instance_id, "reason": reason[:200]},
            maxlen=MAX_EVENTS, approximate=True)

    async def _add(self, run_id: str, fields: dict[str, str], mark: str | None = None) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.xadd(Keys.events(run_id), fields, maxlen=MAX_EVENTS, approximate=True)
        # A process that rejoins under the same id after leaving or dying is a new join.
        if mark:
            pipe.hset(Keys.run_instances(run_id), fields["instance"], mark)
        else:
            pipe.hdel(Keys.run_instances(run_id), fields["instance"])
        await pipe.execute()
        # An instance may leave or die just after its run was retired: the stream (and the
        # hash) then expire with the run. Run after the write, not with it: a retirement
        # between the two gives them its TTL itself (RunStore.retire).
        await self._expire_late(keys=[Keys.run(run_id), Keys.events(run_id),
                                      Keys.run_instances(run_id)])

    async def read(self, run_id: str, after: str | None = None,
                   limit: int = PAGE_MAX) -> list[dict[str, Any]]:
        """Events after the id ``after`` (from the first without it), oldest first."""
        start = f"({after}" if after else "-"
        count = max(1, min(limit, PAGE_MAX))
        rows = await self.redis.xrange(Keys.events(run_id), min=start, max="+", count=count)
        if not rows and not await self.redis.exists(Keys.events(run_id)):
            archived = await self.archive.run(run_id)
            seen = _id_key(after) if after else (-1, -1)
            rows = [(entry_id, fields) for entry_id, fields in (archived or {}).get("events", [])
                    if _id_key(entry_id) > seen][:count]
        return [_event(entry_id, fields) for entry_id, fields in rows]


def _id_key(entry_id: str) -> tuple[int, int]:
    """A stream id as the (ms, sequence) pair Redis orders them by."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
