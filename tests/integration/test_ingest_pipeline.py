"""Group commit against real NATS JetStream and Redis: ingest checks the next frames while a
commit runs and sends them together, on a commit stream behind the one in flight (pipelined),
or once it has answered (one at a time, as on a cluster or with replica acks). A backlog of
many small frames per response (the order a pipeline could break) must still commit in stream
order, every token once, with every group announced before its step's barrier, whose digest
(hashed from what the group announcements read) equals the one computed over the stored
responses."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from nats.aio.msg import Msg

from manager_svc import announce
from manager_svc.accounting import Ledger
from manager_svc.archive import Archive
from manager_svc.chunk_auth import ChunkAuth
from manager_svc.ingest import PIPELINED, ChunkIngest
from manager_svc.metrics import ManagerMetrics
from manager_svc.runs import RunStore
from manager_svc.soft_state import SoftState
from rlboost.stack import Stack
from shared import names
from shared.bus import connect_nats, connect_redis, ensure_chunk_stream
from shared.digest import sample_digest
from shared.mac import entry_mac
from shared.names import Keys, request_id
from shared.protocol import Barrier, FrameEntry, GroupDone, TokenFrame, decode, encode
from shared.spec import RunSpec

PROMPTS, SAMPLES, INSTANCES, LENGTH, FLUSH = 16, 4, 4, 96, 2


def tokens_of(p: int, s: int) -> list[int]:
    return [(7 * p + 3 * s + k) % 1000 for k in range(LENGTH)]


# Held: a response that completes before its group is read then and held for the group's
# event; not held (no room for any): every response is read when its group completes.
@pytest.mark.parametrize("hold_bytes", [announce.FINISHED_BYTES, 0], ids=["held", "not-held"])
@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "one-at-a-time"])
async def test_a_backlog_commits_in_order_once_with_groups_before_the_barrier(
        brokers: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hold_bytes: int,
        pipelined: bool) -> None:
    monkeypatch.setattr(announce, "FINISHED_BYTES", hold_bytes)
    redis = await connect_redis(brokers.redis.url)
    nc = await connect_nats(brokers.nats.url, "test-ingest")
    task: asyncio.Task[None] | None = None
    try:
        js = nc.jetstream()
        await ensure_chunk_stream(js)
        runs = RunStore(redis, Archive(tmp_path))
        run_id = (await runs.create(RunSpec(model="emu", samples_per_prompt=SAMPLES,
                                            prompts_per_step=PROMPTS)))["id"]
        auth = ChunkAuth(b"k" * 32)
        ledger = Ledger(redis, lease_ttl_s=60.0, lease_key=auth.lease_key)
        await ledger.create_step(run_id, 0, 0, [[1, p] for p in range(PROMPTS)], SAMPLES, 512)
        held: dict[str, list[tuple[str, int, str]]] = {f"i{k}": [] for k in range(INSTANCES)}
        for n, (p, s) in enumerate((p, s) for p in range(PROMPTS) for s in range(SAMPLES)):
            iid = f"i{n % INSTANCES}"
            a = await ledger.assign(request_id(run_id, 0, p, s), iid, 1.0, 0, 2)
            assert a is not None
            held[iid].append((a.request_id, a.epoch, a.lease_key))
        events: list[tuple[str, int]] = []  # ("group", prompt) | ("barrier", tokens)
        groups: list[GroupDone] = []

        async def on_group(msg: Msg) -> None:
            groups.append(decode(msg.data, GroupDone))
            events.append(("group", groups[-1].prompt_index))

        barrier: asyncio.Future[Barrier] = asyncio.get_running_loop().create_future()

        async def on_barrier(msg: Msg) -> None:
            got = decode(msg.data, Barrier)
            events.append(("barrier", got.digest.tokens))
            if not barrier.done():
                barrier.set_result(got)
        await nc.subscribe(names.group_subject(run_id), cb=on_group)
        await nc.subscribe(names.barrier_subject(run_id), cb=on_barrier)

        # The whole step in the stream before ingest starts: 48 frames per instance, each
        # with FLUSH new tokens of each of its 16 responses, so ingest meets a backlog.
        for iid, leases in held.items():
            for off in range(0, LENGTH, FLUSH):
                entries = []
                for rid, epoch, key in leases:
                    _, _, p, s = names.parse_request_id(rid)
                    final = off + FLUSH >= LENGTH
                    entry = FrameEntry.of(request_id=rid, epoch=epoch, weight_version=0,
                                          offset=off, token_ids=tokens_of(p, s)[off:off + FLUSH],
                                          final=final, finish_reason="stop" if final else None)
                    entry.mac = entry_mac(key, iid, entry)
                    entries.append(entry)
                await js.publish(names.chunk_subject(run_id, iid),
                                 encode(TokenFrame(instance_id=iid, entries=entries)))

        ingest = ChunkIngest(redis, nc, ledger, runs, ManagerMetrics(), SoftState(), auth)
        assert ingest.stream is not None  # a plain client, no replica acks
        if not pipelined:
            ingest.stream = None
        # Commits watched: at most PIPELINED at once, or one, and fewer than the frames (what
        # queued behind a commit went in the next one). Each answer is held back once Redis
        # has run it, so the next commit goes while one is in flight wherever it may.
        flight, seen = [0], {"max": 0, "commits": 0}

        def watched(commit: Callable[..., Awaitable[list[Any]]]
                    ) -> Callable[..., Awaitable[list[Any]]]:
            async def watch(*args: Any, **kwargs: Any) -> list[Any]:
                flight[0] += 1
                seen["max"], seen["commits"] = max(seen["max"], flight[0]), seen["commits"] + 1
                try:
                    got = await commit(*args, **kwargs)
                    await asyncio.sleep(0.2)
                    return got
                finally:
                    flight[0] -= 1
            return watch
        if ingest.stream is not None:
            monkeypatch.setattr(ingest.stream, "commit", watched(ingest.stream.commit))
        else:
            monkeypatch.setattr(ledger, "run_replies", watched(ledger.run_replies))
        took, take = [0], ingest.announcer._take_finished

        def counted(key: announce.StepKey, rid: str) -> announce.Held | None:
            got = take(key, rid)
            took[0] += got is not None
            return got
        ingest.announcer._take_finished = counted  # type: ignore[method-assign]
        task = asyncio.create_task(ingest.consume())
        done = await asyncio.wait_for(barrier, 60)
        await nc.flush()
        await asyncio.sleep(0.3)

        info = await redis.hgetall(Keys.step(run_id, 0))
        for counter in ("gaps", "stale_chunks_rejected", "duplicate_chunks_dropped"):
            assert int(info.get(counter, 0)) == 0, (counter, info)
        samples = await ledger.done_samples(run_id, 0)
        assert {(x.prompt_index, x.sample_index): x.response_token_ids for x in samples} == {
            (p, s): tokens_of(p, s) for p in range(PROMPTS) for s in range(SAMPLES)}
        assert done.digest == sample_digest(samples)
        assert done.digest.tokens == PROMPTS * SAMPLES * LENGTH
        # Every group once, all before the one barrier.
        assert sorted(p for kind, p in events if kind == "group") == list(range(PROMPTS))
        assert [kind for kind, _ in events][-1] == "barrier"
        assert sum(kind == "barrier" for kind, _ in events) == 1
        # Each group's event carries its samples (spliced from the stored text) exactly as
        # the trainer reads them from the ledger: ids, prompt and response tokens, instances.
        for group in groups:
            assert group.samples == [x for x in samples if x.prompt_index == group.prompt_index]
            assert [x.sample_index for x in group.samples] == list(range(SAMPLES))
        frames = INSTANCES * LENGTH // FLUSH
        assert seen["max"] == (PIPELINED if pipelined else 1), seen
        assert 1 < seen["commits"] < frames, (seen, frames)
        # Samples came from what was held exactly when there was room to hold them, and
        # nothing stays held once the step's barrier is made.
        assert (took[0] > 0) == (hold_bytes > 0), took
        assert ingest.announcer._finished_bytes == 0
        # Everything acked: nothing of the step is left in the stream.
        assert (await js.stream_info(names.CHUNK_STREAM)).state.messages == 0
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await nc.close()
        await redis.aclose()
