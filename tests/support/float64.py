"""The float64 set-up of the trainer's reference tests: a tiny Qwen2 in float64, and its RMSNorm
kept in float64 (transformers casts the normalised hidden state back to float32 before the
weight multiply, which would cap every reference comparison at float32 precision).

Use: ``from tests.support.float64 import float64_rms_norm  # noqa: F401`` in a test module
(an autouse fixture), and :func:`model64` for the model.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import Qwen2ForCausalLM
from transformers.models.qwen2 import modeling_qwen2

from trainer_svc.embedded.tiny import tiny_config


def _rms_norm_in_input_dtype(self: modeling_qwen2.Qwen2RMSNorm,
                             hidden: torch.Tensor) -> torch.Tensor:
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture(autouse=True)
def float64_rms_norm(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", _rms_norm_in_input_dtype)
    yield


def model64(seed: int = 0) -> torch.nn.Module:
    """The tiny Qwen2 of the trainer's tests, seeded, in float64."""
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(tiny_config()).to(torch.float64)
