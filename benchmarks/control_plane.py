"""``make bench-control-plane``: what the control plane itself costs, in one run (18 minutes on
this 2-core machine beside two other benchmarks; about 6 alone, estimated from the ~5 before
part 3 went from two passes to ten; the parts' times are printed at the end).

1. Manager ingest, per flush interval (tokens per response per frame): a real manager on real
   NATS JetStream + Redis commits one step's token frames by its whole exactly-once path (pull
   consumer, Lua commit, acks, group and barrier events), published as ``rollout_svc`` does (one
   frame per flush with every response's new tokens) by emulated instances that
   heartbeat and hold the manager's own assignments; the tokens are the emu oracle's, checked
   token for token. Live: first publish -> barrier, the publishers running meanwhile (here in
   this process, on the same two cores as the manager, NATS and Redis; on a deployment they
   are the rollout machines); drain: manager paused (SIGSTOP) while the stream fills, then
   resumed -> barrier (the manager alone, not the publishers). The goal is checked on live:
   it is what a step sees. Baselines on the same frames: raw nats-py publish -> subscribe, and
   the Redis-only bound: the same commit script over the same frames back to back, in the
   manager's largest commits, no NATS, no manager. Each of these runs three times (five at
   flush 16 and 64); the median is reported, with the range.
2. Control-plane latency at 32 and 128 instances (:mod:`benchmarks.control_plane_latency`).
3. One vs two manager replicas: REPLICA_PASSES live passes of part 1 at the largest flush on
   one and as many with a second manager on the same brokers, in the order one, two, two,
   one, ... (each pair adjacent; a drift over the part weighs on both sides alike), exactly
   once checked the same way; the second manager starts before each run of twos and stops
   after it. Printed: the medians, their ranges, and the ratio of each two to the one beside
   it.
4. What a replica's ack costs (RLBOOST_REDIS_REPLICA_ACKS=1): the Redis-only bound at the
   largest flush again once a replica follows the Redis, without and with each commit batch
   waiting for it, alternately.
5. Redis Cluster shards (1, 3) x manager replicas (1, 3), and one plain Redis, each beside its
   own Redis-only bound (:mod:`benchmarks.control_plane_shards`; ``--only shards`` runs it
   alone).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import redis

from benchmarks.control_plane_baselines import raw_pass, redis_bound, sink
from benchmarks.control_plane_fleet import INGEST_SPEC, PUBLISHERS, Frame
from benchmarks.control_plane_latency import (
    FLEETS,
    LATENCY_FLUSH,
    PER_INSTANCE,
    latency_pass,
    probe,
)
from benchmarks.control_plane_pass import manager_env, manager_pass
from benchmarks.control_plane_report import KINDS, report
from benchmarks.control_plane_shards import part_shards, report_shards
from benchmarks.provenance import printed as provenance_of
from rlboost.launcher import Child, Cluster
from rlboost.stack import Server, Stack
from shared.bus import connect_nats, connect_redis
from shared.ports import free_port
from shared.process import exit_on_sigterm

REPEATS = 3  # passes of each kind per flush interval; the median is reported, and the range
# Five at the intervals whose rate can meet the goal: on this 2-core VM a pass's speed swings
# by up to ~25 % from one second to the next (the same drain took 0.38-0.64 s of the
# manager's CPU, the same bound 0.38-0.48 s of Redis's), so three passes left the median's
# ratio to the one or two passes that landed in a slow spell.
GOAL_REPEATS = {16: 5, 64: 5}
# Flush intervals measured: rollout's default, 16 and 64. Waste per preempted response stays
# within one flush at any of them (bench-preempt --chunk-tokens N), so the goals hold if the
# rate and the bound ratio hold together at one of them (the report names which); for
# reasoning responses of thousands of tokens, even 64 lost to a SIGKILL is under 2 %.
FLUSHES = (4, 16, 64)
# Part 3: live passes on one replica and on two, each. One pass each read 0.73-1.20x in five
# runs of this bench: one pair is within a pass's own swing here (see GOAL_REPEATS), so the
# ratio is printed with the spread of its pairs.
REPLICA_PASSES = 5


async def rewrite_aof(url: str) -> None:
    """Between passes: Redis's append-only file rewritten to what Redis holds now, as Redis
    itself would once the file doubled, but never inside a timed pass (part_ingest). Grown to
    ~1.3 GB by the flush-4 passes, it slowed the bound at flush 64 by ~10 %."""
    r = await connect_redis(url)
    try:
        await r.bgrewriteaof()
        while True:
            info = await r.info("persistence")
            if not info["aof_rewrite_in_progress"] and not info["aof_rewrite_scheduled"]:
                break
            await asyncio.sleep(0.05)
    finally:
        await r.aclose()


def part_ingest(root: Path) -> dict[str, Any]:
    stack = Stack.create(root / "brokers")
    stack.start()
    with redis.Redis.from_url(stack.redis.url) as r:
        # Redis rewrites its AOF (a fork writing the whole dataset) each time the file has
        # doubled: here every few passes (58 -> 36 MB between drain4 and live16), and on two
        # cores that slowed whichever pass it landed in. The passes are compared with each
        # other, so none of them gets one.
        r.config_set("auto-aof-rewrite-percentage", 0)
    url = f"http://127.0.0.1:{free_port()}"
    env = manager_env(stack.env(), url, root)
    manager = Child("manager", [sys.executable, "-m", "manager_svc"], env, root / "manager.log")
    cluster = Cluster(root, base_env=env, children=[manager])

    def manager_pid() -> int:
        assert manager.proc is not None
        return manager.proc.pid

    async def passes() -> dict[str, Any]:
        nc = await connect_nats(stack.nats.url, "bench")
        out: dict[str, Any] = {"ingest": {}, "latency": {}, "config": {
            "publishers": PUBLISHERS, "max_new_tokens": INGEST_SPEC["max_new_tokens"],
            "latency_flush": LATENCY_FLUSH, "per_instance": PER_INSTANCE}}
        seconds: dict[str, float] = {}
        out["seconds"] = seconds
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            # Latency first, on a manager nothing ran on: every earlier pass leaves 32
            # instances registered until their TTL, and each dispatch pass reads them all.
            t0 = time.perf_counter()
            for n in FLEETS:
                out["latency"][n] = await latency_pass(nc, http, n, manager_pid())
            seconds["latency"], t0 = time.perf_counter() - t0, time.perf_counter()
            for flush in FLUSHES:
                runs: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
                for i in range(GOAL_REPEATS.get(flush, REPEATS)):
                    await rewrite_aof(stack.redis.url)
                    live = await manager_pass(nc, http, stack.redis.url, f"live{flush}-{i}", None,
                                              flush)
                    drain = await manager_pass(nc, http, stack.redis.url, f"drain{flush}-{i}",
                                               manager, flush)
                    raw = await raw_pass(nc, stack.nats.url, live["msgs"])
                    runs["raw"].append({**raw, "tokens": live["tokens"]})
                    runs["bound"].append(await redis_bound(stack.redis.url, live["msgs"]))
                    kept = live["msgs"]  # the largest flush's, for part 4
                    del live["msgs"], drain["msgs"]
                    runs["live"].append(live)
                    runs["drain"].append(drain)
                out["ingest"][flush] = runs
            seconds["ingest"], t0 = time.perf_counter() - t0, time.perf_counter()
            cluster.children.append(second)  # stopped with the rest once it runs
            out["replicas"] = await replica_passes(nc, http, stack, cluster, second)
            seconds["replicas"], t0 = time.perf_counter() - t0, time.perf_counter()
            out["replica_acks"] = await replica_acks(stack, root, kept)
            seconds["replica_acks"] = time.perf_counter() - t0
        await nc.close()
        return out
    second = Child("manager-1", [sys.executable, "-m", "manager_svc"],
                   {**env, "RLBOOST_MANAGER_URL": f"http://127.0.0.1:{free_port()}"},
                   root / "manager-1.log")
    try:
        manager.start()
        cluster.wait_http(url)
        return asyncio.run(passes())
    finally:
        manager.signal(signal.SIGCONT)
        cluster.stop()
        stack.stop()


async def replica_passes(nc: Any, http: httpx.AsyncClient, stack: Stack, cluster: Cluster,
                         second: Child) -> dict[str, Any]:
    """Part 3: live passes at the largest flush on one manager and on two, one, two, two,
    one, ...: the second (a standby for ingest, which one replica at a time commits, and for
    dispatch; both answer the bus) joins the same brokers before each run of twos and leaves,
    stopped as a deployment stops it, after it."""
    flush = max(FLUSHES)
    runs: dict[str, list[dict[str, Any]]] = {"one": [], "two": []}
    for i, which in enumerate(("OTTO" * REPLICA_PASSES)[:2 * REPLICA_PASSES]):
        if which == "T" and not second.alive():
            second.start()
            cluster.wait_http(second.env["RLBOOST_MANAGER_URL"])
        elif which == "O" and second.alive():
            await asyncio.to_thread(stop_child, second)
        await rewrite_aof(stack.redis.url)
        kind = "two" if which == "T" else "one"
        v = await manager_pass(nc, http, stack.redis.url, f"{kind}{flush}-{i}", None, flush)
        del v["msgs"]
        runs[kind].append(v)
    await asyncio.to_thread(stop_child, second)
    return {"flush": flush, **runs}


def stop_child(child: Child, grace_s: float = 15.0) -> None:
    """SIGTERM, as Cluster.stop ends a service, and wait for it (SIGKILL past ``grace_s``)."""
    child.signal(signal.SIGTERM)
    if child.proc is not None:
        try:
            child.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            child.signal(signal.SIGKILL)
            child.proc.wait(timeout=5)


async def replica_acks(stack: Stack, root: Path, msgs: list[list[Frame]]
                       ) -> dict[str, Any]:
    """Part 4: the bound with a replica following the Redis, unacked and acked in turn."""
    replica = Server("redis", free_port(), root / "replica", root / "replica.log")
    replica.start()
    try:
        follower = redis.Redis(host="127.0.0.1", port=replica.port)
        follower.replicaof("127.0.0.1", stack.redis.port)
        while follower.info("replication").get("master_link_status") != "up":
            await asyncio.sleep(0.05)
        follower.close()
        runs: dict[str, list[dict[str, Any]]] = {"unacked": [], "acked": []}
        for _ in range(REPEATS):
            # One round trip at a time, both: a replica-acked batch is never pipelined.
            runs["unacked"].append(await redis_bound(stack.redis.url, msgs, pipelined=False))
            runs["acked"].append(await redis_bound(stack.redis.url, msgs, replica_acks=1))
        return {"flush": max(FLUSHES), **runs}
    finally:
        replica.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sink", nargs=2, metavar=("NATS_URL", "COUNT"), help=argparse.SUPPRESS)
    parser.add_argument("--probe", nargs=2, metavar=("NATS_URL", "COUNT"), help=argparse.SUPPRESS)
    parser.add_argument("--only", choices=["shards"],
                        help="run part 5 alone (Redis shards x manager replicas)")
    args = parser.parse_args(argv)
    if args.sink:
        asyncio.run(sink(args.sink[0], int(args.sink[1])))
        return 0
    if args.probe:
        asyncio.run(probe(args.probe[0], int(args.probe[1])))
        return 0
    exit_on_sigterm()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rlboost-cp-") as tmp:
        print(f"{provenance()}\nmanager ingest vs raw NATS vs Redis alone; control-plane "
              f"latency; Redis shards x manager replicas ...", flush=True)
        out = None if args.only else part_ingest(Path(tmp) / "ingest")
        shards = part_shards(Path(tmp) / "shards")
    ok = (out is None or report(out)) and report_shards(shards)
    print(f"{time.monotonic() - started:.0f} s in all, start-up and shut-down included")
    return 0 if ok else 1


def provenance() -> str:
    """The commit (``-dirty`` with changes) and command the printed figures come from."""
    return provenance_of("benchmarks.control_plane", sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
