"""``make bench-sim-check``: the simulator against the emulation in the headline regime.

Runs every policy of the headline table (reserved-only, rlboost and its ablations) on the real
services with the ``emu`` engine (EMULATION) for ``--steps`` steps after a warm-up step, for
each of ``--seeds``, then the same configuration in the discrete-event simulator (SIMULATION:
:mod:`sim`, the manager's own seeding and placement code) for the same steps, and prints per
policy the mean step time and the throughput of both and their ratio, with a 95 % interval
over seeds; acceptance is every ratio within +-10 %. The regime and its scaling to two cores
are :mod:`benchmarks.sim_check_regime`.

Nothing is fitted. The simulator charges the hardware model (the emu engine's and trainer's
presets, the link, boot and grace), plus what the emulation's hosts cost beside it, measured
on each run from its components' own clocks and logs (:mod:`benchmarks.sim_check_measure`):
time compression makes a wall millisecond of Python tens of modelled milliseconds. The lengths
of a step's responses are the same draws on both sides, which the token counts check.

``--toy`` runs the first check instead (:mod:`benchmarks.sim_check_toy`: bench-paper's regime,
the host time fitted on policy (a)).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import httpx

from benchmarks import paper, sim_check_toy
from benchmarks.sim_check_measure import interval, measure, measured_host, modelled_tokens
from benchmarks.sim_check_regime import SIM_POLICY, SKEW, HostCosts, Regime, letter
from shared.process import exit_on_sigterm
from sim.outcome import Outcome, simulate

TOLERANCE = 0.10
# Where a step's time goes, emulated vs simulated: the diagnosis of a ratio outside tolerance.
PHASES = ("seeding_window_s", "rollout_s", "train_s", "trainer_idle_s")


@dataclass
class Pair:
    """One policy at one seed: both outcomes over the same steps, and the modelled tokens
    of those steps (the same on both sides)."""

    emu: Outcome
    sim: Outcome
    host: HostCosts
    tokens: int

    @property
    def emu_step_s(self) -> float:
        """An emulated step's time with the manager's gap after it (the simulator charges
        that gap in its step): the span of the steps and one more gap, per step."""
        return (self.emu.window_s + self.host.between_s) / len(self.emu.steps)

    def step_ratio(self) -> float:
        return self.sim.step_s / self.emu_step_s

    def rate_ratio(self) -> float:
        """Throughput, simulated over emulated: the same tokens over each side's span."""
        return self.emu.window_s / self.sim.window_s


def emulate(regime: Regime, policy: paper.Policy, seed: int) -> tuple[Outcome, HostCosts]:
    """One emulated run and what its hosts cost; checks that it emitted the tokens the
    length model gives its steps."""
    setup = regime.setup(seed)
    with tempfile.TemporaryDirectory(prefix="rlboost-simcheck-") as tmp:
        root = Path(tmp)
        records, player, begin, deadline = paper.run_emulated(policy, setup, root)
        out = paper.outcome(policy, setup, records, player, regime.serving.gpus, begin,
                            deadline)
        measured = [r for r in records if r["step"] >= 1 and r["finished_at"] <= deadline]
        host = measure(regime, root / "logs", measured, out.steps, player.history, begin,
                       deadline)
    for s in out.steps:
        emitted = modelled_tokens(regime, seed, int(s["step"]))[1]
        if int(s["tokens"]) != emitted:  # not the responses the simulator draws: no check
            raise ValueError(f"{policy.name} seed {seed} step {s['step']}: {s['tokens']} "
                               f"tokens trained, the length model gives {emitted}")
    return out, host


def emulate_retrying(regime: Regime, policy: paper.Policy, seed: int
                     ) -> tuple[Outcome, HostCosts]:
    """:func:`emulate`, once more if the cluster failed to come up (a port another user of
    the machine took between its check and its bind): a half-hour check should not end on
    it."""
    try:
        return emulate(regime, policy, seed)
    except (httpx.HTTPError, RuntimeError) as exc:
        print(f"  {policy.name} seed {seed} failed ({str(exc).splitlines()[0][:120]}); once "
              f"more", flush=True)
        return emulate(regime, policy, seed)


