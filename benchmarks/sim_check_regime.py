"""``make bench-sim-check``'s configuration: the headline regime, on two cores.

What ``make bench-paper-sim``'s headline (8B, p3, spot:reserved 1) simulates, run on the real
services with the ``emu`` engine, and the same configuration in the simulator:

* reasoning lengths: lognormal (sigma 1), mean 3,584 tokens, cut at 14,336, decoded at their
  true context (``RLBOOST_EMU_TRUE_CONTEXT``), in a batch bounded by HBM;
* real weight sizes: the 16 GB of an 8B model in bf16 over the weight service's 12.5 GB/s
  link, shared by every pull (``RLBOOST_WEIGHTS_EGRESS_BYTES_S``), loaded over PCIe after it;
  reserved instances swap in device memory (``RLBOOST_EMU_LINK``); full versions, no peers;
* spot boot + engine start 90 s, billing through a 120 s grace, the trace's 2-hour segment
  from 1 h in, scaled to a mean of 8 spot GPUs beside 8 reserved ones;
* the trainer's publish of the 16 GB version (write, hash, upload: 11.3 s) and its training
  time, from the same compute model.

Scaled so that two shared cores carry it, on both sides alike (the simulator runs exactly
this configuration, not the paper's):

* time: emulated seconds run ``time_scale`` wall seconds each (the link's rate, boot and grace
  scale with it: they are emulated seconds like the rest);
* tokens: every emitted token stands for ``token_scale`` modelled ones
  (``RLBOOST_EMU_TOKEN_SCALE``): a 3,584-token response is 28 tokens on the control plane,
  decoded, charged and trained as 3,584;
* the step: ``prompts`` x 8 responses rather than 256 x 8, with the batch cut in the same
  proportion (104 sequences for 8B in 80 GB, to 13), so a step still queues ~2.5 responses
  per slot and ends on its longest responses;
* prompts are the built-in task's 4 tokens (the paper regime's 512 add ~2 % to a decode step).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from benchmarks import paper
from benchmarks.trace import Trace, load
from rollout_svc.engines.emu_models import CONTEXT_TOKENS, ServingModel, serving_model
from shared.hardware import ENGINE_START_S, SPOT_BOOT_S, WEIGHT_EGRESS_BYTES_S
from shared.spec import RunSpec
from sim.config import (
    ABLATIONS,
    REASONING_MAX_TOKENS,
    REASONING_MEAN_TOKENS,
    RESERVED_ONLY,
    RLBOOST,
    Cluster,
    Costs,
    Policy,
    Workload,
)
from trainer_svc.embedded import task
from trainer_svc.learn.compute_model import PRESETS

# The headline table's policies: bench-paper's five and the ablation it lacks.
POLICIES = [*paper.POLICIES, paper.Policy("(c4) no load balancing", spot=True,
                                          seeding=paper.ADAPTIVE,
                                          env={"RLBOOST_REBALANCE_SKEW": "0"})]
SIM_POLICY: dict[str, Policy] = {"a": RESERVED_ONLY, "b": RLBOOST, "c1": ABLATIONS[0],
                                 "c2": ABLATIONS[1], "c3": ABLATIONS[2], "c4": ABLATIONS[3]}
PAPER_RESPONSES = 256 * 8  # bench-paper-sim's step (sim.config.Workload.reasoning)
SKEW = int(paper.ENV["RLBOOST_REBALANCE_SKEW"])
# The emu trainer's placeholder checkpoint: the bytes each pull really moves. The link's wall
# rate is set so that they take what the real version takes over the real link, emulated.
PLACEHOLDER_BYTES = PRESETS["emu-8b"].checkpoint_bytes


def letter(policy: paper.Policy) -> str:
    return policy.name[1:].split(")")[0]


@dataclass(frozen=True)
class Regime:
    """One configuration of the check: every knob both sides share."""

    model: str = "emu-8b"
    trace: str = "p3"
    segment_start_s: float = 3600.0  # bench-paper-sim's segment of each trace
    segment_s: float = 7200.0
    reserved_gpus: int = 8
    spot_ratio: float = 1.0  # mean spot GPUs per reserved GPU
    prompts: int = 32
    samples: int = 8
    token_scale: int = 128
    time_scale: float = 0.025  # wall seconds per emulated second
    steps: int = 10  # measured per policy and seed, after the warm-up step 0
    seeds: tuple[int, ...] = (0, 1, 2)
    chunk_tokens: int = 4  # emitted tokens per commit: 512 modelled
    heartbeat_s: float = 0.2  # wall: a version's update waits for at most one beat
    trainer_poll_s: float = 0.1  # wall

    def __post_init__(self) -> None:
        if REASONING_MAX_TOKENS % self.token_scale:
            raise ValueError(f"token scale {self.token_scale} must divide the budget "
                             f"{REASONING_MAX_TOKENS}")

    # --- shared figures ---------------------------------------------------------------------

    @property
    def serving(self) -> ServingModel:
        return serving_model(self.model)

    @property
    def batch(self) -> int:
        """Costs.paper's memory-bound batch, cut as the step is."""
        full = Costs.paper(self.model).max_batch
        return max(1, round(full * self.prompts * self.samples / PAPER_RESPONSES))

    @property
    def weight_bytes(self) -> float:
        return 2 * self.serving.params

    @property
    def egress_wall_bytes_s(self) -> float:
        """The weight service's link in placeholder bytes per wall second: a pull of the
        placeholder alone takes the real version's bytes over the real link, emulated."""
        return PLACEHOLDER_BYTES * WEIGHT_EGRESS_BYTES_S / self.weight_bytes / self.time_scale

    @property
    def prompt_tokens(self) -> int:
        return len(task.make_prompts(0, 0, 1)[0])

    def spot_trace(self) -> Trace:
        """The trace segment in emulated seconds, scaled to the mean spot GPUs wanted."""
        seg = load(self.trace).segment(self.segment_start_s, self.segment_s)
        per_instance = self.serving.gpus
        return seg.compressed(1.0, self.spot_ratio * self.reserved_gpus
                              / (per_instance * seg.mean()))

    # --- the emulation ----------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """Settings of every service beyond bench-paper's (``paper.ENV``, which they override
        where both name one)."""
        s = self.time_scale
        return {
            "RLBOOST_EMU_TOKEN_SCALE": str(self.token_scale),
            "RLBOOST_EMU_TRUE_CONTEXT": "on", "RLBOOST_EMU_LINK": "on",
            "RLBOOST_WEIGHTS_EGRESS_BYTES_S": f"{self.egress_wall_bytes_s:.0f}",
            "RLBOOST_WEIGHTS_PEERS": "off", "RLBOOST_WEIGHTS_DELTAS": "off",
            "RLBOOST_CHUNK_TOKENS": str(self.chunk_tokens),
            "RLBOOST_MAX_BATCH": str(self.batch),
            "RLBOOST_GRACE_S": f"{Costs.paper(self.model).grace_s * s:.3f}",
            "RLBOOST_HEARTBEAT_S": str(self.heartbeat_s),
            "RLBOOST_TRAINER_POLL_S": str(self.trainer_poll_s),
        }

    def policies(self, letters: list[str] | None = None) -> list[paper.Policy]:
        chosen = [p for p in POLICIES if letters is None or letter(p) in letters]
        return [dataclasses.replace(p, env={**self.env(), **p.env}) for p in chosen]

    def setup(self, seed: int) -> paper.Setup:
        spec = RunSpec(model=self.model, steps=100_000, prompts_per_step=self.prompts,
                       samples_per_prompt=self.samples,
                       max_new_tokens=REASONING_MAX_TOKENS // self.token_scale, seed=seed)
        costs = Costs.paper(self.model)
        # The window is a bound only: a run ends once its steps are done.
        return paper.Setup(self.model, self.spot_trace(), self.reserved_gpus, self.time_scale,
                           100.0 * self.segment_s, spec, "notice", seed, costs.publish_s,
                           SPOT_BOOT_S + ENGINE_START_S, steps=self.steps)

    # --- the simulation ---------------------------------------------------------------------

    def workload(self, seed: int) -> Workload:
        return Workload(self.prompts, self.samples, REASONING_MAX_TOKENS,
                        REASONING_MEAN_TOKENS, 1.0, self.prompt_tokens, seed)

    def cluster(self) -> Cluster:
        trace = self.spot_trace()
        return Cluster(self.reserved_gpus, list(trace.times), list(trace.counts),
                       trace_length_s=trace.length_s)

    def costs(self, host: HostCosts) -> Costs:
        """Costs.paper at this scale, plus what the emulation's own hosts cost (measured on
        each run: :mod:`benchmarks.sim_check_measure`); its control-plane round trip replaces
        the paper's assumed 50 ms. No peers: the emulation lists none. The simulator starts a
        step where the last one ends: the manager's time between them is charged in the
        report, so a simulated step's time is the emulated one's with the gap after it."""
        base = Costs.paper(self.model)
        compute = base.compute
        per_token = compute.seconds_per_token + host.trainer_s_per_token
        compute = dataclasses.replace(compute, mfu=compute.mfu * compute.seconds_per_token
                                      / per_token)
        return dataclasses.replace(
            base, serving=UpdatedServing.of(self.serving, host.reserved_update_s),
            compute=compute, max_batch=self.batch,
            chunk_tokens=self.chunk_tokens * self.token_scale, peer_bytes_s=0.0,
            spot_start_s=base.spot_start_s + host.spot_join_s, host_step_s=host.step_s,
            control_s=host.control_s, report_s=host.report_s + host.between_s)

    def pull_alone_s(self) -> float:
        """A spot instance's pull and load alone on the link, emulated seconds."""
        base = Costs.paper(self.model)
        return self.weight_bytes / base.egress_bytes_s + base.load_s

    def kv_s_per_token(self) -> float:
        return self.serving.decode_s_per_seq / CONTEXT_TOKENS


