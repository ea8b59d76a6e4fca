"""Serving-cost presets for the emulated engine: what one rollout instance of a model class
costs per decode step on H100s. EMULATION: these are derived figures, not measurements.

Every constant below follows from the hardware figures of :mod:`shared.hardware` (H100 HBM
bandwidth and bf16 peak, the spot and reserved weight-update rates) and these assumptions:

* Decode is memory-bound: a step reads all weights once (bf16: 2 bytes/param) plus each running
  sequence's KV cache; the attention kernels reach ~50 % of peak bandwidth on the KV part.
* Reasoning RL contexts: ~4k tokens of prompt + response per sequence on average.
* SGLang's per-step scheduler and kernel-launch overhead: ~5 ms at batch 1 (the gap between
  an 8B model's ~5 ms weight read and the ~10 ms per step SGLang reports at batch 1).

Model shapes are the public configs of Llama-3.1-8B (32 layers, 8 KV heads of 128), Qwen2.5-14B
(48 layers, 8 KV heads of 128) and Qwen2.5-32B (64 layers, 8 KV heads of 128).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from shared.hardware import (
    DEVICE_SWAP_BYTES_S,
    H100_BF16_FLOPS,
    H100_HBM_BYTES_S,
    PCIE_LOAD_BYTES_S,
    SPOT_LOAD_BYTES_S,
)
from shared.sampling import uniform

STEP_OVERHEAD_S = 0.005  # scheduler + kernel launches per decode step
CONTEXT_TOKENS = 4096  # mean sequence context in reasoning RL
KV_EFFICIENCY = 0.5  # share of HBM bandwidth the attention kernels reach on KV reads
PREFILL_MFU = 0.5  # prefill is compute-bound and runs near half of peak


@dataclass(frozen=True, slots=True)
class ServingModel:
    """One rollout instance of a model class: ``gpus`` H100s in tensor parallel."""

    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    gpus: int  # tensor-parallel degree: 32B in bf16 (64 GB) leaves no KV room on one 80 GB GPU

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16

    @property
    def decode_s_base(self) -> float:
        # Weights read once per step, split over the tensor-parallel GPUs.
        return 2 * self.params / (self.gpus * H100_HBM_BYTES_S) + STEP_OVERHEAD_S

    @property
    def decode_s_per_seq(self) -> float:
        # Each running sequence adds its KV cache read, split over the GPUs.
        kv = self.kv_bytes_per_token * CONTEXT_TOKENS
        return kv / (self.gpus * H100_HBM_BYTES_S * KV_EFFICIENCY)

    @property
    def prefill_s_per_token(self) -> float:
        return 2 * self.params / (self.gpus * H100_BF16_FLOPS * PREFILL_MFU)

    @property
    def load_s(self) -> float:
        # Pull + SGLang update_weights_from_disk; each tensor-parallel rank loads its shard.
        return 2 * self.params / (self.gpus * SPOT_LOAD_BYTES_S)

    @property
    def pcie_load_s(self) -> float:
        # The load alone, once the pull has landed the checkpoint in the page cache: what
        # sim.config.Costs.load_s charges when the pull is modelled on its own.
        return 2 * self.params / (self.gpus * PCIE_LOAD_BYTES_S)

    @property
    def swap_s(self) -> float:
        # A reserved instance's update: the trainer's weights swapped in device memory, each
        # tensor-parallel rank its shard.
        return 2 * self.params / (self.gpus * DEVICE_SWAP_BYTES_S)

    def engine_options(self) -> dict[str, float]:
        return {"decode_s_base": self.decode_s_base, "decode_s_per_seq": self.decode_s_per_seq,
                "prefill_s_per_token": self.prefill_s_per_token, "load_s": self.load_s}


# 8B: 16 GB / 3.35 TB/s = 4.8 ms + 5 ms = ~9.8 ms/step; 128 KiB/token KV x 4k = 0.5 GB, 0.31 ms
# per sequence; the same figures the engine's module defaults state.
SERVING: dict[str, ServingModel] = {
    "emu-8b": ServingModel("emu-8b", 8.0e9, layers=32, kv_heads=8, head_dim=128, gpus=1),
    "emu-14b": ServingModel("emu-14b", 14.8e9, layers=48, kv_heads=8, head_dim=128, gpus=1),
    "emu-32b": ServingModel("emu-32b", 32.8e9, layers=64, kv_heads=8, head_dim=128, gpus=2),
}
SERVING["emu"] = SERVING["emu-8b"]


_NORMAL = NormalDist()


def response_length(seed: int, step: int, prompt: int, sample: int, weight_version: int,
                    mean: float, sigma: float, cap: int | None = None) -> int:
    """The emu engine's length model: tokens a response has (EOS included) before any budget.

    Lognormal with mean ``mean`` (long-tailed like reasoning RL: most responses short, a few
    run into the budget), keyed by ``uniform(seed, step, prompt, sample, -1 - version)`` so it
    never shares a draw with a token and changes with the weights; the simulator draws the
    same lengths."""
    mu = math.log(max(mean, 1.0)) - sigma**2 / 2  # so that E[length] = mean
    u = uniform(seed, step, prompt, sample, -1 - weight_version)
    z = _NORMAL.inv_cdf(min(max(u, 1e-12), 1 - 1e-12))  # inv_cdf rejects 0 and 1
    length = max(1, round(math.exp(mu + sigma * z)))
    return min(length, cap) if cap is not None else length


def serving_model(name: str) -> ServingModel:
    try:
        return SERVING[name]
    except KeyError:
        raise ValueError(f"unknown emu model {name!r}; one of {', '.join(SERVING)}") from None