def pair(regime: Regime, key: str, seed: int, emu: Outcome, host: HostCosts) -> Pair:
    """The emulated run beside its simulation over as many steps."""
    n = len(emu.steps)
    sim = simulate(SIM_POLICY[key], regime.workload(seed), regime.costs(host),
                   regime.cluster(), 4 * n * max(s["step_s"] for s in emu.steps), skew=SKEW,
                   steps=n)
    for s in sim.steps:  # the responses the engines generated, or the check compares nothing
        drawn = modelled_tokens(regime, seed, int(s["step"]))[0]
        if int(s["tokens"]) != drawn:
            raise ValueError(f"simulated step {s['step']} trains {s['tokens']} tokens, the "
                             f"engines' lengths {drawn}: the simulator draws other lengths")
    tokens = sum(modelled_tokens(regime, seed, int(s["step"]))[0] for s in emu.steps)
    return Pair(emu, sim, host, tokens)


def saved(emu: Outcome, host: HostCosts, key: str, seed: int) -> dict[str, Any]:
    return {"policy": key, "seed": seed, "emulated": asdict(emu), "host": asdict(host)}


def restore(row: dict[str, Any]) -> tuple[str, int, Outcome, HostCosts]:
    emu = row["emulated"]
    emu["spot_history"] = [tuple(x) for x in emu["spot_history"]]
    return row["policy"], int(row["seed"]), Outcome(**emu), HostCosts(**row["host"])


def cell(values: list[float]) -> str:
    mean, half = interval(values)
    return f"{mean:.3f} +-{half:.3f}"


