"""The trainer's experiment trackers, read back with each tracker's own reader."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from trainer_svc.trackers import Trackers, metrics_of, mlflow_store

pytest.importorskip("tensorboard", reason="the dev extra installs tensorboard")
pytest.importorskip("mlflow", reason="the dev extra installs mlflow-skinny")


def record(step: int) -> dict[str, object]:
    return {"step": step, "reward_mean": 0.1 * step, "tokens": 100, "step_s": 2.0,
            "seeding_mode": "adaptive", "started_at": 1e9, "migrations": step, "kl": None,
            "eval_reward_mean": 0.5 + step}


def test_every_numeric_field_is_a_metric() -> None:
    got = metrics_of(record(3))
    assert got == {"reward_mean": pytest.approx(0.3), "tokens": 100.0, "step_s": 2.0,
                   "migrations": 3.0, "eval_reward_mean": 3.5, "tokens_per_s": 50.0}


def test_tensorboard_and_mlflow_hold_every_step_across_a_restart(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    spec = {"steps": 4, "seeding": {"mode": "off"}}
    trackers, warnings = Trackers.open(["tensorboard", "mlflow"], tmp_path, "run-x", spec)
    assert warnings == [] and set(trackers.sinks) == {"tensorboard", "mlflow"}
    for step in range(2):
        assert trackers.log(step, record(step)) == []
    trackers.close(finished=False)  # the trainer restarts here
    trackers, _ = Trackers.open(["tensorboard", "mlflow"], tmp_path, "run-x", spec)
    for step in range(2, 4):
        trackers.log(step, record(step))
    trackers.close(finished=True)

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    rewards = {e.step: e.value for e in events.Scalars("reward_mean")}
    assert rewards == {s: pytest.approx(0.1 * s) for s in range(4)}
    assert {e.step for e in events.Scalars("eval_reward_mean")} == {0, 1, 2, 3}

    client = mlflow_store(tmp_path / "mlflow")
    runs = client.search_runs([client.get_experiment_by_name("rlboost").experiment_id])
    assert len(runs) == 1 and runs[0].info.run_name == "run-x"  # one run, appended to
    assert runs[0].info.status == "FINISHED" and runs[0].data.params["seeding.mode"] == "off"
    history = client.get_metric_history(runs[0].info.run_id, "reward_mean")
    assert sorted((m.step, round(m.value, 6)) for m in history) == [
        (s, round(0.1 * s, 6)) for s in range(4)]


def test_a_tracker_that_cannot_start_is_a_warning_not_a_failure(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    trackers, warnings = Trackers.open(["tensorboard", "mlflow"], blocked, "run-y", {})
    assert trackers.sinks == {} and len(warnings) == 2
    assert all("did not start" in w for w in warnings)
    if importlib.util.find_spec("wandb") is None:
        _, warnings = Trackers.open(["wandb"], tmp_path, "run-y", {})
        assert warnings and "rlboost[wandb]" in warnings[0]
    assert trackers.log(0, record(0)) == []  # nothing to log to, nothing fails
