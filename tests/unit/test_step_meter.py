"""The step meter: a resident-set peak that sees tensor storage and starts again each step."""

from __future__ import annotations

import sys

import pytest
import torch

from trainer_svc.learn.step_meter import PeakMemory, StepMeter

MIB = 1 << 20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc's VmHWM")
def test_peak_sees_a_freed_tensor_and_resets() -> None:
    memory = PeakMemory()
    memory.reset()
    before = memory.peak_bytes()
    big = torch.ones(64 * MIB // 4)  # 64 MiB, touched: resident
    del big
    peak = memory.peak_bytes()
    assert peak - before >= 60 * MIB  # tracemalloc would report ~0 here
    memory.reset()
    assert memory.peak_bytes() < peak - 32 * MIB  # the freed tensor no longer counts


def test_meter_reports_tokens_over_timed_seconds() -> None:
    meter = StepMeter()
    meter.reset()
    with meter.timed():
        torch.ones(1000).sum()
    stats = meter.finish({"tokens": 100})
    assert stats["tokens_per_s_train"] == pytest.approx(100 / meter.busy_s)
    assert stats["peak_memory_bytes"] > 0
    meter.reset()
    assert meter.finish({"tokens": 5})["tokens_per_s_train"] == 0.0  # nothing timed
