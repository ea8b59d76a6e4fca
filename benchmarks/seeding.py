"""``make bench-seeding``: the adaptive seeding window against a sweep of fixed windows.

EMULATION: rollout instances run the ``emu`` engine (modelled H100 decode time), the trainer
the emulated 32B compute model; manager, NATS, Redis, leases and weight transfer are real.

One cluster, one run per setting, the same workload and the same spot capacity schedule for
each: 8 spot instances for the first third of the steps, 2 for the second (6 get a preemption
notice), 8 again for the last (6 join). Printed: mean step time per setting with its ratio to
the best fixed window, the adaptive window step by step, and how many steps it took to settle
after each change (settled: every later window of the phase within 15 % of the phase's last).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec

from rlboost.launcher import Child, Cluster
from rlboost.stack import Stack
from shared.process import exit_on_sigterm
from shared.spec import RunSpec, SeedingSpec

STEPS = 12
SPEC = RunSpec(model="emu-32b", steps=STEPS, prompts_per_step=32, samples_per_prompt=8,
               max_new_tokens=128, seed=5)
ENV = {"RLBOOST_EMU_TIME_SCALE": "1.0", "RLBOOST_CHUNK_TOKENS": "16",
       "RLBOOST_EMU_MODEL": "emu-32b", "RLBOOST_HEARTBEAT_S": "0.25", "RLBOOST_REBALANCE_SKEW": "0"}
HIGH, LOW = 8, 2


def spot_children(cluster: Cluster) -> list[Child]:
    return [c for c in cluster.children if c.name.startswith("spot") and c.alive()]


def set_spot(cluster: Cluster, client: httpx.Client, count: int, serial: list[int]) -> None:
    alive = spot_children(cluster)
    for child in alive[count:]:
        child.signal(signal.SIGTERM)
    for _ in range(count - len(alive)):
        serial[0] += 1
        cluster.add_instance("spot", f"spot-{serial[0]}")
    end = time.monotonic() + 60
    while time.monotonic() < end:
        ready = [i for i in client.get("/v1/instances").json()
                 if i["kind"] == "spot" and i["state"] != "draining"]
        if len(ready) == count:
            return
        time.sleep(0.2)


def run_setting(cluster: Cluster, client: httpx.Client, seeding: SeedingSpec,
                serial: list[int]) -> list[dict[str, Any]]:
    set_spot(cluster, client, HIGH, serial)
    spec = msgspec.structs.replace(SPEC, seeding=seeding)
    run_id = client.post("/v1/runs", json=msgspec.to_builtins(spec)).json()["id"]
    phase = 0
    while True:
        run = client.get(f"/v1/runs/{run_id}").json()
        if run["state"] in ("succeeded", "failed", "cancelled"):
            break
        if phase == 0 and run["step"] >= STEPS // 3:
            set_spot(cluster, client, LOW, serial)
            phase = 1
        elif phase == 1 and run["step"] >= 2 * STEPS // 3:
            set_spot(cluster, client, HIGH, serial)
            phase = 2
        time.sleep(0.1)
    if run["state"] != "succeeded":
        raise RuntimeError(f"run {run_id} {run['state']}: {run.get('error')}")
    steps: list[dict[str, Any]] = client.get(f"/v1/runs/{run_id}/steps").json()
    return steps


def settle(windows: list[float], start: int, end: int) -> int:
    """Steps after ``start`` until every window up to ``end`` is within 15 % of the last."""
    final = windows[end - 1]
    for s in range(start, end):
        if all(abs(w - final) <= max(0.15 * final, 0.05) for w in windows[s:end]):
            return s - start
    return end - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", type=float, nargs="+", default=[0.0, 1.0, 2.0, 4.0, 8.0])
    args = parser.parse_args(argv)
    exit_on_sigterm()
    settings = [("adaptive", SeedingSpec(mode="adaptive"))]
    settings += [(f"fixed {w:.1f}s", SeedingSpec(mode="fixed", window_s=w)) for w in args.fixed]
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="rlboost-seeding-") as tmp:
        root = Path(tmp)
        stack = Stack.create(root / "brokers")
        stack.start()
        cluster = Cluster(root, spot=HIGH, reserved=1, engine="emu",
                          base_env={**stack.env(), **ENV, "RLBOOST_DATA_DIR": str(root / "d")})
        try:
            cluster.start()
            serial = [HIGH]
            with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], timeout=10) as client:
                for name, seeding in settings:
                    print(f"running {name} ...", flush=True)
                    results[name] = run_setting(cluster, client, seeding, serial)
        finally:
            cluster.stop()
            stack.stop()
    # Step 0 includes start-up for every setting alike; it is left out of the means.
    means = {n: statistics.fmean(s["step_s"] for s in steps[1:]) for n, steps in results.items()}
    best = min(v for n, v in means.items() if n != "adaptive")
    print(f"\nEMULATION (emu engine, modelled H100 time; real control plane); spot "
          f"{HIGH} -> {LOW} -> {HIGH} at steps {STEPS // 3} and {2 * STEPS // 3}")
    print(f"{'setting':<14} {'mean step s':>11} {'vs best fixed':>13}")
    for name, mean in means.items():
        print(f"{name:<14} {mean:>11.2f} {mean / best:>13.2f}")
    windows = [s["seeding_window_s"] for s in results["adaptive"]]
    print("adaptive window per step: " + " ".join(f"{w:.2f}" for w in windows))
    settles = [settle(windows, STEPS // 3, 2 * STEPS // 3), settle(windows, 2 * STEPS // 3, STEPS)]
    print(f"steps to settle after each change: {settles[0]}, {settles[1]}")
    ok = means["adaptive"] <= 1.10 * best and max(settles) <= 3
    print(f"adaptive within +10 % of the best fixed window and settled within 3 steps: "
          f"{'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
