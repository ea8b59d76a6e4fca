"""Quarantine against real NATS JetStream and Redis: an instance whose entries are garbage past
the threshold loses its leases and gets no more work, named in the run's record and in the
instance list; an engine that cannot serve the run's model is quarantined before it is leased
anything, and a run that only such instances could serve fails naming the mismatch."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from nats.aio.client import Client as Nats

from manager_svc.accounting import Ledger
from manager_svc.archive import Archive
from manager_svc.chunk_auth import ChunkAuth
from manager_svc.crash import CrashPoints
from manager_svc.dispatcher import Dispatcher
from manager_svc.events import InstanceEvents
from manager_svc.ingest import ChunkIngest
from manager_svc.metrics import ManagerMetrics
from manager_svc.quarantine import Quarantine
from manager_svc.registry import Registry
from manager_svc.runs import RunStore
from manager_svc.soft_state import SoftState
from rlboost.stack import Stack
from shared import names
from shared.bus import connect_nats, connect_redis, ensure_chunk_stream
from shared.config import ManagerConfig
from shared.mac import entry_mac
from shared.names import Keys, request_id
from shared.protocol import Assignment, FrameEntry, Heartbeat, Revoke, TokenFrame, decode, encode
from shared.spec import RunSpec

VOCAB = 1000
AFTER = 6  # entries that quarantine their sender here (the default is 16)


@dataclass
class Parts:
    redis: aioredis.Redis
    nc: Nats
    runs: RunStore
    ledger: Ledger
    registry: Registry
    metrics: ManagerMetrics
    soft: SoftState
    auth: ChunkAuth
    tmp: Path


@pytest.fixture
async def parts(brokers: Stack, tmp_path: Path) -> AsyncIterator[Parts]:
    redis = await connect_redis(brokers.redis.url)
    await redis.flushdb()
    nc = await connect_nats(brokers.nats.url, "test-quarantine")
    await ensure_chunk_stream(nc.jetstream())
    archive = Archive(tmp_path)
    runs = RunStore(redis, archive)
    auth = ChunkAuth(b"k" * 32)
    ledger = Ledger(redis, lease_ttl_s=60.0, lease_key=auth.lease_key)
    metrics, soft = ManagerMetrics(), SoftState()
    registry = Registry(ManagerConfig.from_env({}), redis, ledger, runs, metrics, soft,
                        InstanceEvents(redis, archive), CrashPoints("", tmp_path))
    yield Parts(redis, nc, runs, ledger, registry, metrics, soft, auth, tmp_path)
    await nc.close()
    await redis.aclose()


async def running(p: Parts, spec: RunSpec, prompts: int, vocab: int) -> str:
    """A run made active, at step 0 with ``prompts`` prompts."""
    run_id = str((await p.runs.create(spec))["id"])
    assert await p.runs.active() == run_id
    await p.ledger.create_step(run_id, 0, 0, [[1, 2]] * prompts, spec.samples_per_prompt, 8,
                               extra={"vocab": vocab})
    return run_id


async def beat(p: Parts, instance_id: str, run_id: str, engine: str = "emu") -> None:
    await p.registry.on_heartbeat(Heartbeat(
        instance_id=instance_id, kind="spot", engine=engine, state="ready", run_id=run_id,
        weight_version=0, capacity=8))


def dispatcher(p: Parts, ingest: ChunkIngest) -> Dispatcher:
    return Dispatcher(p.registry.cfg, p.redis, p.nc, p.ledger, p.runs, p.registry, ingest,
                      p.metrics, p.soft, CrashPoints("", p.tmp), None)  # type: ignore[arg-type]


def screened(p: Parts, fail_s: float) -> tuple[Quarantine, Dispatcher]:
    """A quarantine failing unserved runs after ``fail_s``, and a dispatcher using it."""
    quarantine = Quarantine(p.redis, p.nc, p.ledger, p.runs, p.metrics, p.soft, fail_s=fail_s)
    return quarantine, dispatcher(p, ChunkIngest(p.redis, p.nc, p.ledger, p.runs, p.metrics,
                                                 p.soft, p.auth, quarantine=quarantine))


def frame(leases: list[Assignment], ids: list[int], mac_key: str | None = None) -> bytes:
    """One frame of ``leases`` from i0, each entry ``ids`` at offset 0 and MAC'd under its own
    lease key (or under ``mac_key``: forged)."""
    entries = []
    for a in leases:
        entry = FrameEntry.of(request_id=a.request_id, epoch=a.epoch, weight_version=0,
                              offset=0, token_ids=ids)
        entry.mac = entry_mac(mac_key or a.lease_key, "i0", entry)
        entries.append(entry)
    return encode(TokenFrame(instance_id="i0", entries=entries))


async def test_garbage_past_the_threshold_quarantines_its_sender(
        parts: Parts, caplog: pytest.LogCaptureFixture) -> None:
    p = parts
    run_id = await running(p, RunSpec(model="emu", prompts_per_step=2, samples_per_prompt=4),
                           2, VOCAB)
    for instance_id in ("i0", "i1"):
        await beat(p, instance_id, run_id)
    rids = [request_id(run_id, 0, prompt, sample) for prompt in (0, 1) for sample in range(4)]
    leases = [await p.ledger.assign(rid, "i0" if n < 4 else "i1", 1.0, 0, 2)
              for n, rid in enumerate(rids)]
    mine = [a for a in leases[:4] if a is not None]
    assert len(mine) == 4
    told: list[Revoke] = []

    async def on_command(msg: object) -> None:
        told.append(decode(msg.data, Revoke))  # type: ignore[attr-defined]

    await p.nc.subscribe(names.assign_subject("i0"), cb=on_command)
    js = p.nc.jetstream()
    subject = names.chunk_subject(run_id, "i0")
    # Four entries outside the vocabulary, then four whose MAC is under another key: the
    # sixth bad entry quarantines i0; the two after it are counted all the same.
    await js.publish(subject, frame(mine, [VOCAB]))
    await js.publish(subject, frame(mine, [5], mac_key="00" * 32))
    # Past the threshold too, on a subject naming a run that does not exist: counted, but no
    # key of that run is written (it would never expire).
    for _ in range(2):
        await js.publish(names.chunk_subject("run-nope", "i0"), frame(mine, [5]))
    quarantine = Quarantine(p.redis, p.nc, p.ledger, p.runs, p.metrics, p.soft, after=AFTER)
    ingest = ChunkIngest(p.redis, p.nc, p.ledger, p.runs, p.metrics, p.soft, p.auth,
                         quarantine=quarantine)
    task = asyncio.create_task(ingest.consume())
    try:
        for _ in range(100):
            if (await js.stream_info(names.CHUNK_STREAM)).state.messages == 0 and told:
                break
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    # Logged one line per kind (forged, invalid) now and then, not a line per entry.
    assert sum(r.getMessage().startswith(("forged entry", "invalid entry"))
               for r in caplog.records) == 2
    rejected = p.metrics.rejected_entries
    assert rejected.labels("vocabulary")._value.get() == 4
    assert rejected.labels("mac")._value.get() == 4
    assert rejected.labels("run")._value.get() == 8
    assert not await p.redis.exists(Keys.quarantined("run-nope"), Keys.run_warnings("run-nope"))
    assert p.metrics.quarantined.labels("invalid")._value.get() == 1
    reasons = await quarantine.reasons(run_id)
    assert reasons == {"i0": f"{AFTER} invalid entries, the last: bad MAC"}
    assert 0 < await p.redis.pttl(Keys.quarantined(run_id)) <= 3600_000  # Redis, with a TTL
    # Its leases are revoked (fenced: a new epoch) and it is told to stop on them.
    assert not await p.redis.smembers(Keys.held(run_id, "i0"))
    assert await p.redis.smembers(Keys.pending(run_id, 0)) == set(rids[:4])
    assert sorted(r for t in told for r in t.request_ids) == rids[:4]
    warnings = await p.runs.warnings(run_id)
    assert warnings == [f"instance i0 quarantined: {reasons['i0']}"]
    events = await p.registry.events.read(run_id)
    assert [(e["type"], e["instance"], e["reason"]) for e in events
            if e["type"] == "quarantine"] == [("quarantine", "i0", reasons["i0"])]
    listed = {i["id"]: i for i in await p.registry.instances()}
    assert (listed["i0"]["state"], listed["i0"]["reason"]) == ("quarantined", reasons["i0"])
    assert (listed["i1"]["state"], listed["i1"]["reason"]) == ("ready", None)
    # No new work for it, though it beats on and holds nothing: its four go to i1.
    await beat(p, "i0", run_id)
    assert await dispatcher(p, ingest).dispatch_once() == 4
    assert await p.redis.smembers(Keys.held(run_id, "i1")) == set(rids)
    assert not await p.redis.smembers(Keys.held(run_id, "i0"))


async def test_an_engine_that_cannot_serve_the_model_fails_a_run_only_it_could_serve(
        parts: Parts) -> None:
    p = parts
    run_id = await running(p, RunSpec(model="tiny", prompts_per_step=1, samples_per_prompt=2),
                           1, 14)
    await beat(p, "e0", run_id, engine="emu")
    quarantine, passes = screened(p, 0.5)
    assert await passes.dispatch_once() == 0  # quarantined before it is leased anything
    why = "engine emu cannot serve model tiny"
    assert await quarantine.reasons(run_id) == {"e0": why}
    assert (await p.runs.get(run_id) or {})["state"] == "running"  # not failed at once
    await asyncio.sleep(0.6)
    await beat(p, "e0", run_id, engine="emu")
    assert await passes.dispatch_once() == 0
    run = await p.runs.get(run_id) or {}
    assert run["state"] == "failed" and why in run["error"] and "e0" in run["error"], run
    assert await p.runs.active() is None
    assert await p.runs.warnings(run_id) == [
        f"instance e0 quarantined: {why}",
        "no instance can serve this run: every live one is quarantined"]
    assert p.metrics.quarantined.labels("mismatch")._value.get() == 1


async def test_a_healthy_instance_keeps_a_run_with_a_mismatched_one_going(parts: Parts) -> None:
    p = parts
    run_id = await running(p, RunSpec(model="tiny", prompts_per_step=1, samples_per_prompt=2),
                           1, 14)
    await beat(p, "e0", run_id, engine="emu")
    await beat(p, "t0", run_id, engine="torch")
    quarantine, passes = screened(p, 0.1)
    assert await passes.dispatch_once() == 2
    assert len(await p.redis.smembers(Keys.held(run_id, "t0"))) == 2
    await asyncio.sleep(0.2)
    await passes.dispatch_once()
    assert (await p.runs.get(run_id) or {})["state"] == "running"
    assert list(await quarantine.reasons(run_id)) == ["e0"]


async def test_a_run_with_no_instance_at_all_says_so_and_waits(
        parts: Parts, monkeypatch: pytest.MonkeyPatch) -> None:
    """Spot machines come and go: with none registered the run is not failed, but its record
    says what it waits for (after NONE_WARN_S, 30 s; 0 here)."""
    p = parts
    monkeypatch.setattr("manager_svc.quarantine.NONE_WARN_S", 0.0)
    run_id = await running(p, RunSpec(model="tiny", prompts_per_step=1, samples_per_prompt=2),
                           1, 14)
    _, passes = screened(p, 0.1)
    for _ in range(3):
        assert await passes.dispatch_once() == 0
        await asyncio.sleep(0.1)
    assert (await p.runs.get(run_id) or {})["state"] == "running"
    assert await p.runs.warnings(run_id) == [
        "no rollout instance is registered: the run waits for one"]


async def test_only_garbage_under_the_ids_current_key_quarantines_it(parts: Parts) -> None:
    """Entries are tallied per key: garbage from an older connection under an id (another
    key than the one its accepted beats name) never quarantines the newer process, however
    much of it comes; the same count under the current key does."""
    p = parts
    run_id = await running(p, RunSpec(model="emu", prompts_per_step=1, samples_per_prompt=2),
                           1, VOCAB)
    newer, older = "A" * names.FINGERPRINT_LEN, "B" * names.FINGERPRINT_LEN
    await p.registry.on_heartbeat(Heartbeat(
        instance_id="i0", kind="spot", engine="emu", state="ready", run_id=run_id,
        weight_version=0, capacity=8), key=newer)
    quarantine = Quarantine(p.redis, p.nc, p.ledger, p.runs, p.metrics, p.soft, after=AFTER)
    for _ in range(AFTER * 3):
        await quarantine.reject(run_id, "i0", "bad MAC", older)
    assert await quarantine.reasons(run_id) == {}
    for _ in range(AFTER):
        await quarantine.reject(run_id, "i0", "bad MAC", newer)
    assert list(await quarantine.reasons(run_id)) == ["i0"]
