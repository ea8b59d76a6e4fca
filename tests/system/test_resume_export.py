"""Checkpoints a user can take away: a run cancelled mid-way, resumed, finished, exported.

All four services as real processes on real brokers, the torch engine on the embedded ``tiny``
model, the weight service behind a write and a read token. A run is cancelled after its first
step, resumed with ``POST /v1/runs/{id}/resume``, and must finish with invariants 1-3 holding
over every step (the steps before the cancel and after the resume alike). The versions its
``save_every``/``keep_last`` keep are listed by ``GET /v1/runs/{id}/checkpoints`` and pinned in
the weight service; ``rlboost export`` pulls them with the read token alone into directories that
``transformers`` loads and generates from, holding exactly the trainer's weights.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlboost.launcher import Cluster
from rlboost.stack import Stack
from tests.support.cluster import start_cluster, wait_run
from tests.support.invariants import check_run
from trainer_svc.embedded import task

pytestmark = pytest.mark.slow

TOKENS = {"RLBOOST_WEIGHTS_TOKEN": "weights-write-secret",
          "RLBOOST_WEIGHTS_READ_TOKEN": "weights-read-secret"}
SPEC: dict[str, Any] = {"steps": 4, "prompts_per_step": 4, "samples_per_prompt": 4,
                        "max_new_tokens": 8, "seed": 5, "save_every": 1, "keep_last": 2}


@pytest.fixture
def cluster(brokers: Stack, tmp_path: Path) -> Iterator[Cluster]:
    c = start_cluster(tmp_path, brokers, env=TOKENS, spot=1, reserved=1)
    try:
        yield c
    finally:
        c.stop()


def export(cluster: Cluster, *args: str, token: str | None = TOKENS["RLBOOST_WEIGHTS_READ_TOKEN"]
           ) -> subprocess.CompletedProcess[str]:
    """``rlboost export`` as a user runs it: only the weight service's URL and read token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLBOOST_")}
    env["RLBOOST_WEIGHTS_URL"] = cluster.env["RLBOOST_WEIGHTS_URL"]
    if token is not None:
        env["RLBOOST_WEIGHTS_READ_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "rlboost.cli", "export", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def wait_step(client: httpx.Client, run_id: str, step: int, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while client.get(f"/v1/runs/{run_id}").json()["step"] < step:
        assert time.monotonic() < end, f"{run_id} never reached step {step}"
        time.sleep(0.05)


def test_cancelled_run_resumes_finishes_and_exports(cluster: Cluster, tmp_path: Path) -> None:
    with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], timeout=10) as client:
        run_id = client.post("/v1/runs", json=SPEC).json()["id"]
        queued = client.post("/v1/runs", json=SPEC).json()["id"]  # waits behind the first
        assert client.post(f"/v1/runs/{queued}/cancel").json()["state"] == "cancelled"
        refused = client.post(f"/v1/runs/{queued}/resume")
        assert refused.status_code == 409 and "no checkpoint" in refused.json()["detail"]

        wait_step(client, run_id, 1, 240)
        running = client.post(f"/v1/runs/{run_id}/resume")
        assert running.status_code == 409 and "running" in running.json()["detail"]
        cancelled = client.post(f"/v1/runs/{run_id}/cancel").json()
        assert cancelled["state"] == "cancelled" and 1 <= cancelled["step"] < SPEC["steps"]
        time.sleep(2.0)  # the step in flight ends or stalls; its report is refused
        stopped = client.get(f"/v1/runs/{run_id}").json()
        assert stopped["state"] == "cancelled" and stopped["step"] == cancelled["step"]

        resumed = client.post(f"/v1/runs/{run_id}/resume")
        assert resumed.status_code == 200, resumed.text
        assert resumed.json()["state"] in ("queued", "running") and not resumed.json()["error"]
        final = wait_run(client, run_id, 300, cluster)
        assert final["state"] == "succeeded", final
        check_run(client, run_id, SPEC)  # every step, before the cancel and after the resume

        kept = client.get(f"/v1/runs/{run_id}/checkpoints").json()
        assert [c["version"] for c in kept] == [3, 4]  # save_every 1, keep_last 2, 4 steps
        records = client.get(f"/v1/runs/{run_id}/steps").json()
        assert [c["reward_mean"] for c in kept] == [r["reward_mean"] for r in records[2:]]
        assert client.get("/v1/runs/run-nope/checkpoints").status_code == 404
        again = client.post(f"/v1/runs/{run_id}/resume")
        assert again.status_code == 409 and again.json()["detail"]

    weights = httpx.get(f"{cluster.env['RLBOOST_WEIGHTS_URL']}/v1/weights/{run_id}", headers={
        "Authorization": f"Bearer {TOKENS['RLBOOST_WEIGHTS_READ_TOKEN']}"}).json()
    assert weights["pinned"] == [3, 4]

    trainer_dir = Path(cluster.env["RLBOOST_DATA_DIR"]) / "trainer" / run_id
    for version, args in ((4, []), (3, ["--version", "3"])):
        out = tmp_path / f"export-{version}"
        done = export(cluster, run_id, str(out), *args)
        assert done.returncode == 0, done.stderr
        assert f"version {version}" in done.stdout
        names = {p.name for p in out.iterdir()}
        assert {"config.json", "model.safetensors", "generation_config.json",
                "tokenizer.json", "tokenizer_config.json"} <= names
        assert "manifest.json" not in names
        # Exactly the weights the trainer published as this version.
        got = load_file(out / "model.safetensors")
        want = load_file(trainer_dir / f"hf-{version}" / "model.safetensors")
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
        model = AutoModelForCausalLM.from_pretrained(out)
        tokenizer = AutoTokenizer.from_pretrained(out)
        prompt = task.make_prompts(SPEC["seed"], 0, 1)[0]
        assert tokenizer.convert_tokens_to_ids(task.VOCAB[task.EOS_ID]) == task.EOS_ID
        generated = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
        response = generated[0, len(prompt):].tolist()
        assert 1 <= len(response) <= 8 and all(0 <= t < len(task.VOCAB) for t in response)

    busy = export(cluster, run_id, str(tmp_path / "export-4"))  # not empty now
    assert busy.returncode == 1 and "not an empty directory" in busy.stderr
    missing = export(cluster, run_id, str(tmp_path / "nope"), "--version", "99")
    assert missing.returncode == 1 and "not in the weight service" in missing.stderr
    assert not (tmp_path / "nope").exists()
    anonymous = export(cluster, run_id, str(tmp_path / "anon"), token=None)
    assert anonymous.returncode == 1 and "unauthorized" in anonymous.stderr
