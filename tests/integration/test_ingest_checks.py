"""Ingest's checks against real NATS JetStream and Redis: an entry whose packed token ids fall
outside the run's vocabulary, or are not whole ids, is dropped alone (its frame's others
commit), a malformed frame is terminated as one, and a frame's claimed kind counts only as its
sender's registered kind."""

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
from manager_svc.ingest import ChunkIngest
from manager_svc.metrics import ManagerMetrics
from manager_svc.runs import RunStore
from manager_svc.soft_state import SoftState
from rlboost.stack import Stack
from shared import names
from shared.bus import connect_nats, connect_redis, ensure_chunk_stream
from shared.mac import entry_mac
from shared.names import Keys, request_id
from shared.protocol import (
    Assignment,
    FrameEntry,
    InstanceKind,
    TokenFrame,
    decode,
    encode,
    pack_token_ids,
    unpack_token_ids,
)
from shared.spec import RunSpec

VOCAB = 1000


def test_token_ids_travel_packed() -> None:
    ids = [0, 999, 70_000, 2**32 - 1]
    frame = TokenFrame(instance_id="i0", entries=[FrameEntry.of(
        request_id="r:0:0:0", epoch=1, weight_version=0, offset=0, token_ids=ids)])
    data = encode(frame)
    assert b'"tokens":"' in data and b"70000" not in data  # base64, not a JSON array
    got = decode(data, TokenFrame)
    assert got == frame and got.entries[0].token_ids == ids and got.entries[0].n_tokens == 4
    assert pack_token_ids(ids)[:8] == bytes([0, 0, 0, 0, 0xE7, 3, 0, 0])  # little-endian
    for bad in ([-1], [2**32]):  # not an unsigned 32-bit id: cannot be sent at all
        with pytest.raises(OverflowError):
            pack_token_ids(bad)
    frame.entries[0].tokens += b"\x01"
    part = decode(encode(frame), TokenFrame).entries[0]
    assert not part.whole
    with pytest.raises(ValueError):
        unpack_token_ids(part.tokens)


@dataclass
class Parts:
    redis: aioredis.Redis
    nc: Nats
    runs: RunStore
    ledger: Ledger
    auth: ChunkAuth
    run_id: str
    leases: list[Assignment]


@pytest.fixture
async def parts(brokers: Stack, tmp_path: Path) -> AsyncIterator[Parts]:
    """A run at step 0 of four responses, each leased to i0, and the chunk stream."""
    redis = await connect_redis(brokers.redis.url)
    await redis.flushdb()
    nc = await connect_nats(brokers.nats.url, "test-ingest-checks")
    await ensure_chunk_stream(nc.jetstream())
    runs = RunStore(redis, Archive(tmp_path))
    run_id = (await runs.create(RunSpec(model="emu", samples_per_prompt=4,
                                        prompts_per_step=1)))["id"]
    auth = ChunkAuth(b"k" * 32)
    ledger = Ledger(redis, lease_ttl_s=60.0, lease_key=auth.lease_key)
    await ledger.create_step(run_id, 0, 0, [[1, 2]], 4, 64, extra={"vocab": VOCAB})
    leases = []
    for s in range(4):
        a = await ledger.assign(request_id(run_id, 0, 0, s), "i0", 1.0, 0, 2)
        assert a is not None
        leases.append(a)
    yield Parts(redis, nc, runs, ledger, auth, run_id, leases)
    await nc.close()
    await redis.aclose()


def frame(leases: list[Assignment], tokens: list[list[int] | bytes], offset: int,
          instance: str = "i0", kind: InstanceKind = "spot") -> bytes:
    entries = []
    for a, ids in zip(leases, tokens, strict=False):
        entry = FrameEntry.of(request_id=a.request_id, epoch=a.epoch, weight_version=0,
                              offset=offset, token_ids=[])
        entry.tokens = ids if isinstance(ids, bytes) else pack_token_ids(ids)
        entry.mac = entry_mac(a.lease_key, instance, entry)
        entries.append(entry)
    return encode(TokenFrame(instance_id=instance, kind=kind, entries=entries))


async def ingested(p: Parts, metrics: ManagerMetrics) -> None:
    """Run ingest until every frame in the stream is acked or terminated."""
    js = p.nc.jetstream()
    ingest = ChunkIngest(p.redis, p.nc, p.ledger, p.runs, metrics, SoftState(), p.auth)
    task = asyncio.create_task(ingest.consume())
    try:
        for _ in range(100):
            if (await js.stream_info(names.CHUNK_STREAM)).state.messages == 0:
                break
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_an_entry_outside_the_vocabulary_is_dropped_alone(parts: Parts) -> None:
    p, js, own = parts, parts.nc.jetstream(), parts.leases
    subject = names.chunk_subject(p.run_id, "i0")
    # Of the second frame's four entries (each with a good MAC), one is outside the
    # vocabulary and one is five bytes, not whole ids: those two are dropped, the others
    # commit. The third is not a frame at all (its first tokens are not base64).
    await js.publish(subject, frame(own, [[1, 2]] * 4, 0))
    await js.publish(subject, frame(own, [[3], [VOCAB], [4], pack_token_ids([5]) + b"\0"], 2))
    await js.publish(subject, frame(own, [[5]] * 4, 3).replace(b'"tokens":"', b'"tokens":"!', 1))
    metrics = ManagerMetrics()
    await ingested(p, metrics)
    assert await p.redis.hget(Keys.step(p.run_id, 0), "invalid_chunks_dropped") == "2"
    committed = [await p.redis.get(Keys.tokens(a.request_id)) for a in own]
    assert committed == ["1,2,3", "1,2", "1,2,4", "1,2"]
    malformed = metrics.malformed.labels(names.CHUNK_WILDCARD)._value.get()
    assert malformed == 1  # the third frame, one entry's tokens not base64: terminated


async def test_tokens_count_as_reserved_only_from_a_reserved_sender(parts: Parts) -> None:
    """A frame's ``kind`` feeds the step's per-side counts (the seeding controller's input):
    one claiming ``reserved`` counts so only if its sender is registered reserved (the
    registry takes that from the credential); a spot sender's claim counts as spot, and is
    counted as a refused claim."""
    p, js = parts, parts.nc.jetstream()
    await p.redis.hset(Keys.instance("i0"), mapping={"kind": "spot"})
    await p.redis.hset(Keys.instance("r0"), mapping={"kind": "reserved"})
    theirs = []
    for a in p.leases[2:]:  # the last two move to r0
        assert await p.ledger.revoke(a.request_id)
        moved = await p.ledger.assign(a.request_id, "r0", 1.0, 0, 2)
        assert moved is not None
        theirs.append(moved)
    for instance, leases in (("i0", p.leases[:2]), ("r0", theirs)):
        await js.publish(names.chunk_subject(p.run_id, instance),
                         frame(leases, [[1, 2, 3]] * 2, 0, instance, kind="reserved"))
    metrics = ManagerMetrics()
    await ingested(p, metrics)
    step = await p.redis.hgetall(Keys.step(p.run_id, 0))
    assert (step["tokens_spot"], step["tokens_reserved"]) == ("6", "6"), step
    assert metrics.kind_refused._value.get() == 1
