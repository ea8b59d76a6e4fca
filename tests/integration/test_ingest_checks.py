"""Ingest's checks against real NATS JetStream and Redis: once a run's frames decode with its
vocabulary's bounds, an entry outside the vocabulary is still dropped alone (its frame's others
commit), and a malformed frame is still terminated as one."""

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
from shared import names
from shared.bus import connect_nats, connect_redis, ensure_chunk_stream
from shared.errors import ProtocolError
from shared.names import Keys, request_id
from shared.protocol import (
    FrameEntry,
    RunSpec,
    TokenFrame,
    decode,
    decode_frame,
    encode,
    entry_mac,
)
from shared.stack import Stack

VOCAB = 1000


def test_frames_decode_within_their_vocabulary() -> None:
    frame = TokenFrame(instance_id="i0", entries=[FrameEntry(
        request_id="r:0:0:0", epoch=1, weight_version=0, offset=0, token_ids=[0, 999])])
    got = decode_frame(encode(frame), VOCAB)
    assert isinstance(got, TokenFrame) and decode(encode(got), TokenFrame) == frame
    for ids in ([1000], [-1], [5, 10**9]):
        frame.entries[0].token_ids = ids
        with pytest.raises(ProtocolError):
            decode_frame(encode(frame), VOCAB)
    frame.entries[0].token_ids = [10**9]  # a vocabulary of 0 is not checked, the sign is
    assert decode_frame(encode(frame), 0).entries[0].token_ids == [10**9]


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

        def frame(tokens: list[list[int]], offset: int) -> bytes:
            entries = []
            for a, ids in zip(leases, tokens, strict=False):
                entry = FrameEntry(request_id=a.request_id, epoch=a.epoch, weight_version=0,
                                   offset=offset, token_ids=ids)
                entry.mac = entry_mac(a.lease_key, "i0", entry)
                entries.append(entry)
            return encode(TokenFrame(instance_id="i0", entries=entries))

        subject = names.chunk_subject(run_id, "i0")
        # The first frame teaches ingest the run's vocabulary; the second decodes with its
        # bounds and fails them: two of its four entries are outside it, the others commit.
        await js.publish(subject, frame([[1, 2]] * 4, 0))
        await js.publish(subject, frame([[3], [VOCAB], [4], [-5]], 2))
        await js.publish(subject, frame([[5]] * 4, 3).replace(b"[5]", b'["5"]', 1))
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
        assert malformed == 1  # the third frame, one token a string: terminated whole
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await nc.close()
        await redis.aclose()
