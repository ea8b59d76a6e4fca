"""``make bench-paper``: the paper's headline on one machine, policy by policy.

EMULATION of GPU time on the real control plane. Rollout instances run the ``emu`` engine
(decode/prefill/load times of the chosen model class on H100s,
``rollout_svc.engines.emu_models``); the trainer waits the modelled training time
(``trainer_svc.learn.compute_model.PRESETS``). The manager, weight service, NATS JetStream,
Redis, leases, migration and weight pulls are the real system, and spot instances are real
processes started and preempted by a real availability trace.

Every policy runs the same workload on a fresh cluster. Spot policies replay the same trace
segment from the start of step 1 (step 0, which includes start-up, is not measured); a policy
is measured over a fixed span of emulated time, on the steps that finished inside it.

* (a) reserved-only, co-located: the reserved GPUs generate the whole step, then train on it
  (veRL's default placement).
* (b) rlboost: reserved + trace-driven spot, adaptive seeding, token-level migration,
  pull-based weights (instances join mid-step).
* (c) ablations of (b): seeding off; request-level restart instead of token-level migration;
  weights only at step boundaries (a joiner waits for the next step).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec

from benchmarks import paper_report, provenance
from benchmarks.trace import Trace, TracePlayer, load
from rlboost.launcher import Cluster
from rlboost.stack import Stack
from rollout_svc.engines.emu_models import serving_model
from shared.hardware import ENGINE_START_S, SPOT_BOOT_S, publish_seconds
from shared.process import exit_on_sigterm
from shared.spec import RunSpec, SeedingSpec
from sim.outcome import Outcome
from trainer_svc.learn.policies import PRESETS

# Engine/manager settings shared by every policy. Chunks of 32 tokens keep the control plane's
# message rate within what two shared cores ingest; a notice flushes them, so nothing is lost.
ENV = {"RLBOOST_CHUNK_TOKENS": "32", "RLBOOST_MAX_BATCH": "64", "RLBOOST_GRACE_S": "10",
       "RLBOOST_HEARTBEAT_S": "0.5", "RLBOOST_REBALANCE_SKEW": "8"}


@dataclass(frozen=True)
class Policy:
    name: str
    spot: bool
    seeding: SeedingSpec
    env: dict[str, str] = field(default_factory=dict)


ADAPTIVE = SeedingSpec(mode="adaptive")
OFF = SeedingSpec(mode="off")
POLICIES = [
    Policy("(a) reserved-only", spot=False, seeding=OFF),
    Policy("(b) rlboost", spot=True, seeding=ADAPTIVE),
    Policy("(c1) seeding off", spot=True, seeding=OFF),
    Policy("(c2) request-level restart", spot=True, seeding=ADAPTIVE,
           env={"RLBOOST_MIGRATION": "request"}),
    Policy("(c3) no mid-step join", spot=True, seeding=ADAPTIVE,
           env={"RLBOOST_MIDSTEP_JOIN": "off"}),
]


@dataclass(frozen=True)
class Setup:
    model: str
    trace: Trace  # compressed: emulated seconds, instance counts
    reserved_gpus: int
    time_scale: float  # wall seconds per emulated second
    window_s: float  # emulated seconds measured per policy
    spec: RunSpec
    removal: str
    seed: int
    publish_s: float = 0.0  # emulated: the trainer's publish of a version
    start_s: float = 0.0  # emulated: a spot instance's boot + engine start
    steps: int = 0  # > 0: the window also ends once this many steps after step 0 finished

    @property
    def grace_s(self) -> float:
        """The grace period in emulated seconds (RLBOOST_GRACE_S is wall time)."""
        return float(ENV["RLBOOST_GRACE_S"]) / self.time_scale


def run_policy(policy: Policy, setup: Setup, root: Path) -> Outcome:
    records, player, begin, deadline = run_emulated(policy, setup, root)
    return outcome(policy, setup, records, player, serving_model(setup.model).gpus, begin,
                   deadline)


def run_emulated(policy: Policy, setup: Setup, root: Path
                 ) -> tuple[list[dict[str, Any]], TracePlayer, float, float]:
    """One policy's run on a fresh cluster: every step record (step 0 included), the trace
    player, and the measured window's wall start and end."""
    serving = serving_model(setup.model)
    stack = Stack.create(root / "brokers")
    stack.start()
    env = {**stack.env(), **ENV, **policy.env, "RLBOOST_DATA_DIR": str(root / "data"),
           "RLBOOST_EMU_MODEL": setup.model, "RLBOOST_EMU_TIME_SCALE": str(setup.time_scale),
           "RLBOOST_EMU_PUBLISH_S": str(setup.publish_s), "RLBOOST_EMU_START_S": str(setup.start_s)}
    cluster = Cluster(root, spot=0, reserved=0, engine="emu", base_env=env)
    player = TracePlayer(setup.trace, lambda name: cluster.add_instance("spot", name),
                         wall_per_s=setup.time_scale, removal=setup.removal,  # type: ignore[arg-type]
                         seed=setup.seed)
    try:
        cluster.start()
        # The reserved GPUs, packed in one process: they are never preempted.
        cluster.add_instance("reserved", "reserved", {
            "RLBOOST_EMU_INSTANCES": str(setup.reserved_gpus // serving.gpus)})
        with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], timeout=30) as client:
            if policy.spot:
                player.set_count(setup.trace.counts[0])  # warm-up for step 0
                # Up before step 0, as the simulator has them (Cluster.spot_join_at_start):
                # eleven spot processes starting on two cores registered ~7 s into step 0,
                # after its window, so the warm-up the controller learns from differed.
                wait_spot(client, setup.trace.counts[0], cluster)
            spec = msgspec.structs.replace(setup.spec, seeding=policy.seeding)
            run_id = client.post("/v1/runs", json=msgspec.to_builtins(spec)).json()["id"]
            wait_step(client, run_id, 1, cluster)
            begin = time.time()  # before the player's first change, so the plot has it
            if policy.spot:
                player.start()
            deadline = begin + setup.window_s * setup.time_scale
            while time.time() < deadline:
                time.sleep(0.5)
                run = client.get(f"/v1/runs/{run_id}").json()
                if run["state"] != "running":
                    raise RuntimeError(f"{policy.name}: run stopped early\n{cluster_tail(cluster)}")
                if setup.steps and run["step"] > setup.steps:  # steps 1 .. steps are done
                    deadline = time.time()
            player.stop()
            client.post(f"/v1/runs/{run_id}/cancel")
            records = client.get(f"/v1/runs/{run_id}/steps").json()
    finally:
        player.stop()
        cluster.stop()
        stack.stop()
    return records, player, begin, deadline


# The step record's durations (manager_svc/trainer_api.py), measured in wall seconds.
DURATIONS = ("step_s", "rollout_s", "train_s", "trainer_idle_s", "rollout_idle_s",
             "seeding_window_s")


def outcome(policy: Policy, setup: Setup, records: list[dict[str, Any]], player: TracePlayer,
            gpus: int, begin: float, deadline: float) -> Outcome:
    scale = setup.time_scale
    steps = [dict(r) for r in records if r["step"] >= 1 and r["finished_at"] <= deadline]
    if not steps:
        raise RuntimeError(f"{policy.name}: no step finished inside the measured window")
    start, end = steps[0]["started_at"], steps[-1]["finished_at"]
    for s in steps:  # every duration in emulated seconds; times from the window's start
        s["started_at_emu"] = (s["started_at"] - start) / scale
        s["finished_at_emu"] = (s["finished_at"] - start) / scale
        for key in DURATIONS:
            if key in s:
                s[key] = s[key] / scale
    window = (end - start) / scale
    # Billed through the grace period: a noticed instance is the cloud's until it stops.
    spot_gpu_s = player.gpu_seconds(start, end, gpus, setup.grace_s * scale) / scale \
        if policy.spot else 0.0
    history = [((t - start) / scale, c) for t, c in player.history if t >= begin]
    return Outcome(policy.name, steps, window, setup.reserved_gpus * window, spot_gpu_s, history)


def wait_step(client: httpx.Client, run_id: str, step: int, cluster: Cluster) -> None:
    end = time.monotonic() + 600
    while time.monotonic() < end:
        run = client.get(f"/v1/runs/{run_id}").json()
        if run["state"] not in ("queued", "running") and run["step"] < step:
            raise RuntimeError(f"run {run_id} {run['state']}: {run.get('error')}")
        if run["step"] >= step:
            return
        time.sleep(0.2)
    raise RuntimeError(f"run {run_id} did not reach step {step}\n{cluster_tail(cluster)}")


def wait_spot(client: httpx.Client, count: int, cluster: Cluster) -> None:
    """Until ``count`` spot instances are registered with the manager."""
    end = time.monotonic() + 300
    while time.monotonic() < end:
        rows = client.get("/v1/instances").json()
        if sum(1 for i in rows if i["kind"] == "spot") >= count:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{count} spot instances did not register\n{cluster_tail(cluster)}")


def cluster_tail(cluster: Cluster) -> str:
    return "\n".join(f"--- {c.name}\n{c.tail(8)}" for c in cluster.children[:3])


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="emu-8b", choices=["emu-8b", "emu-14b", "emu-32b"])
    parser.add_argument("--trace", default="p3", choices=["p3", "g4dn", "gcp"])
    parser.add_argument("--segment-start", type=float, default=2700.0, help="trace seconds")
    parser.add_argument("--segment", type=float, default=1800.0, help="trace seconds")
    parser.add_argument("--compress", type=float, default=30.0,
                        help="trace seconds per emulated second")
    parser.add_argument("--count-scale", type=float, default=0.35,
                        help="spot instances per trace node")
    parser.add_argument("--reserved-gpus", type=int, default=8)
    parser.add_argument("--time-scale", type=float, default=2.0,
                        help="wall seconds per emulated second")
    parser.add_argument("--window", type=float, default=50.0, help="emulated seconds measured")
    parser.add_argument("--removal", default="notice", choices=["notice", "kill"])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--policies", default="all", help="comma-separated letters, e.g. a,b")
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--seed", type=int, default=0)
    return parser


