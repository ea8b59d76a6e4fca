"""Writes that land after a run is retired, on a real redis-server: every key they create or
reset expires with the run (the scripts give it the run record's time left), none is left
without a TTL; and a live run's keys get no TTL from the same code."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from manager_svc.registry import Registry
from rlboost.stack import Stack
from shared.names import Keys, request_id
from shared.protocol import FrameEntry, Heartbeat, Held, Release, TokenFrame
from tests.support.registry import registry_with_run

RETENTION_S = 600.0


@pytest.fixture
async def parts(brokers: Stack, tmp_path: Path) -> AsyncIterator[tuple[Registry, str]]:
    async with registry_with_run(brokers, tmp_path, 30.0, RETENTION_S) as got:
        yield got


def final_chunk(rid: str, instance: str, epoch: int) -> TokenFrame:
    return TokenFrame(instance_id=instance, entries=[FrameEntry.of(
        request_id=rid, epoch=epoch, weight_version=0, offset=0, token_ids=[5, 6], final=True,
        finish_reason="stop")])


async def ttls(r: aioredis.Redis, run_id: str) -> dict[str, int]:
    """Every key of the run (its hash tag) and its PTTL in ms (-1: none)."""
    return {str(k): await r.pttl(k) async for k in r.scan_iter(match=f"*{{{run_id}}}*")}


async def test_late_commit_revoke_lease_event_warning_and_step_all_expire_with_the_run(
        parts: tuple[Registry, str]) -> None:
    registry, run_id = parts
    ledger, runs, r = registry.ledger, registry.runs, registry.ledger.r
    rids = [request_id(run_id, 0, p, s) for p in range(2) for s in range(2)]
    leases = [await ledger.assign(rid, "i1" if i < 2 else "i2", 1.0, 0, 2)
              for i, rid in enumerate(rids)]
    assert all(leases) and not await r.exists(Keys.pending(run_id, 0))  # all four leased
    # A live run's writes get no TTL: the late-write code reads the record's and does nothing.
    a = leases[3]
    assert a is not None
    assert [x.status for x in await ledger.commit(final_chunk(rids[3], "i2", a.epoch))] == [
        "final"]
    assert await r.pttl(Keys.done(run_id, 0)) == -1

    await runs.cancel(run_id)  # retired: every key it has now expires in RETENTION_S
    assert 0 < await r.pttl(Keys.run(run_id)) <= RETENTION_S * 1000
    created = {Keys.tokens(rids[0]), Keys.pending(run_id, 0), Keys.events(run_id),
               Keys.run_warnings(run_id), Keys.samples(run_id, 0), Keys.held(run_id, "i3")}
    assert not any([await r.exists(k) for k in created])  # each made below, after retirement

    # A late final chunk of a lease still valid: its tokens and the done set.
    first = leases[0]
    assert first is not None
    [result] = await ledger.commit(final_chunk(rids[0], "i1", first.epoch))
    assert result.status == "final"
    # Late hand-backs and a heartbeat naming one: the pending set is made again.
    second = leases[1]
    assert second is not None
    third = leases[2]
    assert third is not None
    for instance, rid, epoch in (("i1", rids[1], second.epoch), ("i2", rids[2], third.epoch)):
        await registry.on_release(Release(instance_id=instance, held=[
            Held(request_id=rid, epoch=epoch)], reason="shutdown", leaving=False))
    await registry.on_heartbeat(Heartbeat(
        instance_id="i1", kind="spot", engine="emu", state="ready", run_id=run_id,
        weight_version=0, held=[Held(request_id=rids[2], epoch=1)], capacity=2, session="s1"))
    # A dispatch pass that read the run before it ended leases it to a new holder.
    assert await ledger.assign(rids[1], "i3", 1.0, 0, 2) is not None
    # The manager's own late writes: an event, a warning; and the trainer's late step record.
    await registry.events.left(run_id, "i1", "spot", "preempt", "s1")
    await runs.warn(run_id, "noted as the run ended")
    await runs.finish_step(run_id, 0, {"step": 0}, "[]", steps=40)

    keys = await ttls(r, run_id)
    assert created <= keys.keys(), created - keys.keys()
    assert [k for k, ttl in keys.items() if ttl < 0] == []
    record = await r.pttl(Keys.run(run_id))
    # Leases keep their own, shorter TTL; everything else ends with the run's record.
    assert all(abs(ttl - record) < 5_000 for k, ttl in keys.items()
               if not k.startswith(Keys.lease(rids[0]).split("{")[0]))