@dataclass(frozen=True)
class HostCosts:
    """What the emulation's hosts add to the modelled hardware, in emulated seconds: each a
    measurement of one component, none taken from a step's length."""

    step_s: float = 0.0  # the engines' host time per decode step (their HostMeter)
    trainer_s_per_token: float = 0.0  # the trainer's busy time beyond its model, per token
    report_s: float = 0.0  # the step outside the trainer's clock: its finish report
    between_s: float = 0.0  # a step's end -> the next one's start (the manager creates it)
    control_s: float = 0.0  # a slot freed with work waiting -> its next request (RefillMeter)
    reserved_update_s: float = 0.0  # step start -> a reserved instance holds its version
    spot_join_s: float = 0.0  # a joiner's grant -> ready, beyond boot, pull and load alone


@dataclass(frozen=True, slots=True)
class UpdatedServing(ServingModel):
    """The serving model with the reserved side's update as the emulation measured it, from
    the step's start (a version announced before it may be swapped in already; one reverted
    by a heartbeat that still names the old step waits for the next beat), instead of the
    swap alone."""

    update_s: float = 0.0

    @classmethod
    def of(cls, base: ServingModel, update_s: float) -> UpdatedServing:
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        return cls(**fields, update_s=max(0.0, update_s))

    @property
    def swap_s(self) -> float:
        return self.update_s
