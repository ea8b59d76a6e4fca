"""The hardware the emulation stands for: H100 GPUs and the links that feed them.

EMULATION. Contract: every figure of the hardware that an emulated cost is computed from lives
here and nowhere else, each with its source beside it: the rollout emulator's serving costs
(``rollout_svc.engines.emu_models``) and the trainer's compute model
(``trainer_svc.policies.emu``) both import it, so neither service imports the other and the two
sides can never model different GPUs. What software reaches on this hardware (MFU, kernel
efficiency, scheduler overhead) depends on the workload, not the GPU, and stays with the cost
model that applies it. Change these to emulate other hardware; real engines never read them.
"""

from __future__ import annotations

# H100 SXM5, per GPU. Source: NVIDIA H100 Tensor Core GPU datasheet (HBM3 bandwidth; BF16
# tensor-core peak is listed as 1,979 TFLOP/s *with* 2:4 sparsity, i.e. ~989 dense).
H100_HBM_BYTES_S = 3.35e12  # HBM3 bandwidth, bytes/s
H100_BF16_FLOPS = 989e12  # dense bf16 tensor-core peak, FLOP/s

# A spot instance's weight update: pull the checkpoint at the weight service's target rate
# (line rate of a 100 Gb/s NIC, 12.5 GB/s) while it lands in the page cache, then load it from
# there into HBM (PCIe Gen5 x16: ~25 GB/s achieved of its ~63 GB/s per direction, an
# ASSUMPTION for safetensors loads). One after the other that is 1 / (1/12.5 + 1/25) = 8.3 GB/s,
# taken as ~8 GB/s end to end. The emulated pull moves a small placeholder, so this figure
# stands for both.
SPOT_LOAD_BYTES_S = 8e9

# A reserved instance shares GPUs with the trainer that just produced the version and swaps the
# weights in device memory instead of pulling a checkpoint. ASSUMPTION, not a measurement:
# ~0.5 s for the 16 GB of an 8B model in bf16 per GPU, the copy plus the engine's update
# bookkeeping (the copy alone, at NVLink/HBM rates, would take a few tens of ms).
DEVICE_SWAP_BYTES_S = 32e9
