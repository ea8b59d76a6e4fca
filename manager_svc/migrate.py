"""Moving a Redis written before keys carried hash tags to the tagged names.

Contract: :func:`migrate` runs once per manager start, before anything reads Redis. On a
Redis whose keys already have their tagged names (a new one, any cluster: it marks
:data:`LAYOUT_KEY`) it costs one GET. On a Redis an earlier release wrote it renames every
key of the old names to its name in :class:`shared.names.Keys` (a run's keys take the run's
tag, the control keys ``{rlb}``, TTLs kept) and splits each instance's held set, which held
the responses of every run, into one set per run. So an upgrade in the middle of a run goes
on where it stopped: leases, committed tokens, the chunk MAC secret and the run queue are the
same data under new names. Two replicas starting at once may both run it: every rename is
atomic and refuses to overwrite (RENAMENX), and a key the other replica moved first is simply
gone. Start the new release's managers only after the old ones have stopped: an old manager
still writing old names after the move would be writing keys nobody reads.
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shared.names import CONTROL, PREFIX, Keys, parse_request_id

log = logging.getLogger("manager")
LAYOUT_KEY = f"{CONTROL}:layout"  # the layout of the keys: "2" once every key is tagged
LAYOUT = "2"
# Old names whose third part is a run id: rlb:<kind>:<run>[:...] -> rlb:<kind>:{<run>}[:...]
_RUN_KINDS = frozenset({"run", "step", "seeding", "steps", "samples", "events", "req", "lease"})
# Control keys and per-instance control keys by their old names.
_CONTROL = {f"{PREFIX}:runs": Keys.runs, f"{PREFIX}:runq": Keys.queue,
            f"{PREFIX}:runs:expiring": Keys.expiring, f"{PREFIX}:active": Keys.active,
            f"{PREFIX}:instances": Keys.instances,
            f"{PREFIX}:leader:dispatch": Keys.dispatch_leader,
            f"{PREFIX}:chunk-key": Keys.chunk_key()}
_PER_INSTANCE = frozenset({"inst", "identity", "departed"})


def tagged_name(key: str) -> str | None:
    """The tagged name of a key of the old layout; None for a key that is no such key (a
    tagged one, another program's, or an instance's held set: :func:`_split_held`)."""
    if "{" in key or not key.startswith(f"{PREFIX}:"):
        return None
    if key in _CONTROL:
        return _CONTROL[key]
    parts = key.split(":")
    if len(parts) < 3:
        return None
    kind, owner, rest = parts[1], parts[2], parts[3:]
    if kind in _PER_INSTANCE and not rest:
        return f"{CONTROL}:{kind}:{owner}"
    if kind in _RUN_KINDS:
        return ":".join([PREFIX, kind, "{" + owner + "}", *rest])
    return None


def _held_instance(key: str) -> str | None:
    """The instance of an old-layout held set (``rlb:inst:<id>:held``)."""
    parts = key.split(":")
    if len(parts) == 4 and parts[:2] == [PREFIX, "inst"] and parts[3] == "held":
        return parts[2]
    return None


async def migrate(redis: aioredis.Redis) -> int:
    """Move every key of the old layout to its tagged name; returns how many moved."""
    if await redis.get(LAYOUT_KEY) == LAYOUT:
        return 0
    moved = 0
    async for key in redis.scan_iter(match=f"{PREFIX}:*", count=1000):
        if (instance := _held_instance(key)) is not None:
            moved += await _split_held(redis, key, instance)
        elif (new := tagged_name(key)) is not None:
            try:
                if await redis.renamenx(key, new):
                    moved += 1
                else:
                    log.warning("kept %s: %s exists already", key, new)
            except ResponseError:  # another replica moved it first
                continue
    await redis.set(LAYOUT_KEY, LAYOUT)
    if moved:
        log.info("moved %d Redis keys to their hash-tagged names", moved)
    return moved


async def _split_held(redis: aioredis.Redis, key: str, instance: str) -> int:
    """One instance's held set of every run becomes one set per run, listed as a holder."""
    by_run: dict[str, list[str]] = {}
    for rid in await redis.smembers(key):
        by_run.setdefault(parse_request_id(rid)[0], []).append(rid)
    for run_id, rids in by_run.items():
        pipe = redis.pipeline(transaction=True)  # one slot: the run's
        pipe.sadd(Keys.held(run_id, instance), *rids)
        pipe.sadd(Keys.holders(run_id), instance)
        await pipe.execute()
    await redis.delete(key)
    return 1
