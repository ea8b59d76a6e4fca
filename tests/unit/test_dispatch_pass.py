"""Which dispatch passes may skip reading the instances: those with nothing pending and no
seeding work on the step (manager_svc.dispatcher.window_work)."""

from __future__ import annotations

import time

import pytest

from manager_svc.dispatcher import window_work


def info(mode: str, window_left_s: float, handed_off: bool) -> dict[str, str]:
    out = {"mode": mode, "window_end": str(time.time() + window_left_s)}
    if handed_off:
        out["handoff_at"] = str(time.time())
    return out


@pytest.mark.parametrize(("mode", "window_left_s", "handed_off", "work"), [
    ("off", 30.0, False, False),  # no seeding: nothing but leasing
    ("fixed", 30.0, False, False),  # a fixed window open: it only waits
    ("adaptive", 30.0, False, True),  # an adaptive one follows the spot count
    ("fixed", -1.0, False, True),  # closed, not handed off: the hand-off is due
    ("adaptive", -1.0, False, True),
    ("fixed", -1.0, True, False),  # handed off: nothing more to do
    ("adaptive", -1.0, True, False),
])
def test_window_work(mode: str, window_left_s: float, handed_off: bool, work: bool) -> None:
    assert window_work(info(mode, window_left_s, handed_off)) is work


def test_a_step_hash_without_seeding_fields_has_no_window_work() -> None:
    assert window_work({}) is False
