"""One measured pass of ``make bench-control-plane``: a step of the emulated fleet's frames
through a real manager, from the first publish to the barrier, checked token for token; and the
settings its managers run with."""

from __future__ import annotations

import asyncio
import signal
import time
from itertools import chain
from pathlib import Path
from typing import Any

import httpx

from benchmarks.control_plane_fleet import INGEST_SPEC, PUBLISHERS, Step
from rlboost.ha_stack import redis_client
from rlboost.launcher import Child
from rollout_svc.engines.emu import EmuEngine
from shared import protocol as wire
from shared.names import Keys


def manager_env(brokers: dict[str, str], url: str, root: Path) -> dict[str, str]:
    """A benchmarked manager's environment on ``brokers``, serving REST on ``url``."""
    # Leases and instances outlive the paused seconds of the drain pass (config, not code).
    return {**brokers, "RLBOOST_MANAGER_URL": url, "RLBOOST_DATA_DIR": str(root / "data"),
            "RLBOOST_LOG_LEVEL": "WARNING", "RLBOOST_LEASE_TTL_S": "30",
            "RLBOOST_INSTANCE_TTL_S": "30",
            # Emulated instances generate only what they were first given: an idle one never
            # generates work moved to it, so rebalancing would stall the step.
            "RLBOOST_REBALANCE_SKEW": "0",
            # A pass's run is cancelled once checked, and its keys leave Redis then, not in a
            # day. A deployment's Redis holds a run's active step and the last finished one;
            # kept, ~20 steps of 2 M tokens slowed the later passes' Redis by 10-25 % (APPEND
            # twice as slow), the flush-64 ones most, being last.
            "RLBOOST_RETENTION_S": "0"}


async def manager_pass(nc: Any, http: httpx.AsyncClient, redis_url: str, tag: str,
                       paused: Child | None, flush: int) -> dict[str, Any]:
    """One step of INGEST_SPEC, from registration to the barrier, checked against the oracle;
    with ``paused`` the manager is stopped while the frames are published."""
    step = Step(nc, http, tag, PUBLISHERS, PUBLISHERS, int(INGEST_SPEC["max_new_tokens"]))
    pubs = await step.start()
    run_id, barrier, total = step.run_id, step.barrier, step.total
    # In a thread, so the fleet's heartbeats go on at their own phases meanwhile: the ~1 s of
    # this loop it took held every instance's next beat, and all 32 then came at once, queued
    # for the resumed manager in front of the first commit (~25 ms of a drained step).
    msgs = await asyncio.to_thread(
        lambda: [p.messages(EmuEngine(time_scale=0.0), flush) for p in pubs])
    if paused is not None:
        paused.signal(signal.SIGSTOP)
    t0 = time.perf_counter()
    await asyncio.gather(*(p.publish(nc.jetstream(), m) for p, m in zip(pubs, msgs, strict=True)))
    publish_s = time.perf_counter() - t0
    if paused is not None:
        paused.signal(signal.SIGCONT)
        t0 = time.perf_counter()
    t_end, done = await asyncio.wait_for(barrier, 300)
    # Exactly once, checked: every response equals the oracle, no chunk was dropped or fenced.
    # Before the run ends: its keys then leave Redis (RLBOOST_RETENTION_S, part_ingest).
    by_rid: dict[str, list[int]] = {}
    for _, data in chain.from_iterable(msgs):
        for e in wire.decode(data, wire.TokenFrame).entries:
            by_rid.setdefault(e.request_id, []).extend(e.token_ids)
    expected = {rid: ",".join(map(str, t)) for rid, t in by_rid.items()}
    with redis_client(redis_url) as r:
        committed = {rid: r.get(Keys.tokens(rid)) for rid in expected}
        info = r.hgetall(Keys.step(run_id, 0))
    await step.finish(pubs)
    return {"msgs": msgs, "tokens": sum(map(len, by_rid.values())), "responses": total,
            "seconds": t_end - t0, "publish_s": publish_s, "barrier_tokens": done.digest.tokens,
            "exact": committed == expected and len(expected) == done.digest.responses == total,
            "duplicates": int(info.get("duplicate_chunks_dropped", 0)),
            "stale": int(info.get("stale_chunks_rejected", 0)), "lost": sum(p.lost for p in pubs),
            "entries": sum(len(m[0]) for m in chain.from_iterable(msgs)),
            "frames": sum(map(len, msgs)),
            "bytes": sum(len(m[1]) for m in chain.from_iterable(msgs))}
