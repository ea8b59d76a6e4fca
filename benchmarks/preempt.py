"""``make bench-preempt``: token-level migration vs request-level restart, one schedule, one run.

EMULATION: rollout instances run the ``emu`` engine (modelled H100 decode time) and the trainer
an emulated 8B compute model; the manager, NATS, Redis, leases and weight transfer are real.

Both modes get the same workload (seed, prompts, long-tailed lengths) and the same preemption
schedule: every ``--every`` seconds the next spot instance in a fixed rotation gets a notice
(SIGTERM) or dies (SIGKILL), alternately, and a fresh spot instance joins in its place. With
token-level migration a preempted response continues elsewhere from its last committed token;
with request-level restart (``RLBOOST_MIGRATION=request``) it starts over. Printed: tokens
regenerated per preempted response, and step time, for both, and their ratios.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from rlboost.launcher import Cluster
from rlboost.stack import Stack
from shared.process import exit_on_sigterm

SPEC = {"model": "emu", "steps": 6, "prompts_per_step": 16, "samples_per_prompt": 4,
        "max_new_tokens": 512, "seed": 3}
CHUNK_TOKENS = 4  # the flush interval by default (RLBOOST_CHUNK_TOKENS); --chunk-tokens
SPOT = 4
ENV = {"RLBOOST_EMU_TIME_SCALE": "1.0", "RLBOOST_LEASE_TTL_S": "1.5",
       "RLBOOST_INSTANCE_TTL_S": "1.5", "RLBOOST_HEARTBEAT_S": "0.25",
       "RLBOOST_GRACE_S": "5",
       "RLBOOST_REBALANCE_SKEW": "0"}


def preempt_loop(cluster: Cluster, every_s: float, stop: threading.Event) -> int:
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
        victim.signal(signal.SIGTERM if count % 2 == 0 else signal.SIGKILL)
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
    try:
        cluster.start()
        url = cluster.env["RLBOOST_MANAGER_URL"]
        with httpx.Client(base_url=url, timeout=10) as client:
            run_id = client.post("/v1/runs", json=SPEC).json()["id"]
            while client.get(f"/v1/runs/{run_id}").json()["step"] < 1:
                time.sleep(0.2)  # preempt from step 1: step 0 includes start-up
            stop = threading.Event()
            result: list[int] = []
            thread = threading.Thread(
                target=lambda: result.append(preempt_loop(cluster, every_s, stop)))
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
        cluster.stop()
        stack.stop()
    preempted = sum(s.get("preempted_responses", 0) for s in steps)
    wasted = sum(s["tokens_regenerated"] for s in steps)
    return {
        "mode": mode, "state": run["state"], "preemptions": result[0] if result else 0,
        "preempted_responses": preempted, "tokens_regenerated": wasted,
        "per_response": wasted / preempted if preempted else 0.0,
        "step_s": statistics.fmean(s["step_s"] for s in steps), "elapsed_s": elapsed,
        "migrations": sum(s["migrations"] for s in steps),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=3.0, help="seconds between preemptions")
    parser.add_argument("--chunk-tokens", type=int, default=CHUNK_TOKENS,
                        help="flush interval (tokens per response per frame) of the instances")
    args = parser.parse_args(argv)
    exit_on_sigterm()
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
    chunk = args.chunk_tokens
    ok = token["per_response"] <= chunk and all(r["state"] == "succeeded" for r in rows)
    print(f"token-level waste <= one chunk ({chunk} tokens) per preempted response: "
          f"{'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
