"""Part 2 of ``make bench-control-plane``: control-plane latency at 32 and 128 instances.

Emulated instances that cost nothing but their messages publish each frame when the emu
engine's latency model says its tokens exist (one frame in flight: a flush waits for the last
one's ack, as ``rollout_svc`` does). Overhead = assignment latency (the trainer's start -> the
instance's Assign on the bus, as a probe process sees it) + ack waits on the critical instance
+ last ack -> barrier, against the modelled step time; the emulated engines' own Python cost is
not in it. Then the step's instances only beat for BEAT_WINDOW_S: the manager's CPU a beat.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import nats

from benchmarks.control_plane_fleet import Frame, Meta, Publisher, Step
from rlboost.stack import child_env
from rollout_svc.engines.emu import EmuEngine
from shared import names
from shared import protocol as wire

# Instances, responses each, flush interval, max_new_tokens (kept at 512, so its modelled
# step is as short as before: the overhead is a larger share of a short step).
FLEETS, PER_INSTANCE, LATENCY_FLUSH, LATENCY_MAX_NEW = (32, 128), 32, 16, 512
BEAT_WINDOW_S = 3.0  # after a latency pass's barrier: nothing but heartbeats


async def probe(url: str, count: int) -> None:
    """Assignment probe, in a process of its own as each real instance is: when each of
    ``count`` instances' first Assign reached the bus (wall clock), and nothing else. The
    emulated instances see theirs later, behind the other 127 in one event loop."""
    nc = await nats.connect(url)
    first: dict[str, float] = {}
    done = asyncio.Event()

    async def on_msg(msg: Any) -> None:
        iid = names.subject_instance(msg.subject)
        if iid not in first and isinstance(wire.decode_command(msg.data), wire.Assign):
            first[iid] = time.time()
            if len(first) == count:
                done.set()
    await nc.subscribe(names.assign_subject("*"), cb=on_msg)
    await nc.flush()
    print("subscribed", flush=True)
    await asyncio.wait_for(done.wait(), 120)
    print(json.dumps(first), flush=True)
    await nc.close()



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
    """Publish each frame when the model says its tokens exist, as rollout_svc's generate loop
    does: the engine goes on while a frame's ack is awaited, the next flush waits for it (one
    frame in flight), and that wait delays every later frame; so does the last frame's, which
    the barrier waits for."""
    subject, waited, base = names.chunk_subject(p.run_id, p.iid), 0.0, p.assigned_at
    inflight: tuple[asyncio.Future[Any], Meta] | None = None

    async def settle(sent: tuple[asyncio.Future[Any], Meta]) -> None:
        nonlocal waited
        t0 = time.perf_counter()
        await sent[0]
        waited += time.perf_counter() - t0
        for rid, end, final in sent[1]:
            p.published[rid] = end
            if final and rid in p.held:
                p.finished[rid] = p.held[rid].epoch
    for (meta, data), due in zip(frames, at, strict=True):
        await asyncio.sleep(max(0.0, base + due + waited - time.perf_counter()))
        if inflight is not None:
            await settle(inflight)
        inflight = (asyncio.ensure_future(js.publish(subject, data, timeout=30.0)), meta)
    if inflight is not None:
        await settle(inflight)
    return {"waited": waited, "acked": time.perf_counter(), "modelled": at[-1]}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def latency_pass(nc: Any, http: httpx.AsyncClient, n: int, manager_pid: int
                       ) -> dict[str, Any]:
    """One step on ``n`` instances of PER_INSTANCE responses: assignment latency, ack waits,
    last ack -> barrier, against the modelled step time (latency model at time scale 1).
    Then the step's instances only beat for BEAT_WINDOW_S: the manager's CPU time a beat."""
    engine = EmuEngine(time_scale=0.0)
    step = Step(nc, http, f"lat{n}", n, PER_INSTANCE, LATENCY_MAX_NEW)
    watch = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.control_plane", "--probe", nc.connected_url.geturl(),
        str(n), stdout=asyncio.subprocess.PIPE, env=child_env({}))
    assert watch.stdout is not None
    await asyncio.wait_for(watch.stdout.readline(), 60)  # it is subscribed
    pubs = await step.start()
    arrived = json.loads(await asyncio.wait_for(watch.stdout.readline(), 120))
    await watch.wait()
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
        await step.finish(pubs)
        return {"stalled": True, "lost": sum(p.lost for p in pubs)}
    beats, cpu = sum(p.beats for p in pubs), cpu_seconds(manager_pid)
    await asyncio.sleep(BEAT_WINDOW_S)
    beats, cpu = sum(p.beats for p in pubs) - beats, cpu_seconds(manager_pid) - cpu
    await step.finish(pubs)
    # Assignment latency: trainer's start -> the instance's Assign on the bus, by the probe.
    assign = [arrived[p.iid] - step.started_wall for p in pubs]
    seen = max(p.assigned_at - step.started for p in pubs)  # by the emulated instances
    ideal = max(g["modelled"] for g in got)
    # The critical instance: the one whose tokens would exist last with the control plane's
    # delays (assignment, ack waits) and no other cost.
    critical = max(a + g["modelled"] + g["waited"] for a, g in zip(assign, got, strict=True))
    after = t_end - max(g["acked"] for g in got)
    overhead = critical - ideal + after
    return {"responses": step.total, "tokens": done.digest.tokens, "ideal": ideal,
            "assign_max": max(assign), "assign_mean": sum(assign) / n, "assign_seen": seen,
            "waited_max": max(g["waited"] for g in got), "barrier": after,
            "overhead": overhead, "fraction": overhead / (ideal + overhead),
            "frames": sum(map(len, frames)), "wall": t_end - step.started,
            "exact": done.digest.responses == step.total,
            "beats_per_s": beats / BEAT_WINDOW_S, "cpu_per_beat": cpu / max(beats, 1)}
