"""The baselines of ``make bench-control-plane``'s part 1, on the same frames as the manager's
passes: raw nats-py publish -> subscribe (the bus alone), and the Redis-only bound (the
manager's commit script over the frames back to back, sent as ingest sends them: what Redis
alone allows). Part 4 runs the bound again with a replica following the Redis."""

from __future__ import annotations

import asyncio
import gc
import json
import secrets
import sys
import time
from collections import Counter
from collections.abc import Callable
from itertools import zip_longest
from typing import Any

import nats

from benchmarks.control_plane_fleet import INGEST_SPEC, Frame, prompts
from manager_svc.accounting import Ledger, commit_statuses
from manager_svc.commit_stream import CommitStream
from manager_svc.ingest import GROUP_MAX
from rlboost.stack import child_env
from shared import protocol as wire
from shared.bus import connect_redis
from shared.names import parse_request_id, request_id

RAW = "bench.raw"  # the raw baseline's subject: outside the chunk stream's


async def raw_pass(nc: Any, url: str, msgs: list[list[Frame]]) -> dict[str, Any]:
    """Baseline: the same bytes from the same publisher tasks, raw publish -> subscribe."""
    sink = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.control_plane", "--sink", url, str(sum(map(len, msgs))),
        stdout=asyncio.subprocess.PIPE, env=child_env({}))
    assert sink.stdout is not None
    await asyncio.wait_for(sink.stdout.readline(), 60)  # it is subscribed
    t0 = time.time()

    async def raw(batch: list[Frame]) -> None:
        for m in batch:
            await nc.publish(RAW, m[1])
    await asyncio.gather(*(raw(m) for m in msgs))
    await nc.flush()
    got = json.loads(await asyncio.wait_for(sink.stdout.readline(), 120))
    await sink.wait()
    return {"seconds": got["last"] - t0, "received": got["count"]}


async def sink(url: str, count: int) -> None:
    """Baseline subscriber, in its own process as the manager is: count, nothing else."""
    nc = await nats.connect(url)
    got, done = [0], asyncio.Event()

    async def on_msg(_: Any) -> None:
        got[0] += 1
        if got[0] == count:
            done.set()
    await nc.subscribe(RAW, cb=on_msg)
    await nc.flush()
    print("subscribed", flush=True)
    await asyncio.wait_for(done.wait(), 120)
    print(json.dumps({"last": time.time(), "count": got[0]}), flush=True)
    await nc.close()


async def redis_bound(url: str, msgs: list[list[Frame]], replica_acks: int = 0,
                      pipelined: bool = True, run: str = "",
                      cpu: Callable[[], float] | None = None) -> dict[str, Any]:
    """The same frames' commit scripts back to back on a fresh step (each response leased to
    the instance that sent it), in stream order and in the largest commits the manager makes
    (GROUP_MAX entries), sent as ingest sends them: on a commit stream, the next commit queued
    in Redis behind the one running (PIPELINED in flight), or with ``pipelined`` False (and
    with replica acks, as ingest then does) one round trip at a time; arguments packed before
    the clock starts.
    No NATS, no manager, no MAC checks: what Redis alone allows. ``run``: the run id to commit
    under (its hash tag places it on a Redis Cluster's shard); default a fresh one.
    ``t0``/``t1``: the clock's start and end (perf_counter), for passes run side by side;
    ``cpu``: read (the CPU seconds of the Redis the run is on) right before the clock starts and
    right after it stops, their difference returned as ``redis_cpu_s``."""
    r = await connect_redis(url)
    ledger = Ledger(r, lease_ttl_s=600, replica_acks=replica_acks)
    run = run or f"bound-{secrets.token_hex(3)}"
    spec = INGEST_SPEC
    await ledger.create_step(run, 0, 0, prompts(int(spec["prompts_per_step"])),
                             int(spec["samples_per_prompt"]), int(spec["max_new_tokens"]))
    frames = [wire.decode(data, wire.TokenFrame) for frame in zip_longest(*msgs)
              for _, data in (f for f in frame if f is not None)]
    epochs: dict[str, int] = {}
    for frame in frames:
        # Held by names no manager knows: the manager in this stack reaps the instances of the
        # earlier passes, and would take back whatever their names hold.
        frame.instance_id = f"{run}-{frame.instance_id}"
        for e in frame.entries:
            _, _, p, s = parse_request_id(e.request_id)
            e.request_id = request_id(run, 0, p, s)
            if e.request_id not in epochs:
                a = await ledger.assign(e.request_id, frame.instance_id, 1.0, 0, 2)
                assert a is not None
                epochs[e.request_id] = a.epoch
            e.epoch = epochs[e.request_id]
    batches: list[list[wire.TokenFrame]] = [[]]
    size = 0
    for frame in frames:
        if size + len(frame.entries) > GROUP_MAX:
            batches, size = [*batches, []], 0
        batches[-1].append(frame)
        size += len(frame.entries)
    calls = [ledger.pack(batch) for batch in batches]
    # This process holds every frame of the pass: a full collection of it (~80 ms) landed in
    # one timed pass of three, and Redis waited for it, idle.
    stream = CommitStream(r) if pipelined and CommitStream.usable(r, replica_acks) else None
    if stream is not None:  # connected, its script loaded, before the clock starts
        await stream.ready([call.script for call in calls[0]])
    gc.collect()
    gc.disable()
    cpu0 = cpu() if cpu is not None else 0.0
    try:
        t0 = time.perf_counter()
        if stream is None:
            results = [res for call in calls
                       for res in commit_statuses(await ledger.run_replies(call))]
        else:
            results = [res for replies in await stream.commit_all(calls, ledger.run_replies)
                       for res in commit_statuses(replies)]
        t1 = time.perf_counter()
        seconds = t1 - t0
    finally:
        gc.enable()
    cpu_s = cpu() - cpu0 if cpu is not None else 0.0
    if stream is not None:
        await stream.close()
    # Gone again, as the manager's passes are once their run ends.
    keys = [key async for key in r.scan_iter(match=f"*{{{run}}}*", count=1000)]
    for i in range(0, len(keys), 1000):
        await r.unlink(*keys[i:i + 1000])
    await r.aclose()
    statuses = Counter(results)
    committed = sum(statuses[s] for s in ("ok", "final", "group", "step"))
    return {"seconds": seconds, "t0": t0, "t1": t1, "redis_cpu_s": cpu_s,
            "all_committed": committed == len(results), "statuses": statuses,
            "tokens": sum(e.n_tokens for f in frames for e in f.entries)}
