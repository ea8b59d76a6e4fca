"""What a simulation runs: the workload, the cluster and its costs, the policy, the prices.

SIMULATION. Every GPU cost comes from the same presets the emulation uses
(:mod:`rollout_svc.engines.emu_models` for serving, :mod:`trainer_svc.learn.compute_model` for
training, :mod:`shared.hardware` for publish, pulls and start-up), so a simulated and an
emulated run of one configuration charge the same seconds for the same work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rollout_svc.engines.emu_models import ServingModel, serving_model
from shared import hardware
from trainer_svc.learn.compute_model import PRESETS, ComputeModel

# Prices per GPU-hour. AWS p5.48xlarge (8x H100 SXM) on-demand in us-east-1 is $55.04/h after
# AWS's June 2025 price reduction for P5 instances (AWS "What's New", 2025-06-05), $6.88 per
# GPU. Spot: the same at a 65 % discount, ASSUMPTION (AWS advertises "up to 90 %"; H100 spot
# capacity has traded 60-70 % below on-demand in the AWS Spot price history).
ON_DEMAND_GPU_H = 6.88
SPOT_DISCOUNT = 0.65
SPOT_GPU_H = 2.41  # ON_DEMAND_GPU_H at SPOT_DISCOUNT, to the cent

# Reasoning-length responses for the paper regime: the budget is Terra-Flux/PolyRL's example
# (128 prompts x 8 samples, max_response_length=14336). The shape is an ASSUMPTION: lognormal
# (sigma 1.0, like the emu engine's length model) with a mean of 3,584 tokens (a quarter of the
# budget, the emu engine's MEAN_LEN_FRAC), truncated at the budget (~4 % of responses hit it).
REASONING_MAX_TOKENS = 14336
REASONING_MEAN_TOKENS = 3584
REASONING_PROMPT_TOKENS = 512  # a competition-math prompt with its chat template: ASSUMPTION
GPU_MEMORY_BYTES = 80e9  # H100 SXM5 HBM3 (NVIDIA datasheet)
KV_MEMORY_SHARE = 0.9  # SGLang's default mem_fraction_static is about 0.9


# Agentic responses (issue 38's tool use). ASSUMPTIONS, stated on the results page:
# * model turns per response: 1 + Binomial(max_turns - 1, 0.5) with max_turns 4 (1/8 one turn,
#   3/8 two, 3/8 three, 1/8 four; mean 2.5), the 2-4-turn tool use of the example;
# * each turn's length is drawn like a single-turn response (the emu engine's lognormal, keyed
#   by the turn's start as the emu engine keys it) with its mean divided by the mean turns, so a
#   response's model tokens average what a single-turn response's do; the whole response,
#   observations included, stays within max_new_tokens (the spec's rule);
# * a tool call takes a lognormal time with a median of 1.5 s and sigma 1.0 (p90 5.4 s, p99
#   15.4 s before the cut): a sandboxed Python run or a search call with the bus round trip;
#   a call past max_tool_s (the spec's default, 10 s; 2.9 % of calls) is answered at 10 s;
# * every observation is 256 tokens (the spec's default max_observation_tokens: a full budget);
# * the tool pool runs every call at once (enough reserved CPU workers; no queueing).
AGENTIC_MAX_TURNS = 4
AGENTIC_TURN_P = 0.5
AGENTIC_TOOL_MEDIAN_S = 1.5
AGENTIC_TOOL_SIGMA = 1.0
AGENTIC_MAX_TOOL_S = 10.0
AGENTIC_OBSERVATION_TOKENS = 256

# Version kinds (issue 40, docs/weights.md): what a spot instance that already holds a version
# pulls for the next one. A joiner holds none, so its first pull is the full version (for an
# adapter run: the base and the current adapter), unless its image carries the base
# (``Cluster.base_preseeded``): then an adapter joiner pulls the adapter alone. MEASURED by
# ``make bench-weights`` (``python -m benchmarks.weights --only delta``, at commit 703bca1 on
# this 2-CPU machine): a Qwen2-shaped model (4 layers x 512, 45 M parameters, random init) over
# 10 real AdamW steps, published in bf16 (89.7 MB a version):
# * DELTA_BYTES_RATIO: the deltas' bytes over the versions', summed over the 10 versions (16.00
#   of 896.75 MB; each version's own: 3.1 % after the first step, falling to 1.3 %) at lr 1e-6;
#   the delta of n applies only to a holder of n - 1, anyone else pulls full.
# * ADAPTER_BYTES_RATIO: the adapter files (rank 8, alpha 16 on all seven projections, fp32 as
#   PEFT trains them: 1.221 MB) over the bf16 version's bytes. An adapter's share falls as
#   models grow (by count, rank 8 on the same projections is ~0.5 % of an 8B model's bytes in
#   bf16), so at 8B-32B this ratio overstates it. An adapter needs no rebuild, and an engine
#   loads only it.
# * DELTA_REBUILD_BYTES_S: a holder's delta pull over loopback, where the link is free, is the
#   rebuild (read the base, decompress, XOR, hash and write every byte, on one thread): the
#   version's bytes over that pull's time. e6bb352's run of the same command took 0.22-0.30 s
#   for 89.7 MB (0.30-0.41 GB/s; 703bca1's, on a busier machine, 0.72-1.95 s). Charged after the
#   delta's transfer, before the load: a holder on a fast link can pull a whole version sooner
#   than it rebuilds one from a delta.
DELTA_BYTES_RATIO = 0.0178
ADAPTER_BYTES_RATIO = 0.0136
DELTA_REBUILD_BYTES_S = 0.35e9
VERSION_KINDS = ("full", "delta", "adapter")


@dataclass(frozen=True)
class Turns:
    """Multi-turn responses: model turns, a tool call between two, an observation after it."""

    max_turns: int = AGENTIC_MAX_TURNS
    turn_p: float = AGENTIC_TURN_P  # each turn past the first: 1 + Binomial(max_turns - 1, p)
    tool_median_s: float = AGENTIC_TOOL_MEDIAN_S
    tool_sigma: float = AGENTIC_TOOL_SIGMA
    max_tool_s: float = AGENTIC_MAX_TOOL_S
    observation_tokens: int = AGENTIC_OBSERVATION_TOKENS

    def __post_init__(self) -> None:
        if self.max_turns < 1 or not 0.0 <= self.turn_p <= 1.0:
            raise ValueError(f"turns: max_turns {self.max_turns} must be >= 1 and turn_p "
                             f"{self.turn_p} within [0, 1]")
        if self.tool_median_s < 0 or self.tool_sigma < 0 or self.max_tool_s < 0 \
                or self.observation_tokens < 0:
            raise ValueError("turns: tool times and observation tokens must be >= 0")

    @property
    def mean_turns(self) -> float:
        return 1 + (self.max_turns - 1) * self.turn_p


@dataclass(frozen=True)
class Workload:
    prompts: int = 256
    samples: int = 16
    max_new_tokens: int = 128
    mean_tokens: float = 32.0  # lognormal mean before truncation (model tokens of a response)
    sigma: float = 1.0
    prompt_tokens: int = 4
    seed: int = 0
    turns: Turns | None = None  # None: single-turn responses
    # Length model beyond the emu engine's (both 0: exactly its draws, sim.turns.length):
    # the share of a length's log-variance that belongs to its prompt (its group's samples run
    # long or short together; the marginal stays the same lognormal), and the mean's growth per
    # step (responses lengthen as training goes on).
    prompt_share: float = 0.0
    growth: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.prompt_share <= 1.0 or self.growth <= -1.0:
            raise ValueError(f"workload: prompt_share {self.prompt_share} must be in [0, 1] "
                             f"and growth {self.growth} > -1")

    @classmethod
    def reasoning(cls, prompts: int = 256, samples: int = 8, seed: int = 0) -> Workload:
        return cls(prompts, samples, REASONING_MAX_TOKENS, REASONING_MEAN_TOKENS, 1.0,
                   REASONING_PROMPT_TOKENS, seed)

    @classmethod
    def agentic(cls, prompts: int = 256, samples: int = 8, seed: int = 0,
                turns: Turns | None = None) -> Workload:
        """The reasoning workload in model turns with tool calls between them."""
        return cls(prompts, samples, REASONING_MAX_TOKENS, REASONING_MEAN_TOKENS, 1.0,
                   REASONING_PROMPT_TOKENS, seed, turns or Turns())


@dataclass(frozen=True)
class Policy:
    """Which mechanisms are on: rlboost has all of them; each ablation turns one off."""

    name: str
    spot: bool = True
    seeding: str = "adaptive"  # adaptive | fixed | off
    window_s: float = 0.0  # the fixed window
    migration: str = "token"  # token | request
    midstep_join: bool = True
    rebalance: bool = True
    # Bounded staleness (issue 39): step m's rollout may start once version m - k is published,
    # so steps n+1 .. n+k roll out while step n trains; 0 is the synchronous protocol.
    staleness: int = 0
    # What a spot instance holding a version pulls for the next (VERSION_KINDS, above): full
    # versions, deltas of full fine-tuning, or a LoRA run's adapters over a base.
    versions: str = "full"
    # Reserved GPUs that only roll out (a disaggregated reserved side, as veRL's and slime's
    # one-step-off-policy modes run): the rest only train, on groups as they complete, at
    # their own count's speed; 0: colocated, every reserved GPU does both in turn.
    rollout_gpus: int = 0

    def __post_init__(self) -> None:
        if self.rollout_gpus < 0:
            raise ValueError(f"policy {self.name}: rollout_gpus {self.rollout_gpus} must be >= 0")
        if self.staleness < 0:
            raise ValueError(f"policy {self.name}: staleness {self.staleness} must be >= 0")
        if self.versions not in VERSION_KINDS:
            raise ValueError(f"policy {self.name}: versions {self.versions!r} must be one of "
                             f"{', '.join(VERSION_KINDS)}")


RESERVED_ONLY = Policy("reserved-only", spot=False, seeding="off")
RLBOOST = Policy("rlboost")
ABLATIONS = [Policy("seeding off", seeding="off"),
             Policy("request-level migration", migration="request"),
             Policy("no mid-step join", midstep_join=False),
             Policy("no load balancing", rebalance=False)]


@dataclass(frozen=True)
class Costs:
    """Seconds the simulated hardware charges; defaults are the emulation's presets."""

    serving: ServingModel
    compute: ComputeModel
    max_batch: int = 64
    context_aware: bool = False  # KV read per sequence at its true context, not a 4k constant
    publish_s: float = 0.0
    spot_start_s: float = 0.0  # boot + engine start, from grant to first pull
    weight_bytes: float = 0.0  # pulled per spot instance per version
    egress_bytes_s: float = math.inf  # the weight service's link, shared by pulls
    peer_bytes_s: float = 0.0  # what a holder of the version serves to peers
    control_s: float = 0.0  # manager round trip before an assignment starts generating
    handoff_s: float = 0.0  # reserved side's flush at the end of the seeding window
    # Control-plane latencies a step pays whatever the policy: a complete group (and the
    # barrier) reaches the trainer this long after its last token (ingest, the manager's
    # announce, the trainer's fetch); and from the trainer's publish to the step's end (its
    # report, the next step's creation). Zero for the paper regime, measured on the emulation.
    barrier_s: float = 0.0
    report_s: float = 0.0
    dispatch_interval_s: float = 0.25  # the dispatcher's periodic pass (rebalancing)
    chunk_tokens: int = 32  # tokens per commit: a move without flush loses the uncommitted
    grace_s: float = 10.0  # notice to hard stop, billed
    lease_ttl_s: float = 3.0  # a hard-killed instance's leases expire after this (the default
    # of RLBOOST_LEASE_TTL_S): its responses wait this long before anyone else may take them
    # Host time per decode step on top of the GPU model: zero for the hardware; the emulation's
    # engines pay their Python loop on shared CPU cores, which the validation measures.
    host_step_s: float = 0.0
    # Version kinds other than full (Policy.versions): bytes over a full version's, and the
    # delta's rebuild rate; the measured figures above unless a test sets its own.
    delta_ratio: float = DELTA_BYTES_RATIO
    delta_rebuild_bytes_s: float = DELTA_REBUILD_BYTES_S
    adapter_ratio: float = ADAPTER_BYTES_RATIO

    @classmethod
    def emulation(cls, model: str, max_batch: int = 64, grace_s: float = 10.0,
                  publish_s: float = 0.0, start_s: float = 0.0, host_step_s: float = 0.0,
                  barrier_s: float = 0.0, report_s: float = 0.0) -> Costs:
        """The emulation's charges: what bench-paper's services sleep with these settings
        (RLBOOST_EMU_PUBLISH_S, RLBOOST_EMU_START_S, RLBOOST_GRACE_S)."""
        return cls(serving_model(model), PRESETS[model], max_batch=max_batch,
                   publish_s=publish_s, spot_start_s=start_s, grace_s=grace_s,
                   host_step_s=host_step_s, barrier_s=barrier_s, report_s=report_s)

    @classmethod
    def paper(cls, model: str, grace_s: float = 120.0,
              mean_tokens: float = REASONING_MEAN_TOKENS) -> Costs:
        """The paper regime: true context, memory-bound batch (sequences at the prompt plus
        ``mean_tokens`` of context), contended egress, publish."""
        serving = serving_model(model)
        weights = 2 * serving.params
        kv_room = serving.gpus * GPU_MEMORY_BYTES * KV_MEMORY_SHARE - weights
        per_seq = serving.kv_bytes_per_token * (REASONING_PROMPT_TOKENS + mean_tokens)
        return cls(serving, PRESETS[model], max_batch=max(1, int(kv_room / per_seq)),
                   context_aware=True, publish_s=hardware.publish_seconds(weights),
                   spot_start_s=hardware.SPOT_BOOT_S + hardware.ENGINE_START_S,
                   weight_bytes=weights, egress_bytes_s=hardware.WEIGHT_EGRESS_BYTES_S,
                   peer_bytes_s=hardware.WEIGHT_EGRESS_BYTES_S, control_s=0.05,
                   handoff_s=0.5, grace_s=grace_s)

    @property
    def load_s(self) -> float:
        """A spot instance's load into HBM after (or, with no pull modelled, including) the
        pull: the emulation's engine load time."""
        return self.serving.load_s if self.weight_bytes == 0 else \
            2 * self.serving.params / (self.serving.gpus * hardware.PCIE_LOAD_BYTES_S)