def report(regime: Regime, pairs: dict[str, list[Pair]], started: float) -> bool:
    print(f"\n{'policy':<28} {'steps':>5} {'step s emu':>10} {'sim':>7} "
          f"{'step ratio (95% CI)':>20} {'tok/s emu':>10} {'sim':>7} "
          f"{'tok/s ratio (95% CI)':>21}  within 10 %")
    ok = True
    for name, runs in pairs.items():
        step_r = [p.step_ratio() for p in runs]
        rate_r = [p.rate_ratio() for p in runs]
        good = all(abs(interval(r)[0] - 1) <= TOLERANCE for r in (step_r, rate_r))
        ok = ok and good
        steps = sum(len(p.emu.steps) for p in runs)
        emu_step = sum(p.emu_step_s * len(p.emu.steps) for p in runs) / steps
        sim_step = sum(p.sim.total("step_s") for p in runs) / steps
        emu_rate = sum(p.tokens for p in runs) / sum(p.emu.window_s for p in runs)
        sim_rate = sum(p.tokens for p in runs) / sum(p.sim.window_s for p in runs)
        print(f"{name:<28} {steps:>5} {emu_step:>10.1f} {sim_step:>7.1f} {cell(step_r):>20} "
              f"{emu_rate:>10,.0f} {sim_rate:>7,.0f} {cell(rate_r):>21}  "
              f"{'yes' if good else 'NO'}")
    print(f"\nmean seconds per step, emulated / simulated: {', '.join(PHASES)}")
    for name, runs in pairs.items():
        cells = "  ".join(
            f"{sum(p.emu.total(k) for p in runs) / sum(len(p.emu.steps) for p in runs):>6.1f}"
            f" / {sum(p.sim.total(k) for p in runs) / sum(len(p.sim.steps) for p in runs):<6.1f}"
            for k in PHASES)
        print(f"{name:<28} {cells}")
    print("\nhost costs measured on the emulated runs and charged in the simulator (mean over "
          "seeds; emulated seconds): host per decode step (ms), control round trip, trainer "
          "per 1k tokens (ms), report, between steps, reserved update, spot join")
    for name, runs in pairs.items():
        mean = {f.name: sum(getattr(p.host, f.name) for p in runs) / len(runs)
                for f in fields(HostCosts)}
        print(f"{name:<28} {1e3 * mean['step_s']:>6.2f} {mean['control_s']:>6.2f} "
              f"{1e6 * mean['trainer_s_per_token']:>6.2f} {mean['report_s']:>6.2f} "
              f"{mean['between_s']:>6.2f} {mean['reserved_update_s']:>6.2f} "
              f"{mean['spot_join_s']:>6.2f}")
    print(f"\nsimulator within +-10 % of the emulation on every policy (mean over "
          f"{len(regime.seeds)} seeds): {'yes' if ok else 'NO'} "
          f"({time.monotonic() - started:.0f}s in all; load average at the end "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    return ok


def parser() -> argparse.ArgumentParser:
    base = Regime()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="all", help="comma-separated letters, e.g. a,b")
    parser.add_argument("--seeds", type=int, default=len(base.seeds),
                        help="seeds 0 .. this - 1, each a run of every policy")
    parser.add_argument("--steps", type=int, default=base.steps,
                        help="steps measured per run, after the warm-up step")
    parser.add_argument("--time-scale", type=float, default=base.time_scale,
                        help="wall seconds per emulated second")
    parser.add_argument("--prompts", type=int, default=base.prompts,
                        help="prompts a step (8 responses each)")
    parser.add_argument("--token-scale", type=int, default=base.token_scale,
                        help="modelled tokens per emitted token")
    parser.add_argument("--save", type=Path, help="write each emulated run here (JSON)")
    parser.add_argument("--resimulate", type=Path,
                        help="simulate the emulated runs a --save wrote (same flags); "
                        "emulate nothing")
    parser.add_argument("--toy", action="store_true",
                        help="the first check, in bench-paper's toy regime (its own flags)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--toy" in argv:  # before parsing: its flags are bench-paper's, not these
        return sim_check_toy.main([a for a in argv if a != "--toy"])
    args = parser().parse_args(argv)
    exit_on_sigterm()
    regime = replace(Regime(), seeds=tuple(range(args.seeds)), steps=args.steps,
                     time_scale=args.time_scale, prompts=args.prompts,
                     token_scale=args.token_scale)
    chosen = regime.policies(None if args.policies == "all" else args.policies.split(","))
    print(f"EMULATION vs SIMULATION, headline regime: {regime.model}, {regime.reserved_gpus} "
          f"reserved H100s (modelled), {regime.trace} trace x{regime.spot_ratio:g} spot, "
          f"{regime.prompts}x{regime.samples} responses a step (batch {regime.batch}), "
          f"{regime.steps} steps x seeds {list(regime.seeds)}; emulated time x"
          f"{regime.time_scale:g} wall, {regime.token_scale} modelled tokens a token; load "
          f"average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    started = time.monotonic()
    names = {letter(p): p.name for p in chosen}
    pairs: dict[str, list[Pair]] = {p.name: [] for p in chosen}
    if args.resimulate is not None:
        for row in json.loads(args.resimulate.read_text()):
            key, seed, emu, host = restore(row)
            if key in names:
                pairs[names[key]].append(pair(regime, key, seed, emu, host))
        return 0 if report(regime, pairs, started) else 1
    rows: list[dict[str, Any]] = []
    for seed in regime.seeds:  # seed-major: a cut-short run still has every policy
        for policy in chosen:
            t = time.monotonic()
            emu, host = emulate_retrying(regime, policy, seed)
            if args.save is not None:
                rows.append(saved(emu, host, letter(policy), seed))
                args.save.write_text(json.dumps(rows))
            p = pair(regime, letter(policy), seed, emu, host)
            pairs[policy.name].append(p)
            print(f"  {policy.name} seed {seed}: {len(emu.steps)} steps, step s emu "
                  f"{p.emu_step_s:.1f} sim {p.sim.step_s:.1f} ({p.step_ratio():.3f}), tok/s "
                  f"ratio {p.rate_ratio():.3f} ({time.monotonic() - t:.0f}s wall; load "
                  f"{os.getloadavg()[0]:.1f})", flush=True)
    return 0 if report(regime, pairs, started) else 1


__all__ = ["main", "measured_host"]  # measured_host: bench-sim-check's reading of HostMeter

if __name__ == "__main__":
    raise SystemExit(main())
