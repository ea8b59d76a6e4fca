"""``make bench-control-plane``: what the control plane itself costs, two ways, in one run.

1. Manager ingest: a real manager on real NATS JetStream + Redis commits one step's chunks by its
   whole exactly-once path (pull consumer, Lua commit, acks, group and barrier events), published
   as ``rollout_svc`` does (awaited JetStream publishes, an engine step's chunks together) by
   emulated instances that heartbeat and hold the manager's own assignments; the tokens are the
   emu oracle's, checked token for token.
   Live: first publish -> barrier; drain: manager paused (SIGSTOP) while the stream fills. The
   baseline: the same messages from the same tasks, raw nats-py publish -> subscribe elsewhere.
2. Scheduling, EMULATION: 32 emu instances run a few steps with the real manager, trainer and
   weight service; each rollout (first assignment -> barrier) is set against the best schedule
   found knowing every length, simulated with the engine's own latency model.
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
from collections import deque
from itertools import chain, zip_longest
from pathlib import Path
from typing import Any

import httpx
import nats
import redis

from rlboost.launcher import Child, Cluster
from rollout_svc.__main__ import build
from rollout_svc.engines import GenRequest
from rollout_svc.engines.emu import EmuEngine
from shared import names
from shared import protocol as wire
from shared.bus import connect_nats, request
from shared.config import RolloutConfig
from shared.errors import RlboostError
from shared.names import Keys
from shared.process import exit_on_sigterm, wait_event
from shared.stack import Stack, child_env, free_port

Chunk = tuple[str, int, bool, bytes]  # request id, offset after it, final, encoded TokenChunk
RAW = "bench.raw"  # the baseline's subject: outside the chunk stream's
INGEST_SPEC: dict[str, Any] = {"model": "emu", "steps": 1, "prompts_per_step": 128,
                               "samples_per_prompt": 8, "max_new_tokens": 512, "seed": 11}
PUBLISHERS, CHUNK = 32, 4  # 32 instances x 32 responses; rollout's default chunk size
# Part 2: 32 instances as 8 processes of 4. One process of 32 would run its engine steps
# through asyncio's default thread pool, min(32, cores + 4) = 6 threads here: 6 of 32
# instances could "compute" at once and the figure would measure that pool, not the scheduler.
PROCS, PER_PROC, MAX_BATCH, CHUNK_2 = 8, 4, 8, 16
SCHED_SPEC: dict[str, Any] = {"model": "emu", "steps": 5, "prompts_per_step": 32,
                              "samples_per_prompt": 8, "max_new_tokens": 256, "seed": 5}


# --- part 1: manager ingest vs raw NATS ----------------------------------------------------------

class Publisher:
    """One emulated instance: takes the manager's assignments, heartbeats, publishes chunks."""

    def __init__(self, iid: str, run_id: str) -> None:
        self.iid, self.run_id, self.session = iid, run_id, secrets.token_hex(8)
        self.held: dict[str, wire.Assignment] = {}
        self.published: dict[str, int] = {}
        self.finished: dict[str, int] = {}  # final chunk sent: reported until its lease is gone
        self.lost = 0  # responses the manager took back while still being published

    async def on_assign(self, msg: Any) -> None:
        command = wire.decode_command(msg.data)
        if isinstance(command, wire.Assign):
            for a in command.items:
                self.held[a.request_id], self.published[a.request_id] = a, 0

    def beat(self) -> wire.Heartbeat:
        live = [wire.Held(request_id=r, epoch=a.epoch, published=self.published[r])
                for r, a in self.held.items() if r not in self.finished]
        return wire.Heartbeat(
            instance_id=self.iid, kind="spot", engine="emu", state="ready", run_id=self.run_id,
            weight_version=0, capacity=PUBLISHERS, session=self.session, held=live + [
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

    def messages(self, engine: EmuEngine) -> list[Chunk]:
        """Every chunk of every held response from the oracle, interleaved like a batch."""
        per: list[list[Chunk]] = []
        for rid, a in self.held.items():
            req = GenRequest(rid, a.prompt_token_ids, [], a.max_new_tokens, a.temperature, a.seed,
                             a.step, a.prompt_index, a.sample_index, a.eos_token_id, 0)
            tokens, parts = engine.expected_tokens(req), []
            stop = engine.natural_length(req) <= a.max_new_tokens  # else cut by the budget
            for off in range(0, len(tokens), CHUNK):
                part, final = tokens[off:off + CHUNK], off + CHUNK >= len(tokens)
                chunk = wire.TokenChunk(
                    request_id=rid, instance_id=self.iid, epoch=a.epoch, weight_version=0,
                    offset=off, token_ids=part, final=final,
                    finish_reason=("stop" if stop else "length") if final else None)
                chunk.mac = wire.chunk_mac(a.lease_key, chunk)
                parts.append((rid, off + len(part), final, wire.encode(chunk)))
            per.append(parts)
        return [m for m in chain.from_iterable(zip_longest(*per)) if m is not None]

    async def publish(self, js: Any, msgs: list[Chunk]) -> None:
        """As rollout_svc does: an engine step's chunks (one per live response) go out
        together, and all are acked before the next step's, so a response has at most one
        chunk in flight."""
        subject = names.chunk_subject(self.run_id, self.iid)
        for batch in engine_steps(msgs):
            await asyncio.gather(*(js.publish(subject, m[3], timeout=30.0) for m in batch))
            for rid, end, final, _ in batch:
                self.published[rid] = end
                if final and rid in self.held:
                    self.finished[rid] = self.held[rid].epoch


def engine_steps(msgs: list[Chunk]) -> list[list[Chunk]]:
    """Split interleaved chunks into the engine steps that produced them: a step ends where a
    response's next chunk begins."""
    steps: list[list[Chunk]] = []
    seen: set[str] = set()
    for m in msgs:
        if not steps or m[0] in seen:
            steps.append([])
            seen.clear()
        steps[-1].append(m)
        seen.add(m[0])
    return steps


async def manager_pass(nc: Any, http: httpx.AsyncClient, stack: Stack, tag: str,
                       paused: Child | None) -> dict[str, Any]:
    """One step of INGEST_SPEC, from registration to the barrier, checked against the oracle;
    with ``paused`` the manager is stopped while the chunks are published."""
    run_id = (await http.post("/v1/runs", json=INGEST_SPEC)).json()["id"]
    pubs = [Publisher(f"{tag}-{k}", run_id) for k in range(PUBLISHERS)]
    barrier: asyncio.Future[tuple[float, wire.Barrier]] = asyncio.get_running_loop().create_future()

    async def on_barrier(msg: Any) -> None:
        if not barrier.done():
            barrier.set_result((time.perf_counter(), wire.decode(msg.data, wire.Barrier)))
    await nc.subscribe(names.barrier_subject(run_id), cb=on_barrier)
    for p in pubs:  # register before the step starts, so dispatch spreads it evenly
        await nc.subscribe(names.assign_subject(p.iid), cb=p.on_assign)
        await request(nc, names.heartbeat_subject(p.iid), p.beat(), wire.HeartbeatReply, 10.0)
    # The trainer's side of the protocol: activate the run, start step 0 at version 0.
    await request(nc, names.TRAINER_POLL, wire.TrainerPoll(trainer_id="bench"), wire.ActiveRun)
    prompts = [[1, p % 10, 4 + p % 3, 3] for p in range(int(INGEST_SPEC["prompts_per_step"]))]
    start = wire.StepStart(run_id=run_id, step=0, weight_version=0, prompt_token_ids=prompts,
                           eos_token_id=2)
    assert (await request(nc, names.TRAINER_START, start, wire.Ack)).ok
    stop = asyncio.Event()
    beats = [asyncio.create_task(p.heartbeats(nc, stop)) for p in pubs]
    total = len(prompts) * int(INGEST_SPEC["samples_per_prompt"])
    while sum(len(p.held) for p in pubs) < total:
        await asyncio.sleep(0.05)
    msgs = [p.messages(EmuEngine(time_scale=0.0)) for p in pubs]
    if paused is not None:
        paused.signal(signal.SIGSTOP)
    t0 = time.perf_counter()
    await asyncio.gather(*(p.publish(nc.jetstream(), m) for p, m in zip(pubs, msgs, strict=True)))
    publish_s = time.perf_counter() - t0
    if paused is not None:
        paused.signal(signal.SIGCONT)
        t0 = time.perf_counter()
    t_end, done = await asyncio.wait_for(barrier, 300)
    stop.set()
    await asyncio.gather(*beats)
    await http.post(f"/v1/runs/{run_id}/cancel")  # no trainer will finish it; free the slot
    # Exactly once, checked: every response equals the oracle, no chunk was dropped or fenced.
    by_rid: dict[str, list[int]] = {}
    for m in chain.from_iterable(msgs):
        by_rid.setdefault(m[0], []).extend(wire.decode(m[3], wire.TokenChunk).token_ids)
    expected = {rid: ",".join(map(str, t)) for rid, t in by_rid.items()}
    with redis.Redis.from_url(stack.redis.url, decode_responses=True) as r:
        committed = {rid: r.hget(Keys.request(rid), "tokens") for rid in expected}
        step = r.hgetall(Keys.step(run_id, 0))
    return {"msgs": msgs, "tokens": sum(map(len, by_rid.values())), "responses": total,
            "seconds": t_end - t0, "publish_s": publish_s, "barrier_tokens": done.digest.tokens,
            "exact": committed == expected and len(expected) == done.digest.responses == total,
            "duplicates": int(step.get("duplicate_chunks_dropped", 0)),
            "stale": int(step.get("stale_chunks_rejected", 0)), "lost": sum(p.lost for p in pubs)}


async def raw_pass(nc: Any, url: str, msgs: list[list[Chunk]]) -> dict[str, Any]:
    """Baseline: the same bytes from the same publisher tasks, raw publish -> subscribe."""
    sink = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.control_plane", "--sink", url, str(sum(map(len, msgs))),
        stdout=asyncio.subprocess.PIPE, env=child_env({}))
    assert sink.stdout is not None
    await asyncio.wait_for(sink.stdout.readline(), 60)  # it is subscribed
    t0 = time.time()

    async def raw(batch: list[Chunk]) -> None:
        for m in batch:
            await nc.publish(RAW, m[3])
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


def part_ingest(root: Path) -> dict[str, Any]:
    stack = Stack.create(root / "brokers")
    stack.start()
    url = f"http://127.0.0.1:{free_port()}"
    # Leases and instances outlive the paused seconds of the drain pass (config, not code).
    env = {**stack.env(), "RLBOOST_MANAGER_URL": url, "RLBOOST_DATA_DIR": str(root / "data"),
           "RLBOOST_LOG_LEVEL": "WARNING", "RLBOOST_LEASE_TTL_S": "30",
           "RLBOOST_INSTANCE_TTL_S": "30"}
    manager = Child("manager", [sys.executable, "-m", "manager_svc"], env, root / "manager.log")
    cluster = Cluster(root, base_env=env, children=[manager])

    async def passes() -> dict[str, Any]:
        nc = await connect_nats(stack.nats.url, "bench")
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            live = await manager_pass(nc, http, stack, "live", paused=None)
            drain = await manager_pass(nc, http, stack, "drain", paused=manager)
        raw = await raw_pass(nc, stack.nats.url, live["msgs"])
        await nc.close()
        chunks = list(chain.from_iterable(live["msgs"]))
        return {"live": live, "drain": drain, "raw": raw, "chunks": len(chunks),
                "bytes": sum(len(m[3]) for m in chunks)}
    try:
        manager.start()
        cluster.wait_http(url)
        return asyncio.run(passes())
    finally:
        manager.signal(signal.SIGCONT)
        cluster.stop()
        stack.stop()


# --- part 2: 32 emu instances vs the ideal schedule ----------------------------------------------

def engine_time(eng: EmuEngine, jobs: list[tuple[int, int]]) -> float:
    """Seconds one engine spends on ``jobs`` (prefill tokens, response tokens) queued at once,
    stepping as ``EmuEngine.step`` does (join while a slot is free, prefill, one decode step)."""
    queue, t, active = deque(jobs), 0.0, list[int]()
    while queue or active:
        prefill = 0
        while queue and len(active) < eng.max_batch:
            p, n = queue.popleft()
            prefill, active = prefill + p, [*active, n]
        t += (eng.prefill_s_per_token * prefill + eng.decode_s_base
              + eng.decode_s_per_seq * len(active))
        active = [n - 1 for n in active if n > 1]
    return t * eng.time_scale


def ideal(eng: EmuEngine, jobs: list[tuple[int, int]], instances: int) -> tuple[float, float]:
    """(best makespan found, lower bound) knowing every length. Each instance gets one of the
    longest responses, the longest-headed ones the shortest mates: the longest response's
    instance then runs exactly the lower bound (it needs at least that many, that short, mates)."""
    if len(jobs) > instances * eng.max_batch:
        raise SystemExit("the ideal here assumes one wave: responses <= instances * max_batch")
    jobs = sorted(jobs, key=lambda j: -j[1])
    heads, rest = jobs[:instances], deque(reversed(jobs[instances:]))
    spare = len(rest) - (instances - 1) * (eng.max_batch - 1)  # mates the longest must take
    plan = [[h] for h in heads]
    for k, inst in enumerate(plan):
        want = max(spare, 0) if k == 0 else eng.max_batch - 1
        inst += [rest.popleft() for _ in range(min(want, len(rest)))]
    plan[-1] += list(rest)
    return max(engine_time(eng, p) for p in plan), engine_time(eng, plan[0])


def part_schedule(root: Path, time_scale: float) -> dict[str, Any]:
    stack = Stack.create(root / "brokers")
    stack.start()
    env = {**stack.env(), "RLBOOST_DATA_DIR": str(root / "data"), "RLBOOST_LOG_LEVEL": "WARNING",
           "RLBOOST_EMU_TIME_SCALE": str(time_scale), "RLBOOST_MAX_BATCH": str(MAX_BATCH),
           "RLBOOST_CHUNK_TOKENS": str(CHUNK_2)}
    cluster = Cluster(root, spot=0, reserved=0, engine="emu", base_env=env)
    try:
        cluster.start()
        pack = {**cluster.env, "RLBOOST_ENGINE": "emu", "RLBOOST_INSTANCE_KIND": "spot",
                "RLBOOST_EMU_INSTANCES": str(PER_PROC)}
        for k in range(PROCS):
            cluster.children.append(Child(f"pack{k}", [sys.executable, "-m", "rollout_svc"], {
                **pack, "RLBOOST_INSTANCE_ID": f"pack{k}"}, root / "logs" / f"pack{k}.log"))
            cluster.children[-1].start()
        # The very engine the rollout processes build from this environment: same constants.
        engine = build(RolloutConfig.from_env({**pack, "RLBOOST_EMU_INSTANCES": "1"}))[0].engine
        assert isinstance(engine, EmuEngine)
        n_inst, end = PROCS * PER_PROC, time.monotonic() + 400
        with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], timeout=30) as client:
            run_id = client.post("/v1/runs", json=SCHED_SPEC).json()["id"]
            while (run := client.get(f"/v1/runs/{run_id}").json())["state"] in ("queued",
                                                                                  "running"):
                if time.monotonic() > end or cluster.dead():
                    raise RuntimeError(f"run {run_id} stalled or a process died")
                time.sleep(0.5)
            if run["state"] != "succeeded":
                raise RuntimeError(f"run {run_id} {run['state']}: {run.get('error')}")
            records = client.get(f"/v1/runs/{run_id}/steps").json()
            samples = [client.get(f"/v1/runs/{run_id}/steps/{n}/samples").json()
                       for n in range(len(records))]
        r, rows = redis.Redis.from_url(stack.redis.url, decode_responses=True), []
        for rec, step in zip(records[1:], samples[1:], strict=True):  # step 0 includes start-up
            info = r.hgetall(Keys.step(run_id, rec["step"]))
            assigned = [float(r.hget(Keys.request(s["request_id"]), "assigned_at") or 0)
                        for s in step]
            jobs = [(len(s["prompt_token_ids"]), len(s["response_token_ids"])) for s in step]
            placed: dict[str, list[tuple[int, int]]] = {}
            for s, job in zip(step, jobs, strict=True):  # in dispatch (prompt, sample) order
                placed.setdefault(s["instances"][-1], []).append(job)
            done, long = float(info["rollout_done_at"]), max(range(len(jobs)),
                                                             key=lambda i: jobs[i][1])
            # The longest response on its instance as placed: wall time over the model's time,
            # per decode step, is the host's own overhead (its last chunk precedes the barrier).
            modelled = engine_time(engine, placed[step[long]["instances"][-1]])
            best, bound = ideal(engine, jobs, n_inst)
            rows.append({
                "step": rec["step"], "measured": done - min(assigned), "ideal": best,
                "bound": bound, "placement": max(engine_time(engine, j) for j in placed.values()),
                "spread": max(assigned) - min(assigned), "step_s": rec["step_s"],
                "wait": min(assigned) - float(info["started_at"]), "migr": rec["migrations"],
                "over_ms": 1e3 * (done - assigned[long] - modelled) / jobs[long][1]})
        r.close()
        return {"rows": rows, "engine": engine, "instances": n_inst, "responses": len(jobs)}
    finally:
        cluster.stop()
        stack.stop()


