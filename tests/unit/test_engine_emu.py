"""EmuEngine: tokens and lengths are pure functions of the request, whatever the batching."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rollout_svc.engines import EngineError, GenRequest, TokenEvent, create_engine
from rollout_svc.engines.emu import EmuEngine

EOS = 2


def _req(p: int, s: int = 0, committed: list[int] | None = None, **kw: object) -> GenRequest:
    fields: dict[str, object] = dict(
        request_id=f"p{p}s{s}",
        prompt_token_ids=list(range(5, 5 + p % 9 + 1)),
        committed_token_ids=committed or [],
        max_new_tokens=64,
        temperature=1.0,
        seed=3,
        step=1,
        prompt_index=p,
        sample_index=s,
        eos_token_id=EOS,
        weight_version=1,
    )
    fields.update(kw)
    return GenRequest(**fields)  # type: ignore[arg-type]


def _engine(version: int = 1, **options: object) -> EmuEngine:
    engine = EmuEngine(time_scale=0.0, **options)  # type: ignore[arg-type]
    engine.load(None, "run", version)
    return engine


def _collect(engine: EmuEngine, out: dict[str, list[TokenEvent]]) -> None:
    for event in engine.step():
        out.setdefault(event.request_id, []).append(event)


def _tokens(events: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in events]


def test_tokens_do_not_depend_on_batching_or_join_time() -> None:
    reqs = [_req(p, s) for p in range(12) for s in range(2)]
    oracle = _engine()
    # Small batches, requests trickling in one per step, some waiting for a free slot.
    engine = _engine(max_batch=5)
    out: dict[str, list[TokenEvent]] = {}
    for req in reqs:
        engine.add(req)
        _collect(engine, out)
    while engine.has_work():
        _collect(engine, out)
    for req in reqs:
        events = out[req.request_id]
        assert _tokens(events) == oracle.expected_tokens(req)
        assert [e.position for e in events] == list(range(len(events)))
        assert [e.finished for e in events].count(True) == 1 and events[-1].finished
        last = events[-1]
        assert (last.finish_reason == "stop") == (last.token_id == EOS)
        assert EOS not in _tokens(events[:-1])


def test_resume_from_any_committed_prefix() -> None:
    engine = _engine()
    for p in range(6):
        full = engine.expected_tokens(_req(p))
        for k in range(1, len(full) + 1):
            moved = _req(p, committed=full[:k], request_id=f"p{p}@{k}")
            engine.add(moved)
            events: list[TokenEvent] = []
            while engine.has_work():
                events += engine.step()
            if k == len(full):  # already complete: one closing event for the last token
                assert [(e.position, e.token_id, e.finished) for e in events] == [
                    (k - 1, full[-1], True)
                ]
            else:
                assert _tokens(events) == full[k:]
                assert events[0].position == k


def _run_all(engine: EmuEngine, req: GenRequest) -> list[TokenEvent]:
    engine.add(req)
    events: list[TokenEvent] = []
    while engine.has_work():
        events += engine.step()
    return events


def test_logprobs_are_a_pure_function_of_key_position_and_token() -> None:
    engine = _engine()
    full = {p: _run_all(engine, _req(p)) for p in range(6)}
    values = [e.logprob for events in full.values() for e in events]
    assert all(v is not None and math.isfinite(v) and -37.0 < v < 0.0 for v in values)
    assert len(set(values)) == len(values)  # not a constant: one draw per (position, token)
    assert -1.5 < statistics.mean(v for v in values if v is not None) < -0.5  # -Exp(1)
    assert full[0][-1].token_id == EOS and full[0][-1].logprob is not None  # EOS has one too
    # A migrated response: another instance resumes from any committed prefix and reports the
    # same log-prob at every position; the already-finished closing event reports none.
    other = _engine()
    for p, events in full.items():
        ids = _tokens(events)
        for k in range(1, len(ids) + 1):
            moved = _run_all(other, _req(p, committed=ids[:k], request_id=f"p{p}@{k}"))
            if k == len(ids):
                assert [e.logprob for e in moved] == [None]
            else:
                assert [e.logprob for e in moved] == [e.logprob for e in events[k:]]
    # The weights, the position and the token each change it.
    req = _req(0)
    base = EmuEngine.logprob_at(req, 3, 17)
    assert base != EmuEngine.logprob_at(_req(0, weight_version=2), 3, 17)
    assert base != EmuEngine.logprob_at(req, 4, 17) and base != EmuEngine.logprob_at(req, 3, 18)


def test_logprobs_are_the_same_in_another_process() -> None:
    """No per-process salt (Python's hash() is one, under PYTHONHASHSEED)."""
    here = [EmuEngine.logprob_at(_req(p, s), pos, 100 + pos)
            for p in range(3) for s in range(2) for pos in (0, 7)]
    code = (
        "import json, sys; from rollout_svc.engines import GenRequest;"
        "from rollout_svc.engines.emu import EmuEngine;"
        "print(json.dumps([EmuEngine.logprob_at(GenRequest(f'p{p}s{s}', [5], [], 64, 1.0, 3, 1,"
        " p, s, 2, 1), pos, 100 + pos) for p in range(3) for s in range(2) for pos in (0, 7)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "12345"}, cwd=Path(__file__).parents[2])
    assert json.loads(out.stdout) == here


def test_lengths_are_long_tailed() -> None:
    engine = _engine()
    budget = 1024
    reqs = [_req(p, s, max_new_tokens=budget) for p in range(1000) for s in range(2)]
    lengths = [min(engine.natural_length(r), budget) for r in reqs]
    assert statistics.median(lengths) < 0.5 * budget
    assert 10 <= lengths.count(budget) <= 200  # a tail into the budget, not a wall
    assert statistics.mean(lengths) > 1.3 * statistics.median(lengths)  # right-skewed
    for req, length in zip(reqs[:40], lengths, strict=False):  # the oracle agrees
        tokens = engine.expected_tokens(req)
        assert len(tokens) == length
        assert (tokens[-1] == EOS) == (engine.natural_length(req) <= budget)
    capped = _engine(max_len_cap=100)
    assert max(capped.natural_length(r) for r in reqs) == 100


def test_weight_version_changes_tokens_and_is_enforced() -> None:
    v1, v2 = _engine(1), _engine(2)
    a = [v1.expected_tokens(_req(p)) for p in range(20)]
    b = [v2.expected_tokens(_req(p, weight_version=2)) for p in range(20)]
    assert all(x != y for x, y in zip(a, b, strict=True))
    with pytest.raises(EngineError):
        v1.add(_req(0, weight_version=2))
    v1.add(_req(0))
    with pytest.raises(EngineError):
        v1.load(None, "run", 2)  # not under queued work
    assert v1.drain() == ["p0s0"]
    v1.load(None, "run", 2)
    assert v1.loaded == ("run", 2)


def test_time_scale_zero_is_instant_and_one_sleeps_the_model() -> None:
    engine = _engine()
    for p in range(50):
        engine.add(_req(p, max_new_tokens=256))
    start = time.perf_counter()
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    assert steps > 20 and time.perf_counter() - start < 2.0
    slow = EmuEngine(time_scale=1.0, decode_s_base=0.02, decode_s_per_seq=0.01, load_s=0.0)
    slow.load(None, "run", 1)
    slow.add(_req(0))
    slow.add(_req(1))
    start = time.perf_counter()
    slow.step()
    assert time.perf_counter() - start >= 0.02 + 0.01 * 2


def test_abort_and_drain_from_another_thread() -> None:
    engine = EmuEngine(
        time_scale=1.0, decode_s_base=0.005, decode_s_per_seq=0.0, load_s=0.0, mean_len=1e9
    )
    engine.load(None, "run", 1)
    for p in range(4):
        engine.add(_req(p, max_new_tokens=10_000))  # outlives the test: only drain ends it
    seen: list[TokenEvent] = []
    aborted = threading.Event()
    after_abort: list[TokenEvent] = []

    def worker() -> None:
        while engine.has_work():
            events = engine.step()
            (after_abort if aborted.is_set() else seen).extend(events)

    thread = threading.Thread(target=worker)
    thread.start()
    time.sleep(0.05)
    engine.abort("p1s0")
    aborted.set()
    time.sleep(0.05)
    assert sorted(engine.drain()) == ["p0s0", "p2s0", "p3s0"]
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert "p1s0" in {e.request_id for e in seen}
    assert "p1s0" not in {e.request_id for e in after_abort}
    assert {e.request_id for e in after_abort} == {"p0s0", "p2s0", "p3s0"}


def test_create_engine_builds_emu() -> None:
    engine = create_engine("emu", time_scale=0.0, load_s=0.0)
    engine.load(None, "run", 7)
    assert engine.name == "emu" and engine.loaded == ("run", 7)


def test_host_meter_counts_busy_steps_beyond_their_sleep(caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    from rollout_svc.engines.emu_meters import HOST_LOG_STEPS, HostMeter

    meter = HostMeter(time_scale=2.0)
    meter.begin(100.0)
    meter.slept(0.050)  # a busy step: 50 ms of modelled sleep (wall)
    meter.begin(100.060)  # started 60 ms later: 10 ms of host time
    assert meter.steps == 1 and meter.host_s == pytest.approx(0.010)
    with caplog.at_level("INFO", logger="rollout.emu"):
        meter.idle()  # the batch ran empty: the stretch so far is logged, 10 ms / 2
    assert [r.getMessage() for r in caplog.records] == [
        "emu host time 5.000 ms per decode step over 1 steps"]
    caplog.clear()
    meter.begin(104.0)  # after a wait for work (a training phase): not host time
    assert meter.steps == 0 and meter.host_s == 0
    meter.begin(105.0)  # the step before slept nothing: the gap is not host time either
    assert meter.steps == 0
    with caplog.at_level("INFO", logger="rollout.emu"):
        t = 105.0
        for _ in range(HOST_LOG_STEPS):
            meter.slept(0.050)
            t += 0.054  # 4 ms wall over each sleep from here on
            meter.begin(t)
    # One block of HOST_LOG_STEPS steps of 4 ms logged, halved into emulated ms by the time
    # scale.
    want = 4 / 2
    lines = [r.getMessage() for r in caplog.records if "emu host time" in r.getMessage()]
    assert lines == [f"emu host time {want:.3f} ms per decode step over {HOST_LOG_STEPS} steps"]
    assert meter.steps == 0 and meter.host_s == 0  # the block was logged and cleared


def test_a_stalled_engine_stops_producing_and_counting_steps() -> None:
    """RLBOOST_EMU_STALL_AFTER_S: after it, steps return nothing and the decode-step count the
    heartbeat carries stops, while the requests stay queued (a hung GPU, not a crash)."""
    engine = _engine(stall_after_s=0.15)
    engine.add(_req(1, max_new_tokens=10_000))
    assert engine.step() and engine.decode_steps == 1
    time.sleep(0.2)
    counted = engine.decode_steps
    for _ in range(3):
        assert engine.step() == []
    assert engine.decode_steps == counted and engine.has_work()


def test_a_slowed_engine_takes_factor_times_as_long_per_step_until_drained() -> None:
    """RLBOOST_EMU_SLOW_AFTER_S and _FACTOR: the modelled step is multiplied; drain() cuts a
    slowed step short so the process can still leave."""
    engine = EmuEngine(time_scale=1.0, slow_after_s=0.0, slow_factor=1000.0)
    engine.load(None, "run", 1)
    engine.add(_req(1, max_new_tokens=10_000))
    stepping = threading.Thread(target=engine.step)
    started = time.monotonic()
    stepping.start()
    stepping.join(timeout=0.5)
    assert stepping.is_alive()  # one step is >= 10 s now (10 ms base x 1000)
    engine.drain()
    stepping.join(timeout=2.0)
    assert not stepping.is_alive() and time.monotonic() - started < 3.0


def _run(engine: EmuEngine, req: GenRequest) -> list[TokenEvent]:
    out: dict[str, list[TokenEvent]] = {}
    engine.add(req)
    while engine.has_work():
        _collect(engine, out)
    return out[req.request_id]


def test_each_model_turn_after_an_observation_has_its_own_length() -> None:
    """An agentic response: the turn after an emu observation (ending in its turn mark) starts
    after it, with a length of its own keyed by that start, and ends in EOS; its tokens are
    those of their positions, on any engine, resumed from anywhere inside the turn."""
    from shared.turns import EMU_TURN_MARK
    from trainer_svc.agentic import EmuTurns

    first = _run(_engine(), _req(4, max_new_tokens=400))
    assert first[-1].finish_reason == "stop"
    observation = EmuTurns().observation("an answer", turn_end=first[-1].token_id)
    assert observation[-1] == EMU_TURN_MARK and EMU_TURN_MARK not in observation[:-1]
    assert observation == EmuTurns().observation("an answer", turn_end=0)  # pure
    committed = _tokens(first) + observation
    second = _run(_engine(), _req(4, committed=committed, max_new_tokens=400))
    start = len(committed)
    assert second[0].position == start and second[-1].token_id == EOS
    engine = _engine()
    assert engine.turn_start(_req(4, committed=committed)) == start
    assert second[-1].position + 1 == engine.natural_length(
        _req(4, committed=committed, max_new_tokens=400))
    assert [e.token_id for e in second[:-1]] == [
        engine.token_at(_req(4), e.position) for e in second[:-1]]
    # Resumed halfway through the turn, elsewhere: the same rest.
    half = len(second) // 2
    resumed = _run(_engine(), _req(4, committed=committed + _tokens(second[:half]),
                                   max_new_tokens=400))
    assert _tokens(resumed) == _tokens(second[half:])
    # Another start, another length (the first turn's own is unchanged: the tests above).
    lengths = {engine.natural_length(_req(p, committed=[9] * k + [EMU_TURN_MARK])) - k - 1
               for p in range(3) for k in range(8)}
    assert len(lengths) > 4
