"""The emu engine in the paper regime: true-context decode, token scale, its meters; and the
emu trainer's side of the token scale. The simulator's engine (sim.engine) is the oracle of
what a batch costs."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from pathlib import Path

import pytest

from rollout_svc.engines import GenRequest
from rollout_svc.engines.emu import EmuEngine
from rollout_svc.engines.emu_meters import REFILL_BOUND_S, RefillMeter
from rollout_svc.engines.emu_models import response_length, serving_model
from sim import engine as sim_engine
from sim.config import Costs
from trainer_svc.learn.compute_model import PRESETS
from trainer_svc.learn.policies.emu import EmuPolicy
from trainer_svc.learn.step_trainer import Group

EOS = 2
M = 64  # token scale
BUDGET = 14336  # modelled tokens


def _req(i: int, committed: list[int] | None = None) -> GenRequest:
    return GenRequest(request_id=f"r{i}", prompt_token_ids=[5, 6, 7, 8],
                      committed_token_ids=committed or [], max_new_tokens=BUDGET // M,
                      temperature=1.0, seed=0, step=1, prompt_index=i // 4,
                      sample_index=i % 4, eos_token_id=EOS, weight_version=1)


def _engine(**options: object) -> EmuEngine:
    engine = EmuEngine(time_scale=0.0, true_context=True, token_scale=M,
                       **serving_model("emu-8b").engine_options(), **options)  # type: ignore[arg-type]
    engine.load(None, "run", 1)
    return engine


def _lengths(n: int) -> list[int]:
    """The modelled lengths the engine draws for _req(0..n-1)."""
    return [min(response_length(0, 1, i // 4, i % 4, 1, BUDGET / 4, 1.0), BUDGET)
            for i in range(n)]


def test_a_token_scaled_batch_costs_what_the_simulator_charges() -> None:
    """Modelled seconds of the whole batch and each response's end, against sim.engine's
    segments at true context over the same modelled lengths (more responses than slots)."""
    n, batch = 12, 5
    engine = _engine(max_batch=batch)
    for i in range(n):
        engine.add(_req(i))
    ends: dict[str, float] = {}
    emitted: dict[str, int] = {}
    while engine.has_work():
        for ev in engine.step():
            emitted[ev.request_id] = emitted.get(ev.request_id, 0) + 1
            if ev.finished:
                ends[ev.request_id] = engine.modelled_s
    costs = dataclasses.replace(Costs.paper("emu-8b"), max_batch=batch)
    inst = sim_engine.Instance("i", "reserved", batch, 0.0, state="ready")
    lengths = _lengths(n)
    for i, length in enumerate(lengths):
        inst.queue.append(sim_engine.Response(i // 4, i % 4, length, 4, i))
    now, sim_ends = 0.0, {}
    while (end := sim_engine.start_segment(inst, costs, now)) is not None:
        done, _ = sim_engine.advance(inst, end, cut=False)
        now = end
        sim_ends.update({r.index: now for r in done})
    assert engine.modelled_s == pytest.approx(now, rel=1e-3)
    for i, length in enumerate(lengths):
        assert emitted[f"r{i}"] == math.ceil(length / M)
        assert ends[f"r{i}"] == pytest.approx(sim_ends[i], rel=1e-3)


def test_a_scaled_response_ends_in_eos_or_at_the_budget() -> None:
    engine = _engine(max_batch=64)
    for i in range(40):
        engine.add(_req(i))
    last: dict[str, tuple[int, str | None]] = {}
    while engine.has_work():
        for ev in engine.step():
            if ev.finished:
                last[ev.request_id] = (ev.position, ev.finish_reason)
    for i, length in enumerate(_lengths(40)):
        position, reason = last[f"r{i}"]
        assert position == math.ceil(length / M) - 1
        natural = response_length(0, 1, i // 4, i % 4, 1, BUDGET / 4, 1.0)
        assert reason == ("length" if natural > BUDGET else "stop")


def test_a_resumed_response_is_charged_at_its_context() -> None:
    """Committed tokens count token_scale each: the re-prefill and the KV reads after it."""
    fresh, resumed = _engine(), _engine()
    fresh.add(_req(0))
    resumed.add(_req(0, committed=[100] * 10))
    fresh.step()
    resumed.step()
    model = serving_model("emu-8b")
    extra_prefill = model.prefill_s_per_token * 10 * M
    extra_kv = model.decode_s_per_seq / 4096 * 10 * M * M  # 10*M more context, M steps
    assert resumed.modelled_s - fresh.modelled_s == pytest.approx(extra_prefill + extra_kv,
                                                                  rel=1e-6)


def test_an_arrival_cuts_a_scaled_step_at_the_next_decode_step() -> None:
    """A request that arrives while a slot is free joins at the next decode-step boundary,
    not after the whole token's worth of steps."""
    engine = EmuEngine(time_scale=1.0, decode_s_base=0.01, decode_s_per_seq=0.0,
                       prefill_s_per_token=0.0, load_s=0.0, token_scale=1000, max_batch=4,
                       mean_len=1e6)
    engine.load(None, "run", 1)
    engine.add(_req(0))
    threading.Timer(0.1, engine.add, args=(_req(1),)).start()
    start = time.monotonic()
    engine.step()  # 1000 decode steps of 10 ms unless cut
    took = time.monotonic() - start
    assert 0.1 <= took < 0.5
    assert engine.modelled_s == pytest.approx(round(took / 0.01) * 0.01, abs=0.015)


def test_the_refill_meter_counts_waits_for_work_not_for_a_step() -> None:
    meter = RefillMeter(time_scale=0.5)
    meter.freed(100.0, 2)
    meter.filled(100.2)  # a round trip of 0.2 s wall: 0.4 s emulated
    meter.filled(100.2 + REFILL_BOUND_S)  # waited a training phase: not a refill
    meter.filled(200.0)  # nothing was waiting
    assert meter.refills == 1 and meter.wait_s == pytest.approx(0.2)


def test_the_engine_meters_refills_of_its_freed_slots(caplog: pytest.LogCaptureFixture) -> None:
    engine = EmuEngine(time_scale=1e-3, true_context=True, token_scale=M, max_batch=2,
                       **serving_model("emu-8b").engine_options())  # type: ignore[arg-type]
    engine.load(None, "run", 1)
    engine.add(_req(0))
    while engine.has_work():
        engine.step()
    time.sleep(0.002)  # the control plane's round trip: 2 emulated seconds
    engine.add(_req(1))
    assert engine.refill.refills == 1
    with caplog.at_level("INFO", logger="rollout.emu"):
        engine.drain()
    [line] = [r.getMessage() for r in caplog.records if "refill" in r.getMessage()]
    assert line.endswith("ms over 1 refills")
    assert 2000 <= float(line.split()[3]) < REFILL_BOUND_S * 1e3


def test_the_emu_trainer_trains_token_scaled_responses(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    preset = PRESETS["emu-8b"]
    policy = EmuPolicy(preset, tmp_path, time_scale=0.5, token_scale=M)
    group = Group(prompt_index=0, prompts=[[1, 2, 3, 4]] * 2, responses=[[9] * 10, [9] * 3],
                  rewards=[0.0, 1.0], truncated=[False, False])
    policy.add_group(group)
    assert slept == [pytest.approx(0.5 * (8 + M * 13) * preset.seconds_per_token)]
