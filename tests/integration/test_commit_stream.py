"""Pipelined commits against a real redis-server: batches sent before the ones ahead of them
answer still commit in the order they were sent, when the stream's connection is killed, when
Redis forgets its scripts and when Redis stops answering (SIGSTOP, past the stream's read
timeout) while batches are in flight. A batch that fails goes again after
the one before it, never overtaken by one sent later: an entry that ran early would find its
response's earlier entries missing (a gap, which takes the lease back)."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from typing import Any

import pytest
import redis.asyncio as aioredis

from manager_svc.accounting import Ledger, commit_statuses
from manager_svc.commit_stream import PIPELINED, CommitStream
from rlboost.stack import Stack
from shared.names import Keys
from shared.protocol import FrameEntry, TokenFrame

RUN, RESPONSES, FLUSH, FRAMES = "run-stream", 8, 4, 120
COMMITTED = ("ok", "final", "group", "step")


async def pipelined(stream: CommitStream, ledger: Ledger, batches: list[Any],
                    fault: dict[int, Any], again: list[int]) -> list[str]:
    """``batches`` through ``stream``, PIPELINED in flight, ``fault[i]()`` awaited as batch i
    is sent (so it lands while the batches before it may be running); ``again[0]`` counts
    the batches (or parts) sent again the slow way."""
    async def slow(calls: Any) -> list[Any]:
        again[0] += 1
        return await ledger.run_replies(calls, wait_for_redis=True)
    sent: list[asyncio.Future[list[Any]]] = []
    for i, calls in enumerate(batches):
        if len(sent) >= PIPELINED:
            await asyncio.wait([sent[-PIPELINED]])
        sent.append(asyncio.ensure_future(stream.commit(
            calls, sent[-1] if sent else None, slow)))
        if i in fault:
            await fault[i]()
    return [s for done in sent for s in commit_statuses(await done)]


@pytest.mark.parametrize("fault", ["connection-killed", "scripts-flushed", "redis-stopped"])
async def test_batches_commit_in_the_order_sent_through_a_fault(
        brokers: Stack, store: aioredis.Redis, fault: str) -> None:
    if fault == "redis-stopped":  # a read timeout the test can outwait
        store = aioredis.Redis.from_url(brokers.redis.url, decode_responses=True,
                                        socket_timeout=0.3)
    ledger = Ledger(store, lease_ttl_s=60)
    await ledger.create_step(RUN, 0, 0, [[1, 2]], samples=RESPONSES,
                             max_new_tokens=FLUSH * FRAMES)
    rids = [f"{RUN}:0:0:{s}" for s in range(RESPONSES)]
    epochs = {}
    for rid in rids:
        lease = await ledger.assign(rid, "i1", 1.0, 0, 2)
        assert lease is not None
        epochs[rid] = lease.epoch
    # One frame per flush with the next tokens of every response, each its own batch: a
    # response's entries are spread over every batch, so any reordering is a gap.
    def frame(n: int) -> TokenFrame:
        last = n == FRAMES - 1
        return TokenFrame(instance_id="i1", entries=[FrameEntry.of(
            request_id=rid, epoch=epochs[rid], weight_version=0, offset=n * FLUSH,
            token_ids=[n * FLUSH + k for k in range(FLUSH)], final=last,
            finish_reason="length" if last else None) for rid in rids])
    batches = [ledger.pack([frame(n)]) for n in range(FRAMES)]
    # The stream's scripts are loaded with its first batch; what happens then is the fault.
    other = aioredis.Redis(connection_pool=store.connection_pool)

    async def kill() -> None:
        await other.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")

    async def flush() -> None:
        await other.script_flush()

    async def stop() -> None:
        # The next batches go out to a stopped Redis, which holds what was sent and runs it
        # once continued: the stream's reads time out meanwhile, and its batches go again
        # the slow way, their part that ran reading as duplicates.
        proc = brokers.redis.proc
        assert proc is not None
        proc.send_signal(signal.SIGSTOP)
        asyncio.get_running_loop().call_later(0.8, proc.send_signal, signal.SIGCONT)
    act = {"connection-killed": kill, "scripts-flushed": flush, "redis-stopped": stop}[fault]
    stream, again = CommitStream(store), [0]
    try:
        statuses = await pipelined(stream, ledger, batches, {n: act for n in (10, 50, 90)},
                                   again)
    finally:
        await stream.close()
        if fault == "redis-stopped":
            await store.aclose()
            store = other
    assert again[0] >= 3, again  # each fault failed a batch in flight, at least

    info = await store.hgetall(Keys.step(RUN, 0))
    assert int(info.get("gaps", 0)) == 0, info
    assert int(info.get("stale_chunks_rejected", 0)) == 0, info
    # Every entry committed once: a batch whose answer was lost reads as duplicates when it
    # goes again, and is then counted by the status of that attempt.
    counts = Counter(statuses)
    assert set(counts) <= {*COMMITTED, "duplicate"}, counts
    for sample in await ledger.samples(rids):
        assert sample.response_token_ids == list(range(FLUSH * FRAMES))
    assert int(info["remaining"]) == 0
    assert int(info["tokens"]) == RESPONSES * FLUSH * FRAMES