def configure(args: argparse.Namespace) -> tuple[Setup, list[Policy], str]:
    """The setup, the chosen policies and the title the arguments ask for.

    The trainer's publish is charged in full (shared.hardware.publish_seconds of the bf16
    weights); a spot instance's boot + engine start is compressed with the trace, like the
    churn it comes with."""
    trace = load(args.trace).segment(args.segment_start, args.segment)
    weights = 2 * serving_model(args.model).params
    setup = Setup(args.model, trace.compressed(args.compress, args.count_scale),
                  args.reserved_gpus, args.time_scale, args.window,
                  RunSpec(model=args.model, steps=100_000, prompts_per_step=args.prompts,
                          samples_per_prompt=args.samples, max_new_tokens=args.max_new_tokens,
                          seed=args.seed), args.removal, args.seed,
                  publish_seconds(weights), (SPOT_BOOT_S + ENGINE_START_S) / args.compress)
    chosen = POLICIES if args.policies == "all" else [
        p for p in POLICIES if p.name[1:].split(")")[0] in args.policies.split(",")]
    title = (f"EMULATION: {args.model}, {args.reserved_gpus} reserved H100s (modelled), "
             f"spot = {args.trace} trace x{args.count_scale}\n"
             f"[{args.segment_start:.0f}s +{args.segment:.0f}s, /{args.compress:.0f}], "
             f"{setup.trace.mean():.1f} spot instances on average; publish "
             f"{setup.publish_s:.1f}s, spot start {setup.start_s:.1f}s")
    return setup, chosen, title


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    exit_on_sigterm()
    setup, chosen, title = configure(args)
    print(title, flush=True)
    print(f"trainer: {PRESETS[args.model].seconds_per_token * 1e6:.1f} us/token on "
          f"{PRESETS[args.model].gpus} GPUs; serving: {serving_model(args.model)}", flush=True)
    outcomes = []
    started = time.monotonic()
    for policy in chosen:
        with tempfile.TemporaryDirectory(prefix="rlboost-paper-") as tmp:
            t = time.monotonic()
            outcomes.append(run_policy(policy, setup, Path(tmp)))
            print(f"  {policy.name}: {len(outcomes[-1].steps)} steps measured "
                  f"({time.monotonic() - t:.0f}s wall)", flush=True)
    write_outputs(outcomes, args.out, title)
    print(f"{time.monotonic() - started:.0f}s in all")
    return 0


def write_outputs(outcomes: list[Outcome], out: Path, title: str) -> None:
    """Print the table; write the plot, the table and the step records under ``out``."""
    prices = paper_report.Prices.from_env()
    rows = paper_report.table(outcomes, prices)
    print(f"\n{paper_report.render(rows, markdown=False)}")
    print(f"\nprices per GPU-hour: on-demand ${prices.on_demand_gpu_h:.2f}, spot "
          f"${prices.spot_gpu_h:.2f}")
    out.mkdir(parents=True, exist_ok=True)
    paper_report.plot(outcomes, out / "bench-paper.png", title)
    (out / "bench-paper.md").write_text(
        f"{provenance.line('make bench-paper')}\n\n"
        f"{title}\n\n{paper_report.render(rows, markdown=True)}\n\nprices per GPU-hour: "
        f"on-demand ${prices.on_demand_gpu_h:.2f}, spot ${prices.spot_gpu_h:.2f}\n")
    (out / "bench-paper-steps.json").write_text(json.dumps(
        {o.policy: o.steps for o in outcomes}, indent=1))
    print(f"wrote {out / 'bench-paper.png'}, bench-paper.md, bench-paper-steps.json")


if __name__ == "__main__":
    raise SystemExit(main())
