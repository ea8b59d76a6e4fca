"""``python -m benchmarks.sim_check --toy``: the first check, in bench-paper's toy regime.

Kept beside the headline regime's check (:mod:`benchmarks.sim_check`) as it was: responses of
128 tokens at most (mean 32), one or two steps per policy, no weight bytes, a 3 s boot. Unlike
that check it fits the engines' host time on policy (a), so (a) is no check here.

Runs ``make bench-paper``'s configuration (same flags, same defaults) on the real services with
the ``emu`` engine (EMULATION), then the same configuration in the discrete-event simulator
(SIMULATION: :mod:`sim`, the manager's own seeding and placement code), and prints per policy
the throughput and mean step time of both with their ratio; acceptance is every ratio within
+-10 %.

One figure is taken from the emulation rather than the hardware model: the emulated engines'
host time per decode step (their Python loop on two shared cores, which the H100 model does not
have). It is fitted on policy (a), reserved-only, alone: the simulated (a) rollout time is made
to match the emulated one by bisection. Two more are measured on (a)'s step records: the
control plane's latency from the barrier to the trainer (its idle time beyond the rollout, as
(a) trains only after the barrier) and from the trainer's publish to the step's end (the step's
time outside both). (a) is therefore the calibration point, and the other policies are the
check. Beside it, what the engines themselves measured of their host time
(:class:`rollout_svc.engines.emu.HostMeter`, per kind of instance) is printed: where the fit
and the measurement part, the difference is a cost the simulator does not model. The emulated
runs also rewrite bench-paper's outputs.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import paper
from benchmarks.sim_check_measure import measured_host
from benchmarks.sim_check_regime import letter
from shared.process import exit_on_sigterm
from sim.config import ABLATIONS, RESERVED_ONLY, RLBOOST, Cluster, Costs, Policy, Workload
from sim.outcome import Outcome, simulate

TOLERANCE = 0.10
# Where a step's time goes, emulated vs simulated (step records of both): the diagnosis of a
# ratio outside the tolerance.
PHASES = ("seeding_window_s", "rollout_s", "train_s", "trainer_idle_s")
# bench-paper's policies and the simulator's, by their letter.
SIM_POLICY: dict[str, Policy] = {"a": RESERVED_ONLY, "b": RLBOOST, "c1": ABLATIONS[0],
                                 "c2": ABLATIONS[1], "c3": ABLATIONS[2]}




@dataclass(frozen=True)
class Calibration:
    """What the simulator takes from the emulated (a): seconds of host time per decode step,
    and the control plane's fixed latencies per step (Costs.barrier_s, Costs.report_s)."""

    host_step_s: float
    barrier_s: float = 0.0
    report_s: float = 0.0

    @classmethod
    def latencies(cls, base: Outcome) -> Calibration:
        """The latencies of reserved-only steps: the trainer idles through the rollout and
        then waits for the barrier; the rest of the step is outside its clock."""
        n = len(base.steps)
        barrier = (base.total("trainer_idle_s") - base.total("rollout_s")) / n
        report = (base.total("step_s") - base.total("train_s") - base.total("trainer_idle_s")) / n
        return cls(0.0, max(0.0, barrier), max(0.0, report))


def sim_inputs(setup: paper.Setup, cal: Calibration) -> tuple[Workload, Costs, Cluster]:
    spec = setup.spec
    work = Workload(spec.prompts_per_step, spec.samples_per_prompt, spec.max_new_tokens,
                    0.25 * spec.max_new_tokens, 1.0, 4, spec.seed)
    costs = Costs.emulation(setup.model, max_batch=int(paper.ENV["RLBOOST_MAX_BATCH"]),
                            grace_s=setup.grace_s, publish_s=setup.publish_s,
                            start_s=setup.start_s, host_step_s=cal.host_step_s,
                            barrier_s=cal.barrier_s, report_s=cal.report_s)
    cluster = Cluster(setup.reserved_gpus, list(setup.trace.times), list(setup.trace.counts),
                      trace_length_s=setup.trace.length_s)
    return work, costs, cluster


