"""Part 5 of ``make bench-control-plane``: committed tokens/s on Redis Cluster shards and manager
replicas, each configuration beside its own Redis-only bound, in one run.

Configurations (Redis, manager replicas): one plain Redis (today's default: pipelined commits)
with one manager, then a Redis Cluster (rlboost.ha_stack, no replicas: their ack is part 4's
cost) of 1 and of 3 shards, each with 1 and 3 managers. One NATS server throughout, so that
only Redis and the managers change. Per configuration, SHARD_PASSES alternating passes of:

- live: one step of the emulated fleet (part 1's frames, flush 64) through the real managers,
  first publish -> barrier, exactly once checked against the oracle;
- bound: the same frames' commit scripts back to back on the same Redis, no NATS or manager;
- spread bound (3 shards only): three such runs at once, each under a run id whose hash tag
  lands on another shard: what the shards together take when commits are spread over them.

One run trains at a time and every key of a run is on its run's slot (docs/high-availability
.md), so a step's commits reach one shard, and ingest is one pinned consumer whatever the
replicas: the live rate and the bound should not move with shards or replicas, and the spread
bound says what the shards would add were a step's commits spread (by run, with runs trained
side by side, or within a run). On two cores three shards, their clients and the benchmark
share the CPU: the spread figure is bounded by the machine long before by the shards.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import redis

from benchmarks.control_plane_baselines import redis_bound
from benchmarks.control_plane_pass import manager_env, manager_pass
from rlboost.ha_stack import RedisClusterNodes
from rlboost.launcher import Child, Cluster
from rlboost.stack import Server
from shared.bus import connect_nats
from shared.names import Keys
from shared.ports import free_port

FLUSH = 64
SHARD_PASSES = int(os.environ.get("RLBOOST_BENCH_SHARD_PASSES", "3"))
# (Redis shards, manager replicas); 0 shards: one plain Redis, not a cluster.
CONFIGS = ((0, 1), (1, 1), (1, 3), (3, 1), (3, 3))


def label(shards: int, managers: int) -> str:
    redis = "plain Redis" if shards == 0 else f"cluster, {shards} shard{'s' * (shards > 1)}"
    return f"{redis}, {managers} manager{'s' * (managers > 1)}"


def spread_runs(nodes: RedisClusterNodes) -> list[str]:
    """A run id per shard: one whose hash tag lands on each primary."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < nodes.size:
        run = f"spread-{i}"
        found.setdefault(nodes.node_of(Keys.run(run)), run)
        i += 1
    return list(found.values())


def redis_cpu(ports: list[int]) -> list[float]:
    """CPU seconds (user + system) each Redis server has used so far."""
    out = []
    for port in ports:
        with redis.Redis(host="127.0.0.1", port=port) as r:
            info = r.info("cpu")
        out.append(float(info["used_cpu_user"]) + float(info["used_cpu_sys"]))
    return out


async def timed_bound(ports: list[int], url: str, msgs: Any, runs: list[str]) -> dict[str, Any]:
    """The bound of ``runs`` committed at once (one: the plain bound), all their tokens over
    the time from the first clock's start to the last one's end; and each server's CPU seconds
    meanwhile (a script runs on one core: a shard's ceiling is its tokens over that time)."""
    before = redis_cpu(ports)
    done = await asyncio.gather(*(redis_bound(url, msgs, run=run) for run in runs))
    cpu = [b - a for a, b in zip(before, redis_cpu(ports), strict=True)]
    seconds = max(r["t1"] for r in done) - min(r["t0"] for r in done)
    tokens = sum(r["tokens"] for r in done)
    # The ceiling: each run's share of the tokens over its shard's CPU seconds, summed over
    # the shards, as each would commit with a core of its own (the runs are alike: taken at
    # the busiest shard). The untimed setup (the step's creation, the leases) is in the CPU
    # seconds too, so the ceiling is on the low side.
    busiest = max(cpu)
    return {"seconds": seconds, "tokens": tokens, "redis_cpu_s": cpu,
            "ceiling": tokens / busiest if busiest > 0 else 0.0,
            "all_committed": all(r["all_committed"] for r in done)}


