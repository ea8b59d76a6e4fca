"""EMULATION: what training a model class costs on the reserved GPUs, without torch.

Contract: pure arithmetic on :mod:`shared.hardware`, importable without torch, so the
discrete-event simulator (:mod:`sim`) charges exactly what the emulated trainer
(:class:`~trainer_svc.learn.policies.emu.EmuPolicy`) sleeps. :data:`PRESETS` names the model
classes a run spec's ``model`` may ask for.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.hardware import H100_BF16_FLOPS, H100_HBM_BYTES_S


@dataclass(frozen=True, slots=True)
class ComputeModel:
    """Modelled training cost of a model class on reserved GPUs (see PRESETS for sources)."""

    name: str
    params: float  # parameters
    gpus: int  # reserved GPUs training it
    mfu: float  # model FLOPs utilisation reached by the training framework
    peak_flops: float = H100_BF16_FLOPS  # per GPU
    checkpoint_bytes: int = 64 * 1024  # size of the placeholder weights actually transferred

    @property
    def seconds_per_token(self) -> float:
        # 6*N FLOPs per token for forward + backward (Kaplan et al. 2020), plus 2*N for the
        # recomputed old log-probs of GRPO's ratio: 8*N per trained token.
        return 8 * self.params / (self.gpus * self.peak_flops * self.mfu)

    @property
    def optimizer_step_s(self) -> float:
        # AdamW touches params, grads and two moments in fp32: 16 bytes/param, sharded over
        # the GPUs at their HBM bandwidth each, taken at 50 % efficiency.
        return 16 * self.params / (self.gpus * H100_HBM_BYTES_S * 0.5)


# MFU 0.35-0.40 is what Megatron/FSDP report for dense 8B-32B training on H100 clusters.
PRESETS: dict[str, ComputeModel] = {
    "emu": ComputeModel("emu", params=8e9, gpus=8, mfu=0.35),
    "emu-8b": ComputeModel("emu-8b", params=8e9, gpus=8, mfu=0.35),
    "emu-14b": ComputeModel("emu-14b", params=14e9, gpus=8, mfu=0.37),
    "emu-32b": ComputeModel("emu-32b", params=32e9, gpus=8, mfu=0.40),
}
