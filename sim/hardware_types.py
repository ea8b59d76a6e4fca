"""The GPU types behind the spot traces, for running spot instances on them.

SIMULATION. The Bamboo traces count instances of one type each (AWS p3: V100, AWS g4dn: T4, GCP
a2: A100 40 GB), while the headline runs every spot GPU at H100 speed. With a trace's own type,
a spot instance of a model holds as many of that type's GPUs as it takes to fit the weights and
a working KV cache, decodes at their summed memory bandwidth over the H100 instance's (decode is
memory-bound: every step reads the weights and each sequence's KV cache; tensor-parallel
communication is not charged, which favours the slower types), runs as many sequences as its
KV room holds, and is billed per GPU at that type's spot price.

Sources (datasheets and list prices, on-demand, per GPU-hour, as of 2025):
* V100 SXM2 16 GB, 900 GB/s HBM2 (NVIDIA V100 datasheet); AWS p3.2xlarge (1 V100) $3.06/h in
  us-east-1.
* T4 16 GB, 320 GB/s GDDR6 (NVIDIA T4 datasheet); AWS g4dn.xlarge (1 T4) $0.526/h in
  us-east-1.
* A100 40 GB, 1,555 GB/s HBM2 (NVIDIA A100 datasheet); GCP a2-highgpu-1g (1 A100 40 GB)
  $3.67/h in us-central1.
Spot prices are these at :data:`sim.config.SPOT_DISCOUNT`, the headline's discount.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout_svc.engines.emu_models import serving_model
from shared.hardware import H100_HBM_BYTES_S
from sim.config import (
    KV_MEMORY_SHARE,
    REASONING_MEAN_TOKENS,
    REASONING_PROMPT_TOKENS,
    SPOT_DISCOUNT,
)

# Sequences an instance must be able to run at the mean context before it counts as fitting the
# model: below this, adding a GPU buys more than it costs.
MIN_BATCH = 16


@dataclass(frozen=True)
class GpuType:
    name: str
    memory_bytes: float
    hbm_bytes_s: float
    on_demand_gpu_h: float

    @property
    def spot_gpu_h(self) -> float:
        return self.on_demand_gpu_h * (1 - SPOT_DISCOUNT)


V100 = GpuType("V100 16 GB", 16e9, 900e9, 3.06)
T4 = GpuType("T4 16 GB", 16e9, 320e9, 0.526)
A100_40 = GpuType("A100 40 GB", 40e9, 1555e9, 3.67)
TRACE_TYPES: dict[str, GpuType] = {"p3": V100, "g4dn": T4, "gcp": A100_40}


@dataclass(frozen=True)
class SpotInstance:
    """One spot instance of a model on a GPU type: what :class:`sim.config.Cluster` takes."""

    gpu: GpuType
    gpus: int  # per instance
    speed: float  # decode rate over the model's H100 instance's
    batch: int  # sequences at the mean context that its KV room holds


def spot_instance(model: str, gpu: GpuType) -> SpotInstance:
    """The smallest power-of-two count of ``gpu`` that holds ``model`` and MIN_BATCH
    sequences at the reasoning workload's mean context."""
    serving = serving_model(model)
    weights = 2 * serving.params
    per_seq = serving.kv_bytes_per_token * (REASONING_PROMPT_TOKENS + REASONING_MEAN_TOKENS)
    gpus = 1
    while gpus * gpu.memory_bytes * KV_MEMORY_SHARE - weights < MIN_BATCH * per_seq:
        gpus *= 2
        if gpus > 64:
            raise ValueError(f"{model} does not fit on 64 {gpu.name}")
    batch = int((gpus * gpu.memory_bytes * KV_MEMORY_SHARE - weights) / per_seq)
    speed = gpus * gpu.hbm_bytes_s / (serving.gpus * H100_HBM_BYTES_S)
    return SpotInstance(gpu, gpus, speed, batch)
