"""Ingest's checks against real NATS JetStream and Redis: an entry whose packed token ids fall
outside the run's vocabulary, or are not whole ids, is dropped alone (its frame's others
commit), and a malformed frame is terminated as one."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

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
from shared.protocol import FrameEntry, TokenFrame, decode, encode, pack_token_ids, unpack_token_ids
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


async def test_an_entry_outside_the_vocabulary_is_dropped_alone(brokers: Stack,
                                                                tmp_path: Path) -> None:
    redis = await connect_redis(brokers.redis.url)
    nc = await connect_nats(brokers.nats.url, "test-ingest-checks")
    task: asyncio.Task[None] | None = None
    try:
        js = nc.jetstream()
        await ensure_chunk_stream(js)
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

        def frame(tokens: list[list[int] | bytes], offset: int) -> bytes:
            entries = []
            for a, ids in zip(leases, tokens, strict=False):
                entry = FrameEntry.of(request_id=a.request_id, epoch=a.epoch, weight_version=0,
                                      offset=offset, token_ids=[])
                entry.tokens = ids if isinstance(ids, bytes) else pack_token_ids(ids)
                entry.mac = entry_mac(a.lease_key, "i0", entry)
                entries.append(entry)
            return encode(TokenFrame(instance_id="i0", entries=entries))

        subject = names.chunk_subject(run_id, "i0")
        # Of the second frame's four entries (each with a good MAC), one is outside the
        # vocabulary and one is five bytes, not whole ids: those two are dropped, the others
        # commit. The third is not a frame at all (its first tokens are not base64).
        await js.publish(subject, frame([[1, 2]] * 4, 0))
        await js.publish(subject, frame([[3], [VOCAB], [4], pack_token_ids([5]) + b"\0"], 2))
        await js.publish(subject, frame([[5]] * 4, 3).replace(b'"tokens":"', b'"tokens":"!', 1))
        metrics = ManagerMetrics()
        ingest = ChunkIngest(redis, nc, ledger, runs, metrics, SoftState(), auth)
        task = asyncio.create_task(ingest.consume())
        skey = Keys.step(run_id, 0)
        for _ in range(100):  # until every frame is acked or terminated
            if (await js.stream_info(names.CHUNK_STREAM)).state.messages == 0:
                break
            await asyncio.sleep(0.05)
        assert await redis.hget(skey, "invalid_chunks_dropped") == "2"
        committed = [await redis.get(Keys.tokens(a.request_id)) for a in leases]
        assert committed == ["1,2,3", "1,2", "1,2,4", "1,2"]
        malformed = metrics.malformed.labels(names.CHUNK_WILDCARD)._value.get()
        assert malformed == 1  # the third frame, one entry's tokens not base64: terminated
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await nc.close()
        await redis.aclose()
