"""``make bench-async``: bounded staleness 0, 1, 2: trained tokens/s under spot churn, and reward.

Part A, throughput (EMULATION of GPU time, as ``make bench-paper``): real manager, weight
service, trainer, NATS and Redis; rollout instances run the ``emu`` engine (``emu-8b``
serving costs, its lognormal response lengths: mean a quarter of ``max_new_tokens``, sigma 1,
a few percent cut at the budget, the stragglers asynchrony can overlap); the trainer waits the
modelled training and publish time. Reserved GPUs in one process beside spot instances that are
real processes started and noticed by a shipped trace segment (time-compressed), the same
segment and victim seed for every run. The same run spec runs at ``staleness`` 0, 1 and 2 in
this one invocation, each on a fresh cluster (``make bench-paper``'s policy (b): adaptive
seeding, token-level migration). Printed per staleness: trained tokens/s, from the run's step
records: the tokens of the steps that finished inside the measured window (step 0, start-up,
left out) over emulated seconds from step 0's end to the last of them's end; and its ratio to
staleness 0's.

Part B, learning (real models, no emulation): tiny-chat on the shipped word problems
(``examples/tiny-chat-math.json``'s spec without its eval, torch engine, a reserved and a spot
instance, one cluster for every run) for each seed: staleness 0; staleness 1 and 2 each with
``off_policy`` none and tis (``--configs`` adds decoupled: ``"k1 decoupled"``, ``"k2
decoupled"``). Printed per configuration and seed: the mean reward of
the first five and the last five steps and the run's wall time; then per configuration their
means over seeds.

``--parts a`` or ``--parts b`` runs one part alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgspec

from benchmarks import paper
from benchmarks.algorithms import WINDOW, run_one, torch_cluster
from rollout_svc.engines.emu_models import serving_model
from shared.process import exit_on_sigterm

ROOT = Path(__file__).resolve().parents[1]
STALENESS = [0, 1, 2]
# Part B's configurations: (name, staleness, off_policy).
CONFIGS: list[tuple[str, int, str]] = [
    ("k0", 0, "none"),
    ("k1 none", 1, "none"), ("k1 tis", 1, "tis"), ("k1 decoupled", 1, "decoupled"),
    ("k2 none", 2, "none"), ("k2 tis", 2, "tis"), ("k2 decoupled", 2, "decoupled"),
]
# What fits ~35 minutes on two shared cores at 15 steps (each seed's tiny-chat is built once).
DEFAULT_CONFIGS = [c[0] for c in CONFIGS if c[2] != "decoupled"]


@dataclass(frozen=True)
class Throughput:
    staleness: int
    steps: int
    tokens: int
    span_s: float  # emulated seconds, step 0's end to the last measured step's end
    trainer_idle_pct: float
    spot_mean: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.span_s


def measure(k: int, records: list[dict[str, Any]], setup: paper.Setup,
            deadline: float) -> Throughput:
    scale = setup.time_scale
    first = next(r for r in records if r["step"] == 0)
    steps = sorted((r for r in records if r["step"] >= 1 and r["finished_at"] <= deadline),
                   key=lambda r: r["step"])
    if not steps:
        raise RuntimeError(f"staleness {k}: no step finished inside the measured window")
    span = (steps[-1]["finished_at"] - first["finished_at"]) / scale
    busy = sum(float(s["step_s"]) for s in steps)
    idle = sum(float(s.get("trainer_idle_s", 0.0)) for s in steps)
    reserved = setup.reserved_gpus // serving_model(setup.model).gpus  # instances, never lost
    spot = statistics.fmean(float(s.get("instances", 0)) for s in steps) - reserved
    return Throughput(k, len(steps), sum(int(s["tokens"]) for s in steps), span,
                      100 * idle / busy if busy else 0.0, spot)


def part_a(args: argparse.Namespace) -> list[Throughput]:
    setup, policies, title = paper.configure(argparse.Namespace(**vars(args), policies="b"))
    policy = policies[0]
    print(title, flush=True)
    print(f"workload: {args.prompts} prompts x {args.samples} samples, max_new_tokens "
          f"{args.max_new_tokens}; policy {policy.name}; window {args.window:g} emulated s at "
          f"{args.time_scale:g} wall s each", flush=True)
    rows = []
    for k in STALENESS:
        spec = msgspec.structs.replace(setup.spec, staleness=k)
        with tempfile.TemporaryDirectory(prefix="rlboost-async-") as tmp:
            started = time.monotonic()
            records, _, _, deadline = paper.run_emulated(policy, replace(setup, spec=spec),
                                                         Path(tmp))
            rows.append(measure(k, records, setup, deadline))
            print(f"  staleness {k}: {rows[-1].steps} steps measured "
                  f"({time.monotonic() - started:.0f}s wall)", flush=True)
    return rows


def print_a(rows: list[Throughput]) -> None:
    base = rows[0].tokens_per_s
    print("\nEMULATION: trained tokens/s (step records: tokens of the measured steps over "
          "emulated s from step 0's end)")
    print(f"{'staleness':>9} {'steps':>5} {'tokens':>9} {'span s':>7} {'tokens/s':>9} "
          f"{'vs k=0':>7} {'trainer idle %':>14} {'spot':>5}")
    for r in rows:
        print(f"{r.staleness:>9} {r.steps:>5} {r.tokens:>9,} {r.span_s:>7.1f} "
              f"{r.tokens_per_s:>9,.0f} {r.tokens_per_s / base:>6.2f}x "
              f"{r.trainer_idle_pct:>14.0f} {r.spot_mean:>5.1f}")


@dataclass(frozen=True)
class Learning:
    config: str
    seed: int
    first: float
    last: float
    wall_s: float


def spec_for(seed: int, k: int, off_policy: str, steps: int) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads((ROOT / "examples" / "tiny-chat-math.json").read_text())
    spec.pop("eval")  # held-out evaluation is not what this measures
    spec["dataset"]["path"] = str(ROOT / spec["dataset"]["path"])
    spec.update(steps=steps, seed=seed, staleness=k, off_policy=off_policy)
    return spec


def part_b(args: argparse.Namespace) -> list[Learning]:
    configs = [c for c in CONFIGS if c[0] in args.configs]
    rows = []
    with torch_cluster("rlboost-async-chat-") as (_, client):
        for seed in args.seeds:
            for name, k, off_policy in configs:
                print(f"running {name}, seed {seed} ...", flush=True)
                started = time.monotonic()
                steps = run_one(client, spec_for(seed, k, off_policy, args.steps),
                                args.timeout)
                wall = time.monotonic() - started
                rewards = [float(s["reward_mean"]) for s in steps]
                rows.append(Learning(name, seed, statistics.fmean(rewards[:WINDOW]),
                                     statistics.fmean(rewards[-WINDOW:]), wall))
                print(f"  first-{WINDOW} {rows[-1].first:.3f} -> last-{WINDOW} "
                      f"{rows[-1].last:.3f} ({wall:.0f}s)", flush=True)
    return rows


def print_b(rows: list[Learning], args: argparse.Namespace) -> None:
    spec = spec_for(0, 0, "none", args.steps)
    print(f"\ntiny-chat on the word problems, {args.steps} steps of {spec['prompts_per_step']} x "
          f"{spec['samples_per_prompt']}, learning rate {spec['learning_rate']:g}, seeds "
          f"{' '.join(map(str, args.seeds))}")
    print(f"{'config':<13} {'seed':>4} {'first-5':>7} {'last-5':>7} {'gain':>7} {'wall s':>7}")
    for r in rows:
        print(f"{r.config:<13} {r.seed:>4} {r.first:>7.3f} {r.last:>7.3f} "
              f"{r.last - r.first:>+7.3f} {r.wall_s:>7.0f}")
    print(f"\nmean over seeds\n{'config':<13} {'seeds':>5} {'first-5':>7} {'last-5':>7} "
          f"{'gain':>7} {'gain sd':>7} {'wall s':>7}")
    for name, _, _ in CONFIGS:
        mine = [r for r in rows if r.config == name]
        if not mine:
            continue
        gains = [r.last - r.first for r in mine]
        sd = statistics.stdev(gains) if len(gains) > 1 else 0.0
        print(f"{name:<13} {len(mine):>5} {statistics.fmean(r.first for r in mine):>7.3f} "
              f"{statistics.fmean(r.last for r in mine):>7.3f} {statistics.fmean(gains):>+7.3f} "
              f"{sd:>7.3f} {statistics.fmean(r.wall_s for r in mine):>7.0f}")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="a,b", help="comma-separated: a, b or a,b")
    a = parser.add_argument_group("part A, throughput (emu; as make bench-paper's flags)")
    a.add_argument("--model", default="emu-8b", choices=["emu-8b", "emu-14b", "emu-32b"])
    a.add_argument("--trace", default="p3", choices=["p3", "g4dn", "gcp"])
    a.add_argument("--segment-start", type=float, default=2700.0, help="trace seconds")
    a.add_argument("--segment", type=float, default=1800.0, help="trace seconds")
    a.add_argument("--compress", type=float, default=30.0,
                   help="trace seconds per emulated second")
    a.add_argument("--count-scale", type=float, default=0.35, help="spot instances per node")
    a.add_argument("--reserved-gpus", type=int, default=8)
    a.add_argument("--time-scale", type=float, default=2.0,
                   help="wall seconds per emulated second")
    a.add_argument("--window", type=float, default=60.0, help="emulated seconds measured")
    a.add_argument("--removal", default="notice", choices=["notice", "kill"])
    a.add_argument("--prompts", type=int, default=64)
    a.add_argument("--samples", type=int, default=16)
    a.add_argument("--max-new-tokens", type=int, default=256)
    a.add_argument("--seed", type=int, default=0, help="run seed and trace victim seed")
    b = parser.add_argument_group("part B, learning (tiny-chat, torch)")
    b.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    b.add_argument("--steps", type=int, default=15)
    b.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS,
                   choices=[c[0] for c in CONFIGS])
    b.add_argument("--timeout", type=float, default=1800.0, help="per run, seconds")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    exit_on_sigterm()
    parts = set(args.parts.split(","))
    started = time.monotonic()
    throughput = part_a(args) if "a" in parts else []
    learning = part_b(args) if "b" in parts else []
    if throughput:
        print_a(throughput)
    if learning:
        print_b(learning, args)
    print(f"\n{time.monotonic() - started:.0f}s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