def report(a: dict[str, Any], b: dict[str, Any]) -> bool:
    live, drain, raw, n = a["live"], a["drain"], a["raw"], a["chunks"]
    tps = {"live": live["tokens"] / live["seconds"], "drain": drain["tokens"] / drain["seconds"],
           "raw": live["tokens"] / raw["seconds"]}
    print(f"\n[1] manager ingest: real manager, NATS JetStream, Redis, no emulated GPU time; per "
          f"pass {live['responses']} responses, {n} chunks ({a['bytes'] / n:.0f} B avg), "
          f"{live['tokens']} tokens, {PUBLISHERS} publishers")
    for key, label in (("live", "live, first publish -> barrier"),
                       ("drain", "drain, paused manager resumed -> barrier")):
        v = a[key]
        print(f"  manager, {label:<41}: {tps[key]:>7.0f} tokens/s {n / v['seconds']:>6.0f} "
              f"chunks/s ({v['seconds']:.2f} s; publishing {v['publish_s']:.2f} s)")
        print(f"    committed exactly as the oracle: {'yes' if v['exact'] else 'NO'} (barrier "
              f"tokens {v['barrier_tokens']}, duplicates {v['duplicates']}, stale {v['stale']}"
              f", taken back while publishing {v['lost']})")
    ingest = tps["live"] / tps["raw"]
    print(f"  baseline, raw nats-py publish -> subscribe {'':<7}: {tps['raw']:>7.0f} tokens/s "
          f"{n / raw['seconds']:>6.0f} chunks/s ({raw['seconds']:.2f} s; {raw['received']}/{n} "
          f"received)\n  manager / baseline: live {ingest:.3f}x (target >= 0.5x), drain "
          f"{tps['drain'] / tps['raw']:.3f}x")
    eng, rows = b["engine"], b["rows"]
    print(f"\n[2] EMULATION (emu engine, modelled H100 time x{eng.time_scale:g}: decode "
          f"{eng.decode_s_base * 1e3:.2f} ms + {eng.decode_s_per_seq * 1e3:.3f} ms/seq, "
          f"max_batch {eng.max_batch}; real manager, NATS, Redis, trainer, weight service)\n"
          f"  {b['instances']} instances ({PROCS} processes x {PER_PROC}), {b['responses']} "
          f"responses/step, chunk {CHUNK_2} tokens; rollout = first assignment -> barrier; "
          f"ideal = best schedule knowing every length, bound = a lower bound")
    print(f"  {'step':>4} {'rollout s':>9} {'ideal s':>7} {'bound s':>7} {'meas/ideal':>10} "
          f"{'placement/ideal':>15} {'start spread s':>14} {'ms/step over model':>18} "
          f"{'load wait s':>11} {'step s':>6} {'migr':>4}")
    for w in rows:
        print(f"  {w['step']:>4} {w['measured']:>9.3f} {w['ideal']:>7.3f} {w['bound']:>7.3f} "
              f"{w['measured'] / w['ideal']:>10.3f} {w['placement'] / w['ideal']:>15.3f} "
              f"{w['spread']:>14.2f} {w['over_ms']:>18.2f} {w['wait']:>11.2f} "
              f"{w['step_s']:>6.2f} {w['migr']:>4}")
    ratio = sum(w["measured"] for w in rows) / sum(w["ideal"] for w in rows)
    ok = bool(ingest >= 0.5 and live["exact"] and drain["exact"] and ratio <= 1.05)
    print(f"  EMULATION rollout measured / ideal, steps {rows[0]['step']}-{rows[-1]['step']}: "
          f"{ratio:.3f}x (target <= 1.05x)\nboth targets met: {'yes' if ok else 'NO'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="RLBOOST_EMU_TIME_SCALE for part 2 (modelled GPU time x this)")
    parser.add_argument("--sink", nargs=2, metavar=("NATS_URL", "COUNT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sink:
        asyncio.run(sink(args.sink[0], int(args.sink[1])))
        return 0
    exit_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="rlboost-cp-") as tmp:
        print("part 1: manager ingest vs raw NATS ...", flush=True)
        a = part_ingest(Path(tmp) / "ingest")
        print("part 2: 32 emu instances vs the ideal schedule ...", flush=True)
        b = part_schedule(Path(tmp) / "sched", args.time_scale)
    return 0 if report(a, b) else 1


if __name__ == "__main__":
    raise SystemExit(main())
