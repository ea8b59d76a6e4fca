"""``make bench-preempt``: token-level migration vs request-level restart, one schedule, one run.

EMULATION: rollout instances run the ``emu`` engine (modelled H100 decode time) and the trainer
an emulated 8B compute model; the manager, NATS, Redis, leases and weight transfer are real.

Both modes get the same workload (seed, prompts, long-tailed lengths) and the same preemption
schedule: every ``--every`` seconds the next spot instance in a fixed rotation gets a notice
(SIGTERM) or dies (SIGKILL), alternately, and a fresh spot instance joins in its place. With
token-level migration a preempted response continues elsewhere from its last committed token;
with request-level restart (``RLBOOST_MIGRATION=request``) it starts over. Printed: tokens
regenerated per preempted response (the manager's step counters), and step time, for both,
and their ratios. Then, per preemption and separately for notices (SIGTERM) and hard kills
(SIGKILL), from the messages the services exchange (:mod:`benchmarks.preempt_watch`, which
defines each figure): the responses it moved, their hand-on time (signal -> leased to another
instance), the tokens regenerated, the tokens re-prefilled by the instances that took them
over (prompt + committed), and the victim's GPU-seconds lost (idle until its work was handed
on, plus the share of its decode whose output the next owner does again); with the
request/token ratios. Each mode runs once (~1.5 minutes each here, ~3 in all): with a
preemption every 3 s that is eight to ten of each kind, a third to a half of them holding
work, so the per-preemption figures carry that sample's noise.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.preempt_watch import Preemption, Watch, preemptions
from benchmarks.provenance import printed as provenance_of
from rlboost.launcher import Cluster
from rlboost.stack import Stack
from rollout_svc.engines.emu_models import serving_model
from shared.process import exit_on_sigterm

SPEC = {"model": "emu", "steps": 6, "prompts_per_step": 16, "samples_per_prompt": 4,
        "max_new_tokens": 512, "seed": 3}
CHUNK_TOKENS = 4  # the flush interval by default (RLBOOST_CHUNK_TOKENS); --chunk-tokens
SPOT = 4
EMU_MODEL = "emu-8b"  # the serving-cost preset: its GPUs per instance scale lost GPU-seconds
SIGNALS = ("SIGTERM", "SIGKILL")  # a notice, a hard kill: every other preemption each
ENV = {"RLBOOST_EMU_TIME_SCALE": "1.0", "RLBOOST_EMU_MODEL": EMU_MODEL,
       "RLBOOST_LEASE_TTL_S": "1.5", "RLBOOST_INSTANCE_TTL_S": "1.5", "RLBOOST_HEARTBEAT_S": "0.25",
       "RLBOOST_GRACE_S": "5",
       "RLBOOST_REBALANCE_SKEW": "0"}


def preempt_loop(cluster: Cluster, watch: Watch, every_s: float, stop: threading.Event) -> int:
    """Preempt spot instances in rotation until ``stop``; returns how many. Each preempted
    instance is replaced at once, so spot capacity stays at SPOT processes (churn, as on a
    spot market), never more."""
    count = 0
    signalled: set[str] = set()
    while not stop.wait(every_s):
        spots = [c for c in cluster.children
                 if c.name.startswith("spot") and c.alive() and c.name not in signalled]
        if len(spots) < SPOT:
            continue  # replacements still starting: preempt only a full pool
        victim = spots[count % len(spots)]
        name = SIGNALS[count % 2]
        watch.signal(victim.name, name)
        victim.signal(signal.Signals[name])
        signalled.add(victim.name)
        cluster.add_instance("spot", f"spot-r{count}")
        count += 1
    return count


def run_mode(mode: str, root: Path, every_s: float, chunk_tokens: int) -> dict[str, Any]:
    stack = Stack.create(root / "brokers")
    stack.start()
    env = {**stack.env(), **ENV, "RLBOOST_DATA_DIR": str(root / "data"),
           "RLBOOST_MIGRATION": mode, "RLBOOST_CHUNK_TOKENS": str(chunk_tokens)}
    cluster = Cluster(root, spot=SPOT, reserved=1, engine="emu", base_env=env)
    watch = Watch(stack.nats.url)
    try:
        watch.start()
        cluster.start()
        url = cluster.env["RLBOOST_MANAGER_URL"]
        with httpx.Client(base_url=url, timeout=10) as client:
            run_id = client.post("/v1/runs", json=SPEC).json()["id"]
            while client.get(f"/v1/runs/{run_id}").json()["step"] < 1:
                time.sleep(0.2)  # preempt from step 1: step 0 includes start-up
            stop = threading.Event()
            result: list[int] = []
            thread = threading.Thread(
                target=lambda: result.append(preempt_loop(cluster, watch, every_s, stop)))
            thread.start()
            started = time.monotonic()
            while client.get(f"/v1/runs/{run_id}").json()["state"] not in (
                    "succeeded", "failed", "cancelled"):
                time.sleep(0.3)
            elapsed = time.monotonic() - started
            stop.set()
            thread.join()
            run = client.get(f"/v1/runs/{run_id}").json()
            steps = client.get(f"/v1/runs/{run_id}/steps").json()[1:]
    finally:
        watch.stop()
        cluster.stop()
        stack.stop()
    hit = preemptions(watch.events, serving_model(EMU_MODEL).gpus)
    preempted = sum(s.get("preempted_responses", 0) for s in steps)
    wasted = sum(s["tokens_regenerated"] for s in steps)
    return {
        "mode": mode, "state": run["state"], "preemptions": result[0] if result else 0,
        "preempted_responses": preempted, "tokens_regenerated": wasted,
        "per_response": wasted / preempted if preempted else 0.0,
        "step_s": statistics.fmean(s["step_s"] for s in steps), "elapsed_s": elapsed,
        "migrations": sum(s["migrations"] for s in steps),
        "kinds": {name: per_kind([p for p in hit if p.signal == name]) for name in SIGNALS},
    }


def per_kind(hit: list[Preemption]) -> dict[str, float]:
    """Totals over one kind's preemptions (divided by ``count`` when printed)."""
    moved = [m for p in hit for m in p.moved]
    return {"count": len(hit), "with_work": sum(1 for p in hit if p.moved), "moved": len(moved),
            "relet": sum(p.relet for p in hit),
            "hand_on_s": statistics.fmean(m.hand_on_s for m in moved) if moved else 0.0,
            "regenerated": sum(m.regenerated for m in moved),
            "reprefill": sum(m.reprefill for m in moved),
            "idle_gpu_s": sum(p.idle_gpu_s() for p in hit),
            "lost_gpu_s": sum(p.lost_gpu_s() for p in hit)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=3.0, help="seconds between preemptions")
    parser.add_argument("--chunk-tokens", type=int, default=CHUNK_TOKENS,
                        help="flush interval (tokens per response per frame) of the instances")
    args = parser.parse_args(argv)
    exit_on_sigterm()
    started = time.monotonic()
    print(provenance(argv if argv is not None else sys.argv[1:]), flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlboost-bench-") as tmp:
        for mode in ("token", "request"):
            print(f"running {mode}-level ...", flush=True)
            rows.append(run_mode(mode, Path(tmp) / mode, args.every, args.chunk_tokens))
    print("\nEMULATION (emu engine, modelled H100 time; real control plane)")
    print(f"{'mode':<8} {'preempt':>7} {'responses hit':>13} {'tokens regen':>12} "
          f"{'regen/response':>14} {'migrations':>10} {'step s':>7}")
    for r in rows:
        print(f"{r['mode']:<8} {r['preemptions']:>7} {r['preempted_responses']:>13} "
              f"{r['tokens_regenerated']:>12} {r['per_response']:>14.2f} {r['migrations']:>10} "
              f"{r['step_s']:>7.2f}")
    token, request = rows
    if token["per_response"] > 0:
        print(f"request/token regenerated tokens per preempted response: "
              f"{request['per_response'] / token['per_response']:.1f}x")
    print(f"request/token step time: {request['step_s'] / token['step_s']:.2f}x")
    print_per_preemption(rows)
    chunk = args.chunk_tokens
    ok = token["per_response"] <= chunk and all(r["state"] == "succeeded" for r in rows)
    print(f"token-level waste <= one chunk ({chunk} tokens) per preempted response: "
          f"{'yes' if ok else 'NO'}")
    print(f"{time.monotonic() - started:.0f} s in all")
    return 0 if ok else 1


def print_per_preemption(rows: list[dict[str, Any]]) -> None:
    """Per preemption, notices and hard kills apart, from the bus (benchmarks.preempt_watch):
    each row's totals over that kind's preemptions, divided by their count."""
    print("\nper preemption, from the manager's assignments and the instances' frames and "
          "heartbeats on the bus (moved, relet: responses per preemption; hand-on s: mean per "
          "moved response; lost GPU-s: idle + thrown; benchmarks/preempt_watch.py defines each)")
    print(f"{'mode':<8} {'signal':<8} {'preempt':>7} {'with work':>9} {'moved':>6} {'relet':>5} "
          f"{'hand-on s':>9} {'regen tok':>9} {'re-prefill tok':>14} {'lost GPU-s':>10} "
          f"{'(idle + thrown)':>17}")
    for r in rows:
        for name, k in r["kinds"].items():
            n = max(k["count"], 1)
            idle, lost = k["idle_gpu_s"] / n, k["lost_gpu_s"] / n
            print(f"{r['mode']:<8} {name:<8} {k['count']:>7} {k['with_work']:>9} "
                  f"{k['moved'] / n:>6.1f} {k['relet'] / n:>5.1f} {k['hand_on_s']:>9.2f} "
                  f"{k['regenerated'] / n:>9.1f} "
                  f"{k['reprefill'] / n:>14.1f} {lost:>10.3f} "
                  f"{f'({idle:.3f} + {lost - idle:.3f})':>17}")
    token, request = (r["kinds"] for r in rows)
    for name in SIGNALS:
        ratios = ", ".join(f"{label} {ratio(request[name], token[name], key)}" for key, label in (
            ("regenerated", "regenerated tokens"), ("reprefill", "re-prefill tokens"),
            ("lost_gpu_s", "lost GPU-s")))
        print(f"request/token per preemption, {name}: {ratios}")
    # The bus misses what a victim generated after its last frame and heartbeat (under one
    # flush a response); the manager adds what its last heartbeat called buffered, though a
    # frame may have committed it since.
    print("tokens regenerated, from the bus (at least) / the manager's step counters: " +
          ", ".join(f"{r['mode']} {sum(k['regenerated'] for k in r['kinds'].values())} / "
                    f"{r['tokens_regenerated']}" for r in rows))


def ratio(request: dict[str, float], token: dict[str, float], key: str) -> str:
    if not request["count"] or not token["count"]:
        return "n/a (no such preemption)"
    per_request, per_token = request[key] / request["count"], token[key] / token["count"]
    return f"{per_request / per_token:.2f}x" if per_token > 0 else f"{per_request:.3g} vs 0"


def provenance(args: list[str]) -> str:
    """The commit (``-dirty`` with changes) and command the printed figures come from."""
    return provenance_of("benchmarks.preempt", args)


if __name__ == "__main__":
    raise SystemExit(main())
