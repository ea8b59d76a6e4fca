"""Experiment trackers: a run's step records, logged offline to tensorboard, mlflow and wandb.

Contract: :meth:`Trackers.open` starts each tracker the run spec names (``trackers``); each is
an optional extra (``rlboost[tensorboard]``, ``[mlflow]``, ``[wandb]``) imported here and only
when named. A tracker that fails to start (not installed, a bad configuration, a directory it
cannot write) is left out and its reason returned as a warning: the run goes on without it.
:meth:`Trackers.log` logs every numeric field of a finished step's record, the one the manager
serves (rewards and eval rewards, timings, counters, the trainer's own figures) plus
``tokens_per_s``, at that step; a tracker that fails then is dropped, with a warning, and the
others go on. Everything is offline, under ``<data dir>/trackers/<run id>/``:
``tensorboard/`` (event files), ``mlflow/`` (an mlflow file store: experiment ``rlboost``, one
mlflow run named after the run id, whose mlflow id is kept in ``mlflow/run_id`` so a restarted
trainer appends to the same one) and ``wandb/`` (an offline wandb run with the run id as its
id, resumed after a restart; ``wandb sync`` uploads it later). The trackers' calls block on
files, so callers run these methods in a thread.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("trainer")
# Times, not figures: a tracker plots them against the step anyway.
NOT_LOGGED = {"step", "started_at", "finished_at"}
INSTALL_HINT = {"tensorboard": "rlboost[tensorboard]", "mlflow": "rlboost[mlflow]",
                "wandb": "rlboost[wandb]"}


class Sink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self, finished: bool) -> None: ...


class TensorboardSink:
    def __init__(self, root: Path, run_id: str, params: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(root / "tensorboard"))
        self.writer.add_text("run", f"{run_id}: {params}")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a reader (or a person) sees each step as soon as it is logged

    def close(self, finished: bool) -> None:
        self.writer.close()


def mlflow_store(store: Path) -> Any:
    """An ``MlflowClient`` on the file store at ``store`` (also for reading one back)."""
    # The file store is in maintenance mode upstream and refuses to open unless allowed; it is
    # the one mlflow store that needs no database server and no extra packages.
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=store.resolve().as_uri())


class MlflowSink:
    def __init__(self, root: Path, run_id: str, params: dict[str, Any]) -> None:
        store = root / "mlflow"
        store.mkdir(parents=True, exist_ok=True)
        self.client = mlflow_store(store)
        from mlflow.entities import Metric

        self.metric = Metric
        id_file = store / "run_id"
        if id_file.exists():
            self.run_id = id_file.read_text().strip()
            return
        experiment = self.client.get_experiment_by_name("rlboost")
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment("rlboost"))
        run = self.client.create_run(experiment_id, run_name=run_id, tags={"rlboost.run": run_id})
        self.run_id = run.info.run_id
        for key, value in params.items():
            self.client.log_param(self.run_id, key, str(value)[:500])
        id_file.write_text(self.run_id)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[
            self.metric(key, value, now, step) for key, value in metrics.items()])

    def close(self, finished: bool) -> None:
        if finished:
            self.client.set_terminated(self.run_id, "FINISHED")


class WandbSink:
    def __init__(self, root: Path, run_id: str, params: dict[str, Any]) -> None:
        import wandb

        (root / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project="rlboost", id=run_id, name=run_id, dir=str(root / "wandb"),
                              mode="offline", resume="allow", config=params)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


SINKS: dict[str, Callable[[Path, str, dict[str, Any]], Sink]] = {
    "tensorboard": TensorboardSink, "mlflow": MlflowSink, "wandb": WandbSink}


def flat(spec: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A run spec as tracker parameters: nested fields as dotted names."""
    out: dict[str, Any] = {}
    for key, value in spec.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def metrics_of(record: dict[str, Any]) -> dict[str, float]:
    """Every numeric field of a step record, plus the step's throughput."""
    out = {k: float(v) for k, v in record.items() if k not in NOT_LOGGED
           and isinstance(v, int | float) and not isinstance(v, bool)}
    if out.get("step_s", 0.0) > 0 and "tokens" in out:
        out["tokens_per_s"] = out["tokens"] / out["step_s"]
    return out


class Trackers:
    """The trackers of one run on this trainer."""

    def __init__(self, sinks: dict[str, Sink]) -> None:
        self.sinks = sinks

    @classmethod
    def open(cls, names: list[str], root: Path, run_id: str,
             spec: dict[str, Any]) -> tuple[Trackers, list[str]]:
        sinks: dict[str, Sink] = {}
        warnings: list[str] = []
        for name in dict.fromkeys(names):
            try:
                sinks[name] = SINKS[name](root, run_id, flat(spec))
                log.info("run %s: logging to %s under %s", run_id, name, root)
            except Exception as exc:  # any failure of an optional extra: the run goes on
                hint = f" (pip install '{INSTALL_HINT[name]}')" \
                    if isinstance(exc, ImportError) else ""
                warnings.append(f"tracker {name} did not start: "
                                f"{type(exc).__name__}: {exc}{hint}")
                log.warning("run %s: %s", run_id, warnings[-1])
        return cls(sinks), warnings

    def log(self, step: int, record: dict[str, Any]) -> list[str]:
        metrics = metrics_of(record)
        warnings: list[str] = []
        for name, sink in list(self.sinks.items()):
            try:
                sink.log(step, metrics)
            except Exception as exc:
                warnings.append(f"tracker {name} stopped at step {step}: "
                                f"{type(exc).__name__}: {exc}")
                log.warning("%s", warnings[-1])
                self._close_one(name, finished=False)
        return warnings

    def close(self, finished: bool) -> None:
        for name in list(self.sinks):
            self._close_one(name, finished)

    def _close_one(self, name: str, finished: bool) -> None:
        sink = self.sinks.pop(name)
        try:
            sink.close(finished)
        except Exception as exc:
            log.warning("tracker %s did not close cleanly: %r", name, exc)
