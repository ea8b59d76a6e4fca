"""bench-trainer's arithmetic: the time by phase and the activation figure it prints.

The benchmark itself takes ~10 minutes (``make bench-trainer``); what it computes from its
measurements is checked here with a fake clock and made-up rows, so a wrong attribution cannot
hide behind figures nobody can recompute.
"""

from __future__ import annotations

import threading

import pytest

from benchmarks.trainer import activation, by_length
from benchmarks.trainer_rank import SHORT, PhaseClock


class _Clock:
    """Time that moves only when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_nested_range_counts_for_itself_not_its_parent() -> None:
    now = _Clock()
    clock = PhaseClock(now)
    # The root's final callback (fsdp other) runs a unit's post-backward (reduce) inside it.
    clock.enter("fsdp other")
    now.now += 1.0
    clock.enter("reduce")
    now.now += 3.0
    clock.exit()
    now.now += 0.5
    clock.exit()

    def optimizer_step() -> None:
        now.now += 2.0

    clock.wrap("optimizer", optimizer_step)()
    assert clock.cpu["fsdp other"] == pytest.approx(1.5)
    assert clock.cpu["reduce"] == pytest.approx(3.0)
    assert clock.cpu["optimizer"] == pytest.approx(2.0)
    clock.reset()
    assert sum(clock.cpu.values()) == 0.0


def test_other_threads_are_not_timed() -> None:
    now = _Clock()
    clock = PhaseClock(now)

    def elsewhere() -> None:
        clock.enter("reduce")
        now.now += 5.0
        clock.exit()

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert clock.cpu["reduce"] == 0.0


def test_activation_is_the_peak_over_the_baseline_step() -> None:
    gib = 2**30
    result = {"base": gib // 4, "steps": [
        {"length": SHORT, "peak": 3 * gib},  # warm-up: AdamW's state is created here
        {"length": SHORT, "peak": 2 * gib},
        {"length": 1024, "peak": 5 * gib},
        {"length": 4096, "peak": 9 * gib},
        {"length": 4096, "peak": 10 * gib},  # a second step at a length: the last one counts
    ]}
    rows = by_length(result)
    assert sorted(rows) == [SHORT, 1024, 4096]
    assert activation(rows, SHORT) == 0
    assert activation(rows, 1024) == 3 * gib
    assert activation(rows, 4096) == 8 * gib
