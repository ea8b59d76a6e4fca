"""The hardware the emulation stands for: H100 GPUs and the links that feed them.

EMULATION. Contract: every figure of the hardware that an emulated cost is computed from lives
here and nowhere else, each with its source beside it: the rollout emulator's serving costs
(``rollout_svc.engines.emu_models``) and the trainer's compute model
(``trainer_svc.learn.compute_model``) both import it, so neither service imports the other and
the two sides can never model different GPUs. What software reaches on this hardware (MFU, kernel
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
PCIE_LOAD_BYTES_S = 25e9  # the load half of the above, alone (a pull modelled on its own)

# A reserved instance shares GPUs with the trainer that just produced the version and swaps the
# weights in device memory instead of pulling a checkpoint. ASSUMPTION, not a measurement:
# ~0.5 s for the 16 GB of an 8B model in bf16 per GPU, the copy plus the engine's update
# bookkeeping (the copy alone, at NVLink/HBM rates, would take a few tens of ms).
DEVICE_SWAP_BYTES_S = 32e9

# --- Costs around the GPUs: the trainer's publish, spot start-up, the weight service's egress.
# Both the emulation (trainer_svc.learn.compute_model, rollout_svc.engines.emu) and the simulator
# (sim) charge these, so the two cannot disagree on them.
#
# Publish of a new version = write the bf16 checkpoint, hash it (the weight service commits
# content hashes), upload it to the weight service. ASSUMPTIONS: a local NVMe write at
# ~2 GB/s (p5.48xlarge instance storage is NVMe SSD; one file stream reaches a few GB/s);
# sha256 at ~1.5 GB/s on one core with SHA-NI, over 8 parallel shards ~8 GB/s; the upload over
# the trainer's 100 Gb/s link at the same 12.5 GB/s line rate as a pull. Done one after the
# other, as the trainer does today.
CHECKPOINT_WRITE_BYTES_S = 2e9
CHECKPOINT_HASH_BYTES_S = 8e9
CHECKPOINT_UPLOAD_BYTES_S = 12.5e9
# The weight service's egress: one 100 Gb/s NIC (12.5 GB/s) shared by every concurrent pull;
# an instance that already holds the version serves peers at the same per-link rate.
WEIGHT_EGRESS_BYTES_S = 12.5e9
# A spot instance from the moment the cloud grants it until its engine can load weights.
# ASSUMPTIONS: ~60 s VM boot to a running container from a cached image (AWS documents GPU
# instances reaching "running" in about a minute, container start on top), ~30 s for SGLang to
# start, build CUDA graphs and register.
SPOT_BOOT_S = 60.0
ENGINE_START_S = 30.0


def publish_seconds(checkpoint_bytes: float) -> float:
    """The trainer's publish of one version: write, hash, upload, in sequence."""
    return checkpoint_bytes * (1 / CHECKPOINT_WRITE_BYTES_S + 1 / CHECKPOINT_HASH_BYTES_S
                               + 1 / CHECKPOINT_UPLOAD_BYTES_S)
