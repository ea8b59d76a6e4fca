"""``make bench-algorithms``: every algorithm end to end through REST on the embedded task.

Real services on one machine (manager, weight service, trainer, a reserved and a spot rollout
instance with the torch engine, real NATS and Redis), the embedded ``tiny`` model on the
arith-seq task. One run per algorithm, each with its paper defaults (scaled to the run: see
``shared.algorithm``) and the same seed, spec and cluster. Printed per algorithm: the mean reward
of the first five and the last five steps, their difference, the mean of the training
statistics the step records carry, and the run's wall time. An algorithm passes when its
last-5 mean exceeds its first-5 mean.

The row ``dapo+dynamic_sampling`` is DAPO with its group filter on: each step trains on the
``prompts`` informative groups only, so its reward is over those (all-equal groups, all right or
all wrong, are left out), and it prints the prompts generated per step and the tokens
generated but never trained on (``tokens_discarded``) per step.

The default learning rate (``RunSpec.learning_rate``) was tuned for one AdamW step per RL
step. DAPO and GSPO default to several mini-batches, hence several AdamW steps per RL step, each
about ``lr`` long whatever the gradient's size; ``--scale-lr`` divides the rate by the optimizer
steps per RL step so each RL step moves the weights about as far as GRPO's one.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from rlboost.launcher import Cluster
from shared.algorithm import Algorithm
from shared.process import exit_on_sigterm
from shared.spec import RunSpec

WINDOW = 5  # steps averaged at each end
# Rows beyond the algorithms' own: a name and the knobs it adds to the spec.
VARIANTS: dict[str, dict[str, Any]] = {"dapo+dynamic_sampling": {"algorithm": "dapo",
                                                                 "dynamic_sampling": True}}
ROWS = [a.value for a in Algorithm] + list(VARIANTS)


@contextmanager
def torch_cluster(prefix: str) -> Iterator[tuple[Cluster, httpx.Client]]:
    """The services with a reserved and a spot torch instance in a temporary directory, and a
    client of the manager; every process stopped on the way out."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        cluster = Cluster(Path(tmp), spot=1, reserved=1, engine="torch")
        try:
            cluster.start()
            with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], timeout=30) as client:
                yield cluster, client
        finally:
            cluster.stop()


def run_one(client: httpx.Client, spec: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
    resp = client.post("/v1/runs", json=spec)
    resp.raise_for_status()
    run_id = resp.json()["id"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = client.get(f"/v1/runs/{run_id}").json()
        if run["state"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(0.5)
    else:
        client.post(f"/v1/runs/{run_id}/cancel")
        raise RuntimeError(f"run {run_id} did not finish within {timeout_s:.0f} s")
    if run["state"] != "succeeded":
        raise RuntimeError(f"run {run_id} {run['state']}: {run.get('error')}")
    steps: list[dict[str, Any]] = client.get(f"/v1/runs/{run_id}/steps").json()
    return steps


def mean_of(steps: list[dict[str, Any]], name: str) -> float | None:
    values = [float(s[name]) for s in steps if name in s]
    return statistics.fmean(values) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", nargs="+", default=ROWS, choices=ROWS)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600.0, help="per run, seconds")
    parser.add_argument("--scale-lr", action=argparse.BooleanOptionalAction, default=True,
                        help="divide the learning rate by the optimizer steps per RL step")
    args = parser.parse_args(argv)
    exit_on_sigterm()
    rows: list[tuple[str, float, float, dict[str, float | None], float]] = []
    with torch_cluster("rlboost-algorithms-") as (_, client):
        for algorithm in args.algorithms:
            spec: dict[str, Any] = {
                "model": "tiny", "algorithm": algorithm, "steps": args.steps,
                "prompts_per_step": args.prompts, "samples_per_prompt": args.samples,
                "seed": args.seed, **VARIANTS.get(algorithm, {})}
            if args.scale_lr:
                cfg = RunSpec(**spec).algorithm_config()
                spec["learning_rate"] = RunSpec().learning_rate / (
                    cfg.updates_per_step * cfg.minibatches)
            print(f"running {algorithm} ...", flush=True)
            started = time.monotonic()
            steps = run_one(client, spec, args.timeout)
            wall = time.monotonic() - started
            rewards = [float(s["reward_mean"]) for s in steps]
            first = statistics.fmean(rewards[:WINDOW])
            last = statistics.fmean(rewards[-WINDOW:])
            extra = {n: mean_of(steps, n) for n in (
                "clip_fraction", "entropy", "grad_norm", "streamed_fraction",
                "optimizer_steps", "prompts_generated", "tokens_discarded")}
            rows.append((algorithm, first, last, extra, wall))
            print(f"  first-{WINDOW} {first:.3f} -> last-{WINDOW} {last:.3f}", flush=True)
    print(f"\nembedded task (tiny model, arith-seq), {args.steps} steps of {args.prompts} x "
          f"{args.samples}, seed {args.seed}, paper defaults scaled to the run"
          + (", learning rate / optimizer steps per RL step" if args.scale_lr else ""))
    print(f"{'algorithm':<22} {'first-5':>7} {'last-5':>7} {'gain':>7} {'clip':>6} "
          f"{'entropy':>7} {'streamed':>8} {'opt/step':>8} {'prompts':>7} {'discard':>7} "
          f"{'wall s':>7}")

    def fmt(v: float | None, width: int, digits: int) -> str:
        return f"{v:>{width}.{digits}f}" if v is not None else f"{'-':>{width}}"

    for algorithm, first, last, extra, wall in rows:
        print(f"{algorithm:<22} {first:>7.3f} {last:>7.3f} {last - first:>+7.3f} "
              f"{fmt(extra['clip_fraction'], 6, 3)} {fmt(extra['entropy'], 7, 3)} "
              f"{fmt(extra['streamed_fraction'], 8, 3)} {fmt(extra['optimizer_steps'], 8, 1)} "
              f"{fmt(extra['prompts_generated'], 7, 1)} {fmt(extra['tokens_discarded'], 7, 0)} "
              f"{wall:>7.0f}")
    ok = all(last > first for _, first, last, _, _ in rows)
    print(f"reward rose for every algorithm: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
