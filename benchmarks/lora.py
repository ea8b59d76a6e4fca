"""``make bench-lora``: LoRA runs of tiny-chat through REST learn, and what their versions weigh.

Real services on one machine (manager, weight service, trainer, a reserved and a spot rollout
instance with the torch engine, real NATS and Redis), tiny-chat on the shipped word problems
(``examples/tiny-chat-math.json``'s spec without its eval) with ``lora`` set, one run per seed.
Printed per seed: the mean reward of the first five and the last five steps. Then, from the
weight service's manifest of the last run's final version, the bytes of the adapter files
against those of the merged model's weights. It passes when every seed's last-5 mean exceeds
its first-5 mean.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.algorithms import WINDOW, run_one, torch_cluster
from shared.process import exit_on_sigterm
from shared.weights.manifest import ADAPTER_SUFFIX

ROOT = Path(__file__).resolve().parents[1]


def spec_for(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads((ROOT / "examples" / "tiny-chat-math.json").read_text())
    spec.pop("eval")  # held-out evaluation is not what this measures
    spec["dataset"]["path"] = str(ROOT / spec["dataset"]["path"])
    spec.update(steps=args.steps, seed=seed, learning_rate=args.lr,
                lora={"rank": args.rank, "alpha": 2.0 * args.rank})
    return spec


def version_bytes(weights_url: str, run_id: str, version: int) -> tuple[int, int]:
    """(adapter files, model weights) bytes of one published version, from its manifest."""
    resp = httpx.get(f"{weights_url}/v1/weights/{run_id}/{version}/manifest", timeout=30)
    resp.raise_for_status()
    files = resp.json()["files"]
    adapter = sum(f["size"] for f in files if f["name"].endswith(ADAPTER_SUFFIX))
    model = sum(f["size"] for f in files if f["name"].endswith(".safetensors"))
    return adapter, model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3,
                        help="LoRA's usual ~10x the full fine-tuning rate (2e-4 here)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="per run, seconds")
    args = parser.parse_args(argv)
    exit_on_sigterm()
    rows: list[tuple[int, float, float, float]] = []
    sizes = (0, 0)
    with torch_cluster("rlboost-lora-") as (cluster, client):
        for seed in args.seeds:
            print(f"running seed {seed} ...", flush=True)
            started = time.monotonic()
            steps = run_one(client, spec_for(seed, args), args.timeout)
            wall = time.monotonic() - started
            rewards = [float(s["reward_mean"]) for s in steps]
            first = statistics.fmean(rewards[:WINDOW])
            last = statistics.fmean(rewards[-WINDOW:])
            rows.append((seed, first, last, wall))
            print(f"  first-{WINDOW} {first:.3f} -> last-{WINDOW} {last:.3f}", flush=True)
        run_id = client.get("/v1/runs").json()[0]["id"]
        sizes = version_bytes(cluster.env["RLBOOST_WEIGHTS_URL"], run_id, args.steps)
    print(f"\ntiny-chat on the word problems, LoRA rank {args.rank} alpha {2 * args.rank} on "
          f"q/k/v/o/gate/up/down, {args.steps} steps of 16 x 8, learning rate {args.lr:g}")
    print(f"{'seed':>4} {'first-5':>7} {'last-5':>7} {'gain':>7} {'wall s':>7}")
    for seed, first, last, wall in rows:
        print(f"{seed:>4} {first:>7.3f} {last:>7.3f} {last - first:>+7.3f} {wall:>7.0f}")
    adapter, model = sizes
    print(f"version {args.steps}: adapter files {adapter} B, merged model weights {model} B "
          f"({100 * adapter / model:.1f} %)")
    ok = all(last > first for _, first, last, _ in rows)
    print(f"reward rose for every seed: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
