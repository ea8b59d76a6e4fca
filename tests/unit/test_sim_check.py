"""bench-sim-check's headline regime: what both sides share, and what it reads off an
emulated run (benchmarks.sim_check_regime, benchmarks.sim_check_measure). No services run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks.sim_check_measure import (
    REFILL_LINE,
    between_s,
    engine_mean,
    interval,
    modelled_tokens,
    report_s,
    reserved_update_s,
    spawned,
    spot_join_s,
    trainer_s_per_token,
)
from benchmarks.sim_check_regime import HostCosts, Regime
from rollout_svc.engines import GenRequest
from rollout_svc.engines.emu import EmuEngine
from shared.config import SETTINGS
from shared.settings import env_names
from trainer_svc.learn.compute_model import PRESETS

T0 = 1_800_000_000.0  # an epoch second; log lines carry local time


def stamp(t: float) -> str:
    import datetime as dt

    at = dt.datetime.fromtimestamp(t)
    return at.strftime("%Y-%m-%d %H:%M:%S,") + f"{at.microsecond // 1000:03d}"


def test_the_regime_scales_the_paper_batch_and_link() -> None:
    regime = Regime()
    assert regime.batch == 13  # 104 sequences of 8B in 80 GB, for 1/8 of the responses
    # The placeholder alone takes 16 GB / 12.5 GB/s = 1.28 emulated s, in wall seconds.
    assert 64 * 1024 / regime.egress_wall_bytes_s == pytest.approx(1.28 * regime.time_scale)
    assert regime.pull_alone_s() == pytest.approx(1.28 + 0.64)
    known = {name for cls in SETTINGS.values() for f in cls.model_fields.values()
             for name in env_names(f)}
    assert set(regime.env()) <= known
    with pytest.raises(ValueError):
        Regime(token_scale=100)


def test_the_simulator_gets_the_regime_and_the_measured_host_costs() -> None:
    regime = Regime()
    host = HostCosts(step_s=0.5e-3, trainer_s_per_token=10e-6, report_s=1.0, between_s=2.0,
                     control_s=3.0, reserved_update_s=4.0, spot_join_s=5.0)
    costs = regime.costs(host)
    assert costs.max_batch == 13 and costs.chunk_tokens == 4 * 128
    assert costs.peer_bytes_s == 0.0 and costs.context_aware
    assert costs.weight_bytes == 16e9 and costs.egress_bytes_s == 12.5e9
    assert costs.grace_s == 120.0 and costs.spot_start_s == 95.0
    assert (costs.host_step_s, costs.control_s, costs.report_s) == (0.5e-3, 3.0, 3.0)
    assert costs.serving.swap_s == 4.0
    spt = PRESETS["emu-8b"].seconds_per_token
    assert costs.compute.seconds_per_token == pytest.approx(spt + 10e-6)
    assert costs.serving.decode_s_base == regime.serving.decode_s_base


def test_modelled_tokens_are_what_the_engine_emits() -> None:
    regime = Regime(prompts=2, samples=3)
    total, emitted = modelled_tokens(regime, seed=5, step=2)
    engine = EmuEngine(time_scale=0.0, token_scale=regime.token_scale, true_context=True)
    engine.load(None, "run", 2)
    for p in range(2):
        for s in range(3):
            engine.add(GenRequest(
                request_id=f"{p}-{s}", prompt_token_ids=[5, 6, 7, 8], committed_token_ids=[],
                max_new_tokens=14336 // regime.token_scale, temperature=1.0, seed=5, step=2,
                prompt_index=p, sample_index=s, eos_token_id=2, weight_version=2))
    count = 0
    while engine.has_work():
        count += len(engine.step())
    assert count == emitted
    assert (emitted - 6) * regime.token_scale < total <= emitted * regime.token_scale


def test_reserved_update_waits_for_the_last_swap_before_the_barrier(tmp_path: Path) -> None:
    lines = [(T0 - 1.0, 3), (T0 + 0.5, 2), (T0 + 1.0, 3),  # announced early, reverted, back
             (T0 + 0.2, 3), (T0 + 50.0, 3)]  # the other instance; a revert after the barrier
    (tmp_path / "reserved.log").write_text("".join(
        f"{stamp(t)} rollout[reserved] INFO rollout: loaded run-x v{v}\n" for t, v in lines))
    record = {"step": 3, "started_at": T0, "rollout_s": 10.0, "finished_at": T0 + 60.0}
    assert reserved_update_s(tmp_path, [record], instances=2, scale=0.5) == \
        pytest.approx((2.0 + 0.4) / 2)


def test_spot_join_counts_grant_to_first_version_beyond_the_model(tmp_path: Path) -> None:
    history = [(T0 - 5, 1), (T0 + 1, 3), (T0 + 2, 2), (T0 + 3, 3)]  # warm, +2, -1, +1
    assert spawned(history) == {"spot-t1": T0 - 5, "spot-t2": T0 + 1, "spot-t3": T0 + 1,
                                "spot-t4": T0 + 3}
    for name, first in (("spot-t1", T0 - 2), ("spot-t2", T0 + 4), ("spot-t4", T0 + 5)):
        (tmp_path / f"{name}.log").write_text(
            f"{stamp(first)} rollout[{name}] INFO rollout: loaded run-x v1\n"
            f"{stamp(first + 9)} rollout[{name}] INFO rollout: loaded run-x v2\n")
    # spot-t1 is the warm-up's, spot-t3 never loaded: (3 s + 2 s) / 0.1 - 15 emulated s.
    assert spot_join_s(tmp_path, history, T0, T0 + 100, 0.1, 15.0) == pytest.approx(10.0)


def test_trainer_report_and_gaps_come_from_the_records() -> None:
    regime = Regime(prompts=2, samples=2)
    spt = PRESETS["emu-8b"].seconds_per_token
    tokens = 100 * regime.token_scale + 4 * regime.prompt_tokens
    modelled = tokens * spt + PRESETS["emu-8b"].optimizer_step_s + regime.setup(0).publish_s
    steps = [{"tokens": 100, "train_s": modelled + 2.0, "step_s": 50.0,
              "trainer_idle_s": 50.0 - modelled - 2.0 - 0.5}]
    assert trainer_s_per_token(steps, regime) == pytest.approx(2.0 / tokens)
    assert report_s(steps) == pytest.approx(0.5)
    records = [{"step": 1, "started_at": T0, "finished_at": T0 + 5},
               {"step": 2, "started_at": T0 + 5.2, "finished_at": T0 + 9},
               {"step": 3, "started_at": T0 + 9.4, "finished_at": T0 + 12}]
    assert between_s(records, scale=0.1) == pytest.approx(3.0)


def test_engine_means_are_weighted_by_their_counts(tmp_path: Path) -> None:
    line = "x rollout.emu: emu refill wait {} ms over {} refills\n"
    (tmp_path / "reserved.log").write_text(line.format("1000.0", 30) + line.format("4000.0", 10))
    (tmp_path / "manager.log").write_text(line.format("99999.0", 50))  # not an engine
    assert engine_mean(tmp_path, REFILL_LINE) == pytest.approx(1.75)


def test_interval_is_students_t() -> None:
    mean, half = interval([1.0, 1.1, 0.9])
    assert mean == pytest.approx(1.0)
    assert half == pytest.approx(4.303 * 0.1 / math.sqrt(3))
    assert interval([2.0]) == (2.0, 0.0)
