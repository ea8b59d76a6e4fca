"""Seeing a run, end to end: one real run (torch engine, 1 reserved + 2 spot instances, API
token on) with every tracker asked for and one spot instance preempted (SIGTERM) mid-run.

While it runs, ``rlboost watch`` follows it in a pseudo-terminal and must exit by itself on
the final step. Then: the dashboard in headless Chromium shows one reward point per step and
the preempted spot instance, with no console error; tensorboard's and mlflow's own readers find
every step's reward_mean; a tracker that cannot start (wandb, where it is not installed) is a
warning on the run, not a failure; and every metric the Grafana dashboard uses is served by
the stack's /metrics.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pty
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlboost.launcher import Cluster
from rlboost.stack import Stack
from tests.support.browser import chromium, log_in, page_errors
from tests.support.cluster import start_cluster, wait_run
from trainer_svc.trackers import mlflow_store

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "observe-s3cret"
SPEC = {"steps": 6, "prompts_per_step": 8, "samples_per_prompt": 4, "seed": 2,
        "trackers": ["tensorboard", "mlflow", "wandb"]}
# Where the run page's screenshot goes when asked (it is committed under docs/).
SCREENSHOT_ENV = "RLBOOST_SCREENSHOT_TO"


@dataclass
class Watched:
    """``rlboost watch`` under a pseudo-terminal: what it drew, and how it ended."""

    proc: subprocess.Popen[bytes]
    master: int
    out: bytearray = field(default_factory=bytearray)

    def pump(self) -> None:
        with contextlib.suppress(OSError):  # EIO: the terminal's other side closed
            while chunk := os.read(self.master, 4096):
                self.out += chunk

    def text(self) -> str:
        return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", self.out.decode(errors="replace"))


def watch_in_pty(cluster: Cluster, run_id: str) -> tuple[Watched, threading.Thread]:
    master, slave = pty.openpty()
    env = {**os.environ, "RLBOOST_MANAGER_URL": cluster.env["RLBOOST_MANAGER_URL"],
           "RLBOOST_API_TOKEN": TOKEN, "TERM": "xterm-256color", "COLUMNS": "110",
           "LINES": "40"}
    proc = subprocess.Popen([sys.executable, "-m", "rlboost.cli", "watch", run_id,
                             "--interval", "0.5"], stdin=slave, stdout=slave, stderr=slave,
                            env=env, start_new_session=True)
    os.close(slave)
    watched = Watched(proc, master)
    reader = threading.Thread(target=watched.pump, daemon=True)
    reader.start()
    return watched, reader


@dataclass
class Observed:
    cluster: Cluster
    client: httpx.Client
    run: dict[str, Any]
    steps: list[dict[str, Any]]
    watched: Watched
    metrics: dict[str, str]  # service -> its /metrics text, read at the end of the run


def scrape_all(cluster: Cluster, client: httpx.Client) -> dict[str, str]:
    """/metrics of every service: the manager's and the weight service's on their REST
    port, the trainer's and each rollout instance's on their exporter port."""
    texts = {"manager": client.get("/metrics").text,
             "weights": httpx.get(cluster.env["RLBOOST_WEIGHTS_URL"] + "/metrics").text}
    trainer_log = (cluster.root / "logs" / "trainer.log").read_text()
    port = re.search(r"metrics on [\d.]+:(\d+)", trainer_log)
    assert port, "the trainer did not log its metrics port"
    texts["trainer"] = httpx.get(f"http://127.0.0.1:{port.group(1)}/metrics").text
    for inst in client.get("/v1/instances").json():
        texts[inst["id"]] = httpx.get(f"http://127.0.0.1:{inst['metrics_port']}/metrics").text
    return texts


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    root = tmp_path_factory.mktemp("observe")
    stack = Stack.create(root / "brokers")
    stack.start()
    cluster = start_cluster(root, stack, env={"RLBOOST_API_TOKEN": TOKEN}, spot=2, reserved=1)
    client = httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], timeout=10,
                          headers={"Authorization": f"Bearer {TOKEN}"})
    try:
        run_id = client.post("/v1/runs", json=SPEC).raise_for_status().json()["id"]
        watched, reader = watch_in_pty(cluster, run_id)
        end = time.monotonic() + 240
        while not client.get(f"/v1/runs/{run_id}/steps").json():
            assert time.monotonic() < end, "no step finished"
            time.sleep(0.2)
        spot = next(c for c in cluster.children if c.name == "spot-1")
        spot.signal(signal.SIGTERM)  # a preemption notice, mid-run
        run = wait_run(client, run_id, 300, cluster)
        steps = client.get(f"/v1/runs/{run_id}/steps").json()
        watched.proc.wait(timeout=30)  # it must end by itself once the run has
        reader.join(timeout=5)
        yield Observed(cluster, client, run, steps, watched, scrape_all(cluster, client))
    finally:
        client.close()
        cluster.stop()
        stack.stop()


def test_the_run_succeeds_with_a_preempted_spot_instance(observed: Observed) -> None:
    assert observed.run["state"] == "succeeded", observed.run
    assert len(observed.steps) == SPEC["steps"]
    events = observed.client.get(f"/v1/runs/{observed.run['id']}/events").json()
    left = [e for e in events if e["type"] == "leave"]
    assert [(e["instance"], e["reason"]) for e in left] == [("spot-1", "preempt")], left
    joined = {e["instance"]: e["kind"] for e in events if e["type"] == "join"}
    assert joined == {"reserved-0": "reserved", "spot-0": "spot", "spot-1": "spot"}
    versions = {e["version"] for e in events if e["version"] is not None}
    assert versions == set(range(SPEC["steps"])), versions  # every step's version was loaded
    assert all(isinstance(s["publish_s"], float) and s["publish_s"] > 0 for s in observed.steps)


def test_watch_follows_the_run_to_its_final_step_in_a_terminal(observed: Observed) -> None:
    text = observed.watched.text()
    assert observed.watched.proc.returncode == 0, text[-2000:]
    final = f"step {SPEC['steps']}/{SPEC['steps']}"
    assert final in text, text[-2000:]
    assert "succeeded" in text and "reward" in text and "instances:" in text
    assert re.search(r"\d+ reserved", text) and re.search(r"\d+ spot", text)


def test_the_dashboard_shows_the_run_and_the_preempted_instance(observed: Observed,
                                                                tmp_path: Path) -> None:
    base = observed.cluster.env["RLBOOST_MANAGER_URL"]
    run_id = observed.run["id"]
    with chromium() as browser:
        page = browser.new_page()
        errors = page_errors(page)
        log_in(page, base, TOKEN)
        page.click(f"#runs-body tr[data-run='{run_id}'] a")
        page.wait_for_function("window.rlboost.ready && window.rlboost.charts.reward")
        plot = "window.rlboost.charts.reward.plot"
        assert page.evaluate(f"{plot}.data[0]") == list(range(SPEC["steps"]))
        rewards = page.evaluate(f"{plot}.data[1]")
        assert rewards == pytest.approx([s["reward_mean"] for s in observed.steps])
        preempted = page.locator("#inst-body tr[data-fate='preempted']")
        assert preempted.count() == 1
        assert preempted.get_attribute("data-instance") == "spot-1"
        assert preempted.get_attribute("data-kind") == "spot"
        assert page.inner_text("#run-state") == "succeeded"
        assert page.locator("#cancel").is_hidden()
        page.wait_for_timeout(300)  # one animation frame for the canvas
        shot = tmp_path / "dashboard.png"
        page.screenshot(path=str(shot), full_page=True)
        if os.environ.get(SCREENSHOT_ENV):
            shutil.copy(shot, os.environ[SCREENSHOT_ENV])
        assert errors == []


def test_trackers_hold_every_step_and_a_missing_one_is_a_warning(observed: Observed) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = Path(observed.cluster.env["RLBOOST_DATA_DIR"]) / "trackers" / observed.run["id"]
    want = {s["step"]: s["reward_mean"] for s in observed.steps}
    events = EventAccumulator(str(data / "tensorboard"))
    events.Reload()
    got = {e.step: e.value for e in events.Scalars("reward_mean")}
    assert got == pytest.approx(want)
    assert {e.step for e in events.Scalars("publish_s")} == set(want)

    client = mlflow_store(data / "mlflow")
    experiment = client.get_experiment_by_name("rlboost")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == observed.run["id"] and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert {m.step: m.value for m in history} == pytest.approx(want)
    assert json.loads(run.data.params["trackers"].replace("'", '"')) == SPEC["trackers"]

    warnings = observed.run["warnings"]
    if importlib.util.find_spec("wandb") is None:
        assert len(warnings) == 1 and "tracker wandb did not start" in warnings[0], warnings
    else:
        assert warnings == [] and (data / "wandb").is_dir()


def test_every_metric_of_the_grafana_dashboard_is_served(observed: Observed) -> None:
    dashboard = json.loads((ROOT / "compose/grafana/dashboards/rlboost.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\brlboost_[a-z0-9_]+", expr)}
    assert all(re.search(r"\brlboost_", e) for e in exprs)
    served: dict[str, set[str]] = {}
    for service, text in observed.metrics.items():
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                served.setdefault(sample.name, set()).add(service)
    missing = sorted(used - set(served))
    assert not missing, f"the dashboard uses metrics no service serves: {missing}"
    assert {"manager", "weights", "trainer", "reserved-0"} <= {
        s for name in used for s in served[name]}  # every kind of service is on the board


def test_runs_and_cancel_commands(observed: Observed) -> None:
    env = {**os.environ, "RLBOOST_MANAGER_URL": observed.cluster.env["RLBOOST_MANAGER_URL"],
           "RLBOOST_API_TOKEN": TOKEN}

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "rlboost.cli", *argv], env=env,
                              capture_output=True, text=True, timeout=60, check=False)

    runs = cli("runs")
    assert runs.returncode == 0, runs.stderr
    row = next(line for line in runs.stdout.splitlines() if observed.run["id"] in line)
    assert "succeeded" in row and f"{SPEC['steps']}/{SPEC['steps']}" in row
    done = cli("cancel", observed.run["id"])  # an ended run stays as it ended
    assert done.returncode == 0 and "succeeded" in done.stdout
    missing = cli("cancel", "run-nope")
    assert missing.returncode == 1 and "no run" in missing.stderr
    refused = subprocess.run([sys.executable, "-m", "rlboost.cli", "runs"], capture_output=True,
                             text=True, timeout=60, check=False,
                             env={**env, "RLBOOST_API_TOKEN": "wrong"})
    assert refused.returncode == 1 and "token" in refused.stderr