@dataclass(frozen=True)
class Cluster:
    reserved_gpus: int = 8
    spot_times: list[float] = field(default_factory=lambda: [0.0])  # trace, simulated s
    spot_counts: list[int] = field(default_factory=lambda: [0])  # spot instances from each time
    spot_join_at_start: bool = True  # the count at t=0 is up (and holds weights) at the start
    trace_length_s: float = 0.0  # the trace loops after this; 0: after its last change
    # Spot images carry the base model (a pre-seeded base directory): with adapter versions a
    # joiner pulls the adapter alone; full and delta versions pull in full at first join anyway.
    base_preseeded: bool = False
    # The share of preemptions that are hard kills: no notice, so no hand-back; the instance's
    # uncommitted tokens are lost and its responses wait for their leases to expire
    # (Costs.lease_ttl_s). Billing stops at the kill. The rest get a notice (billed through
    # Costs.grace_s). Which preemption is which is a seeded draw of its own, so every share
    # sees the same victims at the same moments.
    hard_kill_share: float = 0.0
    # Spot instances of another GPU type than the serving model's (sim.hardware_types): decode
    # and prefill speed relative to the serving model's instance, GPUs per instance (billing;
    # 0: the serving model's) and running sequences (0: Costs.max_batch).
    spot_speed: float = 1.0
    spot_gpus: int = 0
    spot_batch: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.hard_kill_share <= 1.0:
            raise ValueError(f"cluster: hard_kill_share {self.hard_kill_share} must be in [0, 1]")
        if self.spot_speed <= 0 or self.spot_gpus < 0 or self.spot_batch < 0:
            raise ValueError("cluster: spot_speed must be > 0, spot_gpus and spot_batch >= 0")