def one_config(root: Path, shards: int, managers: int) -> dict[str, Any]:
    nats = Server("nats", free_port(), root / "nats", root / "nats.log")
    nodes = RedisClusterNodes(root / "redis", max(1, shards))
    plain = Server("redis", free_port(), root / "redis", root / "redis.log")
    nats.start()
    if shards:
        nodes.start()
        redis_url = nodes.url
    else:
        plain.start()
        redis_url = plain.url
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(managers)]
    env = manager_env({"RLBOOST_NATS_URL": nats.url, "RLBOOST_REDIS_URL": redis_url}, urls[0],
                      root)
    children = [Child(f"manager-{i}", [sys.executable, "-m", "manager_svc"],
                      {**env, "RLBOOST_MANAGER_URL": url}, root / f"manager-{i}.log")
                for i, url in enumerate(urls)]
    cluster = Cluster(root, base_env=env, children=children)

    async def passes() -> dict[str, Any]:
        nc = await connect_nats(nats.url, "bench")
        out: dict[str, list[dict[str, Any]]] = {"live": [], "bound": [], "spread": []}
        async with httpx.AsyncClient(base_url=urls[0], timeout=30) as http:
            for i in range(SHARD_PASSES):
                live = await manager_pass(nc, http, redis_url, f"s{shards}m{managers}-{i}", None,
                                          FLUSH)
                msgs = live.pop("msgs")
                out["live"].append(live)
                ports = nodes.ports if shards else [plain.port]
                out["bound"].append(await timed_bound(ports, redis_url, msgs, [f"bound-{i}"]))
                if shards > 1:
                    out["spread"].append(await timed_bound(ports, redis_url, msgs,
                                                           spread_runs(nodes)))
        await nc.close()
        return out

    try:
        for child in children:
            child.start()
        for url in urls:
            cluster.wait_http(url)
        return asyncio.run(passes())
    finally:
        cluster.stop()
        nodes.stop()
        plain.kill()
        nats.kill()


def part_shards(root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"flush": FLUSH, "configs": {}, "seconds": 0.0}
    t0 = time.perf_counter()
    for shards, managers in CONFIGS:
        out["configs"][(shards, managers)] = one_config(root / f"shards{shards}-m{managers}",
                                                        shards, managers)
    out["seconds"] = time.perf_counter() - t0
    return out


def _median(passes: list[dict[str, Any]]) -> float:
    return float(statistics.median(p["tokens"] / p["seconds"] for p in passes))


def _range(passes: list[dict[str, Any]]) -> str:
    rates = [p["tokens"] / p["seconds"] for p in passes]
    return f"{min(rates) / 1e6:.2f}-{max(rates) / 1e6:.2f}"


def report_shards(out: dict[str, Any]) -> bool:
    """Print part 5; True when every live pass was exact and every bound committed all."""
    print(f"\n[5] Redis shards x manager replicas, flush {out['flush']}: median of "
          f"{SHARD_PASSES} passes each, M tokens/s (range); ratio to the configuration's own "
          f"bound, and to the first configuration's live rate")
    ok = True
    base = 0.0
    for (shards, managers), runs in out["configs"].items():
        live, bound = _median(runs["live"]), _median(runs["bound"])
        base = base or live
        exact = all(p["exact"] for p in runs["live"])
        committed = all(p["all_committed"] for p in runs["bound"] + runs["spread"])
        ok = ok and exact and committed
        line = (f"  {label(shards, managers):<32} live {live / 1e6:5.2f} ({_range(runs['live'])})"
                f"  bound {bound / 1e6:5.2f} ({_range(runs['bound'])})  live/bound "
                f"{live / bound:.2f}x  vs first {live / base:.2f}x  exact "
                f"{'yes' if exact else 'NO'}")
        ceiling = statistics.median(p["ceiling"] for p in runs["bound"])
        line += (f"\n  {'':<32} the bound's Redis at one core of its own (tokens over its CPU "
                 f"seconds): {ceiling / 1e6:5.2f}")
        if runs["spread"]:
            spread = _median(runs["spread"])
            both = statistics.median(p["ceiling"] for p in runs["spread"])
            line += (f"\n  {'':<32} bound of 3 runs at once, one per shard: {spread / 1e6:5.2f} "
                     f"({_range(runs['spread'])}), {spread / bound:.2f}x the one-run bound; "
                     f"each shard at a core of its own: {both / 1e6:5.2f}, {both / ceiling:.2f}x")
        print(line + ("" if committed else "  (a bound pass did NOT commit everything)"))
    print(f"  part 5 took {out['seconds']:.0f} s")
    return ok
