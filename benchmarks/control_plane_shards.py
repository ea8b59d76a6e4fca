"""Part 5 of ``make bench-control-plane``: committed tokens/s on Redis Cluster shards and manager
replicas, each configuration beside its own Redis-only bound, in one run.

Configurations (Redis, manager replicas): one plain Redis (today's default: pipelined commits)
with one manager, then a Redis Cluster (rlboost.ha_stack, no replicas: their ack is part 4's
cost) of 1 and of 3 shards, each with 1 and 3 managers. One NATS server throughout, so that
only Redis and the managers change. Each configuration is visited twice (in order, then in
reverse), each time on fresh processes, for SHARD_PASSES passes of:

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
share the CPU, so the spread bound is the machine's, and each bound's ceiling (tokens over the
CPU seconds its Redis spent while timed) says what each shard would commit on a core of its
own: a script runs on one core, so shards on cores of their own add their ceilings.
"""

from __future__ import annotations

import asyncio
import functools
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
SHARD_PASSES = int(os.environ.get("RLBOOST_BENCH_SHARD_PASSES", "2"))  # per visit; two visits
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


def redis_cpu(port: int) -> float:
    """CPU seconds (user + system) the Redis server on ``port`` has used so far."""
    with redis.Redis(host="127.0.0.1", port=port) as r:
        info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def timed_bound(url: str, msgs: Any, runs: dict[str, int]) -> dict[str, Any]:
    """The bound of ``runs`` (run id: the port of the Redis it lands on) committed at once, one
    run the plain bound: all their tokens over the time from the first clock's start to the
    last one's end. And the ceiling: each run's tokens over the CPU seconds its Redis spent
    while its clock ran, summed, i.e. what the shards commit with a core each (a script runs on
    one core; here three shards, their clients and the managers share two)."""
    done = await asyncio.gather(*(
        redis_bound(url, msgs, run=run, cpu=functools.partial(redis_cpu, port))
        for run, port in runs.items()))
    seconds = max(r["t1"] for r in done) - min(r["t0"] for r in done)
    return {"seconds": seconds, "tokens": sum(r["tokens"] for r in done),
            "ceiling": sum(r["tokens"] / r["redis_cpu_s"] for r in done
                           if r["redis_cpu_s"] > 0),
            "all_committed": all(r["all_committed"] for r in done)}


def one_config(root: Path, shards: int, managers: int, visit: int) -> dict[str, Any]:
    """SHARD_PASSES passes of each kind on fresh brokers and managers of one configuration."""
    tag_ = f"s{shards}m{managers}v{visit}"
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
                live = await manager_pass(nc, http, redis_url, f"{tag_}-{i}", None, FLUSH)
                msgs = live.pop("msgs")
                out["live"].append(live)
                one = f"bound-{tag_}-{i}"
                home = nodes.node_of(Keys.run(one)) if shards else plain.port
                out["bound"].append(await timed_bound(redis_url, msgs, {one: home}))
                if shards > 1:
                    spread = {run: nodes.node_of(Keys.run(run)) for run in spread_runs(nodes)}
                    out["spread"].append(await timed_bound(redis_url, msgs, spread))
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
    """Every configuration visited twice, in order and then in reverse, so that a drift of the
    machine over the part (seen here: the later configurations of one pass in order ran 20-30 %
    slower, bound included) weighs on each alike."""
    out: dict[str, Any] = {"flush": FLUSH, "configs": {c: {"live": [], "bound": [], "spread": []}
                                                       for c in CONFIGS}, "seconds": 0.0}
    t0 = time.perf_counter()
    for visit, (shards, managers) in enumerate([*CONFIGS, *reversed(CONFIGS)]):
        got = one_config(root / f"{visit}-shards{shards}-m{managers}", shards, managers, visit)
        for kind, passes in got.items():
            out["configs"][(shards, managers)][kind] += passes
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
          f"{2 * SHARD_PASSES} passes each (two visits), M tokens/s (range); ratio to the "
          f"configuration's own bound, and to the first configuration's live rate")
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
        line += (f"\n  {'':<32} the bound's Redis at a core of its own (tokens over its CPU "
                 f"seconds while timed): {ceiling / 1e6:5.2f}")
        if runs["spread"]:
            spread = _median(runs["spread"])
            both = statistics.median(p["ceiling"] for p in runs["spread"])
            line += (f"\n  {'':<32} bound of 3 runs at once, one per shard: {spread / 1e6:5.2f} "
                     f"({_range(runs['spread'])}), {spread / bound:.2f}x the one-run bound; "
                     f"each shard at a core of its own: {both / 1e6:5.2f}, {both / ceiling:.2f}x")
        print(line + ("" if committed else "  (a bound pass did NOT commit everything)"))
    print(f"  part 5 took {out['seconds']:.0f} s")
    return ok
