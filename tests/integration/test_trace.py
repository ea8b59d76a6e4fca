"""The spot traces are read as recorded, and the player makes real processes follow them."""

from __future__ import annotations

import csv
import signal
import sys
import time
from pathlib import Path

import pytest

from benchmarks.trace import FILES, TRACE_DIR, Trace, TracePlayer, load
from rlboost.launcher import Child


def test_traces_ship_with_their_licence() -> None:
    assert "MIT License" in (TRACE_DIR / "LICENSE-bamboo").read_text()
    for name in FILES.values():
        assert (TRACE_DIR / name).is_file()


def test_p3_counts_replay_the_event_log() -> None:
    trace = load("p3")
    # Replay the raw events independently: the count after the last event of each instant.
    alive: set[str] = set()
    after: dict[float, int] = {}
    for ms, event, node in csv.reader((TRACE_DIR / FILES["p3"]).open()):
        (alive.add if event == "add" else alive.discard)(node)
        after[int(ms) / 1000] = len(alive)
    assert len(after) > 100
    for at, count in after.items():
        assert trace.count_at(at) == count, at
    assert trace.count_at(trace.length_s + 1) == len(alive)
    assert max(trace.counts) == 32 and min(trace.counts) >= 0
    assert 11 * 3600 < trace.length_s < 12 * 3600  # traces/README.md's ~11.4 h
    assert all(a < b for a, b in zip(trace.times, trace.times[1:], strict=False))
    assert all(a != b for a, b in zip(trace.counts, trace.counts[1:], strict=False))


def test_gcp_series_and_g4dn_load() -> None:
    gcp = load("gcp")
    assert gcp.counts[0] == 55 and max(gcp.counts) <= 64
    assert load("g4dn").length_s > 3600
    with pytest.raises(ValueError, match="unknown trace"):
        load("azure")


def test_segment_and_compression_keep_the_shape() -> None:
    trace = Trace("t", [0.0, 100.0, 200.0, 300.0], [10, 4, 8, 2], 400.0)
    seg = trace.segment(150.0, 200.0)
    assert (seg.times, seg.counts, seg.length_s) == ([0.0, 50.0, 150.0], [4, 8, 2], 200.0)
    small = seg.compressed(10.0, 0.5)
    assert (small.times, small.counts, small.length_s) == ([0.0, 5.0, 15.0], [2, 4, 1], 20.0)
    assert trace.mean() == pytest.approx((10 + 4 + 8 + 2) / 4)
    with pytest.raises(ValueError):
        trace.segment(500.0, 10.0)


def sleeper(tmp_path: Path, started: list[Child]) -> Child:
    child = Child(f"s{len(started)}", [sys.executable, "-c", "import time; time.sleep(60)"], {},
                  tmp_path / f"s{len(started)}.log")
    child.start()
    started.append(child)
    return child


@pytest.mark.parametrize("removal, sig", [("notice", signal.SIGTERM), ("kill", signal.SIGKILL)])
def test_player_starts_and_removes_real_processes(
    tmp_path: Path, removal: str, sig: int
) -> None:
    started: list[Child] = []
    trace = Trace("t", [0.0, 0.4, 0.8], [3, 1, 2], 1.2)
    player = TracePlayer(trace, lambda _name: sleeper(tmp_path, started), wall_per_s=1.0,
                         removal=removal, seed=7)  # type: ignore[arg-type]
    try:
        t0 = player.start()
        time.sleep(1.0)
        player.stop()
        assert len(started) == 4  # 3, then down to 1, then one more
        time.sleep(0.3)
        alive = [c for c in started if c.alive()]
        assert len(alive) == 2
        gone = [c for c in started if not c.alive()]
        assert all(c.proc is not None and c.proc.returncode == -sig for c in gone)
        counts = [c for _, c in player.history]
        assert counts == [3, 1, 2]
        # 3 instances for 0.4 s, 1 for 0.4 s, 2 for 0.2 s, each of 2 GPUs: 2 * 2.0 = 4.0.
        assert player.gpu_seconds(t0, t0 + 1.0, 2) == pytest.approx(4.0, abs=0.25)
    finally:
        player.stop()
        for c in started:
            c.signal(signal.SIGKILL)
