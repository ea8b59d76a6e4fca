"""``make bench-control-plane``: what the control plane itself costs, in one run.

1. Manager ingest, per flush interval (tokens per response per frame): a real manager on real
   NATS JetStream + Redis commits one step's token frames by its whole exactly-once path (pull
   consumer, Lua commit, acks, group and barrier events), published as ``rollout_svc`` does (one
   frame per flush with every response's new tokens, awaited) by emulated instances that
   heartbeat and hold the manager's own assignments; the tokens are the emu oracle's, checked
   token for token. Live: first publish -> barrier; drain: manager paused (SIGSTOP) while the
   stream fills, then resumed -> barrier (the manager alone, not the publishers). Baselines on
   the same frames: raw nats-py publish -> subscribe, and the Redis-only bound: the same commit
   script over the same frames back to back, in the manager's batches, no NATS, no manager.
2. Control-plane latency at 32 and 128 instances: emulated instances that cost nothing but
   their messages publish each frame when the emu engine's latency model says its tokens exist
   (and wait for its ack before generating on, as ``rollout_svc`` does). Overhead = assignment
   latency + publish waits on the critical instance + last ack -> barrier, against the modelled
   step time; the emulated engines' own Python cost is not in it.
3. One vs two manager replicas: the live pass of part 1 again with a second manager on the same
   brokers, exactly once checked the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import signal
import sys
import tempfile
import time
from collections import Counter
from itertools import chain, zip_longest
from pathlib import Path
from typing import Any

import httpx
import nats
import redis

from manager_svc.accounting import Ledger
from manager_svc.ingest import FETCH_BATCH
from rlboost.launcher import Child, Cluster
from rollout_svc.engines import GenRequest
from rollout_svc.engines.emu import EmuEngine
from shared import names
from shared import protocol as wire
from shared.bus import connect_nats, connect_redis, request
from shared.errors import RlboostError
from shared.names import Keys, parse_request_id, request_id
from shared.process import exit_on_sigterm, wait_event
from shared.stack import Stack, child_env, free_port

Meta = list[tuple[str, int, bool]]  # per entry: request id, offset after it, final
Frame = tuple[Meta, bytes]  # an encoded TokenFrame and what its entries carry
RAW = "bench.raw"  # the baseline's subject: outside the chunk stream's
INGEST_SPEC: dict[str, Any] = {"model": "emu", "steps": 1, "prompts_per_step": 128,
                               "samples_per_prompt": 8, "max_new_tokens": 512, "seed": 11}
PUBLISHERS = 32  # 32 instances x 32 responses
# Flush intervals measured: rollout's default, 16, and 64, the one the goal is at. Waste per
# preempted response stays within one flush at any of them (bench-preempt --chunk-tokens 64);
# for reasoning responses of thousands of tokens, 64 lost to a SIGKILL is under 2 %.
FLUSHES = (4, 16, 64)
GOAL_TPS, GOAL_BOUND, GOAL_OVERHEAD = 1_000_000, 0.8, 0.05
# Part 2: instances, responses each, flush interval; max_new_tokens as in part 1.
FLEETS, PER_INSTANCE, LATENCY_FLUSH = (32, 128), 32, 16


def prompts(n: int) -> list[list[int]]:
    return [[1, p % 10, 4 + p % 3, 3] for p in range(n)]


# --- part 1: manager ingest vs raw NATS ----------------------------------------------------------

class Publisher:
    """One emulated instance: takes the manager's assignments, heartbeats, publishes chunks."""

    def __init__(self, iid: str, run_id: str, capacity: int = PUBLISHERS) -> None:
        self.iid, self.run_id, self.session = iid, run_id, secrets.token_hex(8)
        self.capacity = capacity
        self.assigned_at = 0.0  # perf_counter of its first assignment
        self.held: dict[str, wire.Assignment] = {}
        self.published: dict[str, int] = {}
        self.finished: dict[str, int] = {}  # final chunk sent: reported until its lease is gone
        self.lost = 0  # responses the manager took back while still being published

    async def on_assign(self, msg: Any) -> None:
        command = wire.decode_command(msg.data)
        if isinstance(command, wire.Assign):
            self.assigned_at = self.assigned_at or time.perf_counter()
            for a in command.items:
                self.held[a.request_id], self.published[a.request_id] = a, 0

    def beat(self) -> wire.Heartbeat:
        live = [wire.Held(request_id=r, epoch=a.epoch, published=self.published[r])
                for r, a in self.held.items() if r not in self.finished]
        return wire.Heartbeat(
            instance_id=self.iid, kind="spot", engine="emu", state="ready", run_id=self.run_id,
            weight_version=0, capacity=self.capacity, session=self.session, held=live + [
                wire.Held(request_id=r, epoch=e) for r, e in self.finished.items()])

    async def heartbeats(self, nc: Any, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                reply = await request(nc, names.heartbeat_subject(self.iid), self.beat(),
                                      wire.HeartbeatReply, 5.0)
            except RlboostError:  # answered late (or the manager is paused): the next one renews
                reply = wire.HeartbeatReply()
            for rid in reply.revoke:  # a finished response leaves; a live one was taken back
                self.lost += rid not in self.finished and rid in self.held
                self.finished.pop(rid, None)
                self.held.pop(rid, None)
            await wait_event(stop, 0.5)

    def messages(self, engine: EmuEngine, flush: int) -> list[Frame]:
        """Every frame of this instance from the oracle: one per flush, with the next
        ``flush`` tokens of every live response, as rollout_svc publishes them."""
        per: list[list[tuple[str, int, bool, wire.FrameEntry]]] = []
        for rid, a in self.held.items():
            req = GenRequest(rid, a.prompt_token_ids, [], a.max_new_tokens, a.temperature, a.seed,
                             a.step, a.prompt_index, a.sample_index, a.eos_token_id, 0)
            tokens, parts = engine.expected_tokens(req), []
            stop = engine.natural_length(req) <= a.max_new_tokens  # else cut by the budget
            for off in range(0, len(tokens), flush):
                part, final = tokens[off:off + flush], off + flush >= len(tokens)
                entry = wire.FrameEntry(
                    request_id=rid, epoch=a.epoch, weight_version=0, offset=off, token_ids=part,
                    final=final, finish_reason=("stop" if stop else "length") if final else None)
                entry.mac = wire.entry_mac(a.lease_key, self.iid, entry)
                parts.append((rid, off + len(part), final, entry))
            per.append(parts)
        frames: list[Frame] = []
        for at_once in zip_longest(*per):
            items = [x for x in at_once if x is not None]
            frame = wire.TokenFrame(instance_id=self.iid, entries=[x[3] for x in items])
            frames.append(([x[:3] for x in items], wire.encode(frame)))
        return frames

    async def publish(self, js: Any, frames: list[Frame]) -> None:
        """As rollout_svc does: one frame per flush, acked before the next, so a response has
        at most one entry in flight."""
        subject = names.chunk_subject(self.run_id, self.iid)
        for meta, data in frames:
            await js.publish(subject, data, timeout=30.0)
            for rid, end, final in meta:
                self.published[rid] = end
                if final and rid in self.held:
                    self.finished[rid] = self.held[rid].epoch


class Step:
    """One step of a run, driven from the trainer's side of the protocol with ``n`` emulated
    instances registered first (so dispatch spreads it evenly)."""

    def __init__(self, nc: Any, http: httpx.AsyncClient, tag: str, n: int, per: int) -> None:
        self.nc, self.http, self.tag, self.n, self.per = nc, http, tag, n, per
        self.spec = {**INGEST_SPEC, "prompts_per_step": n * per // 8}
        self.loop = asyncio.get_running_loop()
        self.barrier: asyncio.Future[tuple[float, wire.Barrier]] = self.loop.create_future()
        self.stop = asyncio.Event()
        self.total = n * per

    async def start(self) -> list[Publisher]:
        """Register, start step 0; returns once every response is assigned."""
        self.run_id = (await self.http.post("/v1/runs", json=self.spec)).json()["id"]
        pubs = [Publisher(f"{self.tag}-{k}", self.run_id, self.per) for k in range(self.n)]

        async def on_barrier(msg: Any) -> None:
            if not self.barrier.done():
                self.barrier.set_result((time.perf_counter(), wire.decode(msg.data,
                                                                          wire.Barrier)))
        await self.nc.subscribe(names.barrier_subject(self.run_id), cb=on_barrier)
        for p in pubs:
            await self.nc.subscribe(names.assign_subject(p.iid), cb=p.on_assign)
            await request(self.nc, names.heartbeat_subject(p.iid), p.beat(),
                          wire.HeartbeatReply, 10.0)
        await request(self.nc, names.TRAINER_POLL, wire.TrainerPoll(trainer_id="bench"),
                      wire.ActiveRun)
        start = wire.StepStart(run_id=self.run_id, step=0, weight_version=0,
                               prompt_token_ids=prompts(int(self.spec["prompts_per_step"])),
                               eos_token_id=2)
        self.started = time.perf_counter()
        assert (await request(self.nc, names.TRAINER_START, start, wire.Ack)).ok
        self.beats = [asyncio.create_task(p.heartbeats(self.nc, self.stop)) for p in pubs]
        while sum(len(p.held) for p in pubs) < self.total:
            await asyncio.sleep(0.01)
        return pubs

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.beats)
        await self.http.post(f"/v1/runs/{self.run_id}/cancel")  # no trainer will finish it


async def manager_pass(nc: Any, http: httpx.AsyncClient, stack: Stack, tag: str,
                       paused: Child | None, flush: int) -> dict[str, Any]:
    """One step of INGEST_SPEC, from registration to the barrier, checked against the oracle;
    with ``paused`` the manager is stopped while the frames are published."""
    step = Step(nc, http, tag, PUBLISHERS, PUBLISHERS)
    pubs = await step.start()
    run_id, barrier, total = step.run_id, step.barrier, step.total
    msgs = [p.messages(EmuEngine(time_scale=0.0), flush) for p in pubs]
    if paused is not None:
        paused.signal(signal.SIGSTOP)
    t0 = time.perf_counter()
    await asyncio.gather(*(p.publish(nc.jetstream(), m) for p, m in zip(pubs, msgs, strict=True)))
    publish_s = time.perf_counter() - t0
    if paused is not None:
        paused.signal(signal.SIGCONT)
        t0 = time.perf_counter()
    t_end, done = await asyncio.wait_for(barrier, 300)
    await step.finish()
    # Exactly once, checked: every response equals the oracle, no chunk was dropped or fenced.
    by_rid: dict[str, list[int]] = {}
    for _, data in chain.from_iterable(msgs):
        for e in wire.decode(data, wire.TokenFrame).entries:
            by_rid.setdefault(e.request_id, []).extend(e.token_ids)
    expected = {rid: ",".join(map(str, t)) for rid, t in by_rid.items()}
    with redis.Redis.from_url(stack.redis.url, decode_responses=True) as r:
        committed = {rid: r.get(Keys.tokens(rid)) for rid in expected}
        info = r.hgetall(Keys.step(run_id, 0))
    return {"msgs": msgs, "tokens": sum(map(len, by_rid.values())), "responses": total,
            "seconds": t_end - t0, "publish_s": publish_s, "barrier_tokens": done.digest.tokens,
            "exact": committed == expected and len(expected) == done.digest.responses == total,
            "duplicates": int(info.get("duplicate_chunks_dropped", 0)),
            "stale": int(info.get("stale_chunks_rejected", 0)), "lost": sum(p.lost for p in pubs),
            "entries": sum(len(m[0]) for m in chain.from_iterable(msgs)),
            "frames": sum(map(len, msgs)),
            "bytes": sum(len(m[1]) for m in chain.from_iterable(msgs))}


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


async def redis_bound(url: str, msgs: list[list[Frame]]) -> dict[str, Any]:
    """The same frames' commit scripts back to back on a fresh step (each response leased to
    the instance that sent it), in stream order and in the manager's batches of FETCH_BATCH
    frames, one round trip at a time as ingest does; arguments packed before the clock starts.
    No NATS, no manager, no MAC checks: what Redis alone allows."""
    r = await connect_redis(url)
    ledger = Ledger(r, lease_ttl_s=600)
    run = f"bound-{secrets.token_hex(3)}"
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
    batches = [ledger.pack(frames[i:i + FETCH_BATCH]) for i in range(0, len(frames), FETCH_BATCH)]
    t0 = time.perf_counter()
    results = [res for calls in batches for res in await ledger.run_commits(calls)]
    seconds = time.perf_counter() - t0
    await r.aclose()
    statuses = Counter(res.status for res in results)
    committed = sum(statuses[s] for s in ("ok", "final", "group", "step"))
    return {"seconds": seconds, "all_committed": committed == len(results), "statuses": statuses,
            "tokens": sum(len(e.token_ids) for f in frames for e in f.entries)}


def part_ingest(root: Path) -> dict[str, Any]:
    stack = Stack.create(root / "brokers")
    stack.start()
    url = f"http://127.0.0.1:{free_port()}"
    # Leases and instances outlive the paused seconds of the drain pass (config, not code).
    env = {**stack.env(), "RLBOOST_MANAGER_URL": url, "RLBOOST_DATA_DIR": str(root / "data"),
           "RLBOOST_LOG_LEVEL": "WARNING", "RLBOOST_LEASE_TTL_S": "30",
           "RLBOOST_INSTANCE_TTL_S": "30",
           # Emulated instances generate only what they were first given: an idle one never
           # generates work moved to it, so rebalancing would stall the step.
           "RLBOOST_REBALANCE_SKEW": "0"}
    manager = Child("manager", [sys.executable, "-m", "manager_svc"], env, root / "manager.log")
    cluster = Cluster(root, base_env=env, children=[manager])

    async def passes() -> dict[str, Any]:
        nc = await connect_nats(stack.nats.url, "bench")
        out: dict[str, Any] = {"ingest": {}, "latency": {}}
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            for flush in FLUSHES:
                live = await manager_pass(nc, http, stack, f"live{flush}", None, flush)
                drain = await manager_pass(nc, http, stack, f"drain{flush}", manager, flush)
                raw = await raw_pass(nc, stack.nats.url, live["msgs"])
                bound = await redis_bound(stack.redis.url, live["msgs"])
                del live["msgs"], drain["msgs"]
                out["ingest"][flush] = {"live": live, "drain": drain, "raw": raw,
                                        "bound": bound}
            for n in FLEETS:
                out["latency"][n] = await latency_pass(nc, http, n)
            # One vs two replicas: a second manager joins the same brokers (a standby for
            # ingest, which one replica at a time commits, and for dispatch; both answer the
            # bus), then the same live pass again.
            flush = max(FLUSHES)
            second.start()
            cluster.children.append(second)  # stopped with the rest; not before it runs
            cluster.wait_http(second.env["RLBOOST_MANAGER_URL"])
            two = await manager_pass(nc, http, stack, f"two{flush}", None, flush)
            del two["msgs"]
            out["replicas"] = {"flush": flush, "one": out["ingest"][flush]["live"], "two": two}
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


# --- part 2: control-plane latency at 32 and 128 instances ---------------------------------------

def flush_times(engine: EmuEngine, meta: list[Meta], lengths: dict[str, int]) -> list[float]:
    """When each frame's tokens exist, in modelled seconds after the instance's assignment:
    a decode step costs decode_s_base + decode_s_per_seq x live responses (its prefill is
    noise at these prompt lengths), and a frame goes out at the step that completes it."""
    steps = max(lengths.values())
    live = [sum(n > s for n in lengths.values()) for s in range(steps)]
    at, t = [], 0.0
    cum = [t := t + engine.decode_s_base + engine.decode_s_per_seq * k for k in live]
    for entries in meta:
        last = max(end for _, end, _ in entries)  # the step that produced its last token
        at.append(cum[last - 1])
    return at


async def paced(p: Publisher, js: Any, frames: list[Frame], at: list[float]) -> dict[str, float]:
    """Publish each frame when the model says its tokens exist, waiting for its ack before
    going on as rollout_svc's generate loop does: an ack wait delays every later frame."""
    subject, waited, base = names.chunk_subject(p.run_id, p.iid), 0.0, p.assigned_at
    for (meta, data), due in zip(frames, at, strict=True):
        await asyncio.sleep(max(0.0, base + due + waited - time.perf_counter()))
        t0 = time.perf_counter()
        await js.publish(subject, data, timeout=30.0)
        waited += time.perf_counter() - t0
        for rid, end, final in meta:
            p.published[rid] = end
            if final and rid in p.held:
                p.finished[rid] = p.held[rid].epoch
    return {"waited": waited, "acked": time.perf_counter(), "modelled": at[-1]}


async def latency_pass(nc: Any, http: httpx.AsyncClient, n: int) -> dict[str, Any]:
    """One step on ``n`` instances of PER_INSTANCE responses: assignment latency, ack waits,
    last ack -> barrier, against the modelled step time (latency model at time scale 1)."""
    engine = EmuEngine(time_scale=0.0)
    step = Step(nc, http, f"lat{n}", n, PER_INSTANCE)
    pubs = await step.start()
    frames = [p.messages(engine, LATENCY_FLUSH) for p in pubs]
    times = []
    for fs in frames:
        lengths = {rid: end for meta, _ in fs for rid, end, final in meta if final}
        times.append(flush_times(engine, [m for m, _ in fs], lengths))
    got = await asyncio.gather(*(paced(p, nc.jetstream(), f, t)
                                 for p, f, t in zip(pubs, frames, times, strict=True)))
    try:
        t_end, done = await asyncio.wait_for(step.barrier, 120)
    except TimeoutError:  # reported, not raised: the other figures still stand
        await step.finish()
        return {"stalled": True, "lost": sum(p.lost for p in pubs)}
    await step.finish()
    assign = [p.assigned_at - step.started for p in pubs]
    ideal = max(g["modelled"] for g in got)
    # The critical instance: the one whose tokens would exist last with the control plane's
    # delays (assignment, ack waits) and no other cost.
    critical = max(a + g["modelled"] + g["waited"] for a, g in zip(assign, got, strict=True))
    after = t_end - max(g["acked"] for g in got)
    overhead = critical - ideal + after
    return {"responses": step.total, "tokens": done.digest.tokens, "ideal": ideal,
            "assign_max": max(assign), "assign_mean": sum(assign) / n,
            "waited_max": max(g["waited"] for g in got), "barrier": after,
            "overhead": overhead, "fraction": overhead / (ideal + overhead),
            "frames": sum(map(len, frames)), "wall": t_end - step.started,
            "exact": done.digest.responses == step.total}


def report(out: dict[str, Any]) -> bool:
    ok = True
    print(f"\n[1] manager ingest: real manager, NATS JetStream, Redis (appendfsync always), no "
          f"emulated GPU time; per pass {PUBLISHERS} instances x {PUBLISHERS} responses, "
          f"max_new_tokens {INGEST_SPEC['max_new_tokens']}")
    best = 0.0
    for flush, a in out["ingest"].items():
        live, drain, raw, bound = a["live"], a["drain"], a["raw"], a["bound"]
        tok, frames = live["tokens"], live["frames"]
        tps = {"live": tok / live["seconds"], "drain": tok / drain["seconds"],
               "raw": tok / raw["seconds"], "bound": bound["tokens"] / bound["seconds"]}
        best = max(best, tps["drain"])
        print(f"  flush {flush} tokens/response: {frames} frames of {live['entries'] / frames:.1f}"
              f" entries ({live['bytes'] / frames:.0f} B avg), {tok} tokens")
        for key, label in (("live", "manager, live: first publish -> barrier"),
                           ("drain", "manager, drain: resumed -> barrier")):
            v = a[key]
            print(f"    {label:<44}: {tps[key]:>10,.0f} tokens/s {frames / v['seconds']:>7,.0f}"
                  f" frames/s ({v['seconds']:.2f} s; publishing {v['publish_s']:.2f} s); exactly"
                  f" once as the oracle: {'yes' if v['exact'] else 'NO'} (duplicates "
                  f"{v['duplicates']}, stale {v['stale']}, taken back {v['lost']})")
            ok = ok and v["exact"]
        print(f"    {'raw nats-py publish -> subscribe':<44}: {tps['raw']:>10,.0f} tokens/s "
              f"({raw['received']}/{frames} received)")
        print(f"    {'Redis-only bound, same script back to back':<44}: {tps['bound']:>10,.0f} "
              f"tokens/s (all committed: {'yes' if bound['all_committed'] else bound['statuses']})")
        print(f"    ratios: drain/bound {tps['drain'] / tps['bound']:.2f}x, live/bound "
              f"{tps['live'] / tps['bound']:.2f}x, drain/raw {tps['drain'] / tps['raw']:.3f}x, "
              f"bound/raw {tps['bound'] / tps['raw']:.3f}x")
        if flush == max(FLUSHES):
            ok = ok and tps["drain"] >= GOAL_TPS and tps["drain"] >= GOAL_BOUND * tps["bound"]
    print(f"\n[2] control-plane latency: real manager, NATS, Redis; emulated instances publish "
          f"frames (flush {LATENCY_FLUSH}) when the emu latency model says the tokens exist, "
          f"{PER_INSTANCE} responses each; overhead = assignment + ack waits on the critical "
          f"instance + last ack -> barrier")
    print(f"  {'instances':>9} {'responses':>9} {'modelled s':>10} {'assign max/mean ms':>18} "
          f"{'ack wait max ms':>15} {'ack->barrier ms':>15} {'overhead ms':>11} {'of step':>7}")
    for n, v in out["latency"].items():
        if v.get("stalled"):
            print(f"  {n:>9} no barrier within 120 s after the last frame ({v['lost']} "
                  f"responses taken back from their publishers)")
            ok = False
            continue
        print(f"  {n:>9} {v['responses']:>9} {v['ideal']:>10.2f} "
              f"{v['assign_max'] * 1e3:>9.1f}/{v['assign_mean'] * 1e3:<8.1f} "
              f"{v['waited_max'] * 1e3:>15.1f} {v['barrier'] * 1e3:>15.1f} "
              f"{v['overhead'] * 1e3:>11.1f} {v['fraction']:>7.2%}")
        ok = ok and v["exact"] and v["fraction"] <= GOAL_OVERHEAD
    reps = out["replicas"]
    one, two = reps["one"], reps["two"]
    print(f"\n[3] manager replicas, live pass at flush {reps['flush']} (one commits the chunk "
          f"stream at a time, pinned; the other stands by and answers the bus):")
    for label, v in (("one replica", one), ("two replicas", two)):
        print(f"  {label:<13}: {v['tokens'] / v['seconds']:>10,.0f} tokens/s ({v['seconds']:.2f} "
              f"s); exactly once as the oracle: {'yes' if v['exact'] else 'NO'} (duplicates "
              f"{v['duplicates']}, stale {v['stale']}, taken back {v['lost']})")
        ok = ok and v["exact"]
    print(f"  two/one: {(two['tokens'] / two['seconds']) / (one['tokens'] / one['seconds']):.2f}x")
    print(f"\ngoals (>= {GOAL_TPS:,} committed tokens/s at flush {max(FLUSHES)}, >= "
          f"{GOAL_BOUND}x the Redis-only bound, overhead <= {GOAL_OVERHEAD:.0%}): "
          f"{'met' if ok else 'NOT met'}; best committed rate {best:,.0f} tokens/s")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sink", nargs=2, metavar=("NATS_URL", "COUNT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sink:
        asyncio.run(sink(args.sink[0], int(args.sink[1])))
        return 0
    exit_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="rlboost-cp-") as tmp:
        print("manager ingest vs raw NATS vs Redis alone; control-plane latency ...", flush=True)
        out = part_ingest(Path(tmp))
    return 0 if report(out) else 1


if __name__ == "__main__":
    raise SystemExit(main())