def run_sim(policy: Policy, setup: paper.Setup, cal: Calibration, steps: int | None = None
            ) -> Outcome:
    """``policy`` simulated over bench-paper's span, or over its first ``steps`` steps (as
    many as the emulation measured: a span holds whole steps only, so the same span could
    hold two ~22 s steps in one and one in the other)."""
    work, costs, cluster = sim_inputs(setup, cal)
    span = setup.window_s if steps is None else 20 * setup.window_s
    return simulate(policy, work, costs, cluster, span,
                    skew=int(paper.ENV["RLBOOST_REBALANCE_SKEW"]), steps=steps)


def fit_host_step(setup: paper.Setup, rollout_s: float, cal: Calibration, steps: int) -> float:
    """The host seconds per decode step that make simulated (a) roll out in ``rollout_s``."""
    lo, hi = 0.0, 0.05
    for _ in range(20):
        mid = (lo + hi) / 2
        fit = Calibration(mid, cal.barrier_s, cal.report_s)
        if run_sim(RESERVED_ONLY, setup, fit, steps).mean("rollout_s") < rollout_s:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def main(argv: list[str] | None = None) -> int:
    args = paper.parser().parse_args(argv)
    exit_on_sigterm()
    setup, chosen, title = paper.configure(args)
    if letter(chosen[0]) != "a":
        raise SystemExit("the check needs policy a first: it calibrates the host time on it")
    print(title.replace("\n", " "), flush=True)
    emulated: dict[str, Outcome] = {}
    started = time.monotonic()
    for policy in chosen:
        with tempfile.TemporaryDirectory(prefix="rlboost-simcheck-") as tmp:
            t = time.monotonic()
            emulated[letter(policy)] = paper.run_policy(policy, setup, Path(tmp))
            measured = ", ".join(f"{kind} {1e3 * s:.2f} ms" for kind, s in
                                 sorted(measured_host(Path(tmp) / "logs").items()))
            print(f"  emulated {policy.name}: {len(emulated[letter(policy)].steps)} steps "
                  f"({time.monotonic() - t:.0f}s wall); engines' host time per decode step "
                  f"measured: {measured or 'none logged'}", flush=True)
    # The emulated half is bench-paper's run: its table, plot and step records too.
    paper.write_outputs(list(emulated.values()), args.out, title)
    base = emulated["a"]
    lat = Calibration.latencies(base)
    cal = Calibration(fit_host_step(setup, base.total("rollout_s") / len(base.steps), lat,
                                    len(base.steps)),
                      lat.barrier_s, lat.report_s)
    print(f"host time per decode step, fitted on (a): {cal.host_step_s * 1e3:.2f} ms; "
          f"control-plane latency measured on (a): barrier -> trainer {cal.barrier_s:.2f} s, "
          f"publish -> step end {cal.report_s:.2f} s")
    print(f"\n{'policy':<28} {'tok/s emu':>10} {'tok/s sim':>10} {'ratio':>6}  "
          f"{'step s emu':>10} {'step s sim':>10} {'ratio':>6}  within 10 %")
    ok = True
    for policy in chosen:
        key = letter(policy)
        emu = emulated[key]
        sim = run_sim(SIM_POLICY[key], setup, cal, len(emu.steps))
        emu_step = emu.total("step_s") / len(emu.steps)
        r_tps, r_step = sim.tokens_per_s / emu.tokens_per_s, sim.step_s / emu_step
        good = abs(r_tps - 1) <= TOLERANCE and abs(r_step - 1) <= TOLERANCE
        ok = ok and (good or key == "a")
        note = "calibration" if key == "a" else ("yes" if good else "NO")
        print(f"{policy.name:<28} {emu.tokens_per_s:>10,.0f} {sim.tokens_per_s:>10,.0f} "
              f"{r_tps:>6.2f}  {emu_step:>10.2f} {sim.step_s:>10.2f} {r_step:>6.2f}  {note}")
    print(f"\nmean seconds per step, emulated / simulated: {', '.join(PHASES)}")
    for policy in chosen:
        key = letter(policy)
        emu = emulated[key]
        sim = run_sim(SIM_POLICY[key], setup, cal, len(emu.steps))
        cells = "  ".join(f"{emu.total(k) / len(emu.steps):>6.2f} / {sim.mean(k):<6.2f}"
                          for k in PHASES)
        print(f"{policy.name:<28} {cells}")
    print(f"\nsimulator within +-10 % of the emulation on every checked policy: "
          f"{'yes' if ok else 'NO'} ({time.monotonic() - started:.0f}s in all)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
