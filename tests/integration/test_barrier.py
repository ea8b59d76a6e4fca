"""The barrier against real Redis and NATS: made once however many callers find the step
complete, with the digest the trainer computes over what it is served."""

from __future__ import annotations

import asyncio
from pathlib import Path

from nats.aio.msg import Msg

from manager_svc.accounting import Ledger
from manager_svc.archive import Archive
from manager_svc.chunk_auth import ChunkAuth
from manager_svc.ingest import ChunkIngest
from manager_svc.metrics import ManagerMetrics
from manager_svc.runs import RunStore
from manager_svc.soft_state import SoftState
from rlboost.stack import Stack
from shared import names
from shared.bus import connect_nats, connect_redis
from shared.digest import sample_digest
from shared.names import Keys
from shared.protocol import Barrier, FrameEntry, TokenFrame, decode

RUN = "run-barrier"


async def test_concurrent_barriers_of_a_step_announce_it_once(brokers: Stack,
                                                              tmp_path: Path) -> None:
    redis = await connect_redis(brokers.redis.url)
    nc = await connect_nats(brokers.nats.url, "test-barrier")
    try:
        ledger = Ledger(redis, lease_ttl_s=5.0)
        await ledger.create_step(RUN, 0, 0, [[1, 2], [3]], samples=2, max_new_tokens=8)
        for p in range(2):
            for s in range(2):
                rid = f"{RUN}:0:{p}:{s}"
                a = await ledger.assign(rid, "i1", 1.0, 0, 2)
                assert a is not None
                [result] = await ledger.commit(TokenFrame(instance_id="i1", entries=[FrameEntry.of(
                    request_id=rid, epoch=a.epoch, weight_version=0, offset=0,
                    token_ids=[5 + p, 6 + s], final=True, finish_reason="stop")]))
                assert result.status in ("final", "group", "step")
        seen: list[Barrier] = []

        async def on_barrier(msg: Msg) -> None:
            seen.append(decode(msg.data, Barrier))
        await nc.subscribe(names.barrier_subject(RUN), cb=on_barrier)
        ingest = ChunkIngest(redis, nc, ledger, RunStore(redis, Archive(tmp_path)),
                             ManagerMetrics(), SoftState(), ChunkAuth(b"k" * 32))
        # Ingest's commit and the dispatcher's pass both found the step complete.
        await asyncio.gather(*(ingest.barrier(RUN, 0) for _ in range(3)))
        await nc.flush()
        await asyncio.sleep(0.2)
        assert len(seen) == 1, seen
        assert seen[0].digest == sample_digest(await ledger.done_samples(RUN, 0))
        assert seen[0].digest.tokens == 8
        assert await redis.hget(Keys.step(RUN, 0), "state") == "training"
        # Made and finished, it can be announced again (a replica that restarts re-announces).
        await ingest.barrier(RUN, 0)
        await nc.flush()
        await asyncio.sleep(0.2)
        assert len(seen) == 2
    finally:
        await nc.close()
        await redis.aclose()

