"""The weight service's disk fills during an upload: the version is refused cleanly, never
published half-written, and the trainer publishes it once space is back, exactly once.

The store's directory is a small tmpfs (``mount -t tmpfs``, root only: without it the test
skips and says why). The run has no rollout instance at first, so only version 0 exists; then
the disk is filled but for a few KiB, and an instance joins: step 0 completes and the trainer's
upload of version 1 (64 KiB of emu weights) runs out of space mid-file.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rlboost.stack import Stack
from tests.support.cluster import start_cluster, wait_run
from tests.support.invariants import check_run
from tests.support.tmpfs import tmpfs
from trainer_svc.learn.policies import PRESETS, EmuPolicy

pytestmark = pytest.mark.slow

EMU_REWARD = EmuPolicy(PRESETS["emu"], Path("/nonexistent"), 0.0).reward
SPEC = {"model": "emu", "steps": 2, "prompts_per_step": 2, "samples_per_prompt": 2,
        "max_new_tokens": 8, "seed": 5, "seeding": {"mode": "off"}}
ROOM_BYTES = 16 << 10  # left free: less than one emu checkpoint (64 KiB)
UPLOAD_TRIES = 5  # shared.weights.client.upload_version's attempts per request


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """``<data>/weights`` on a 1 MiB tmpfs."""
    with tmpfs(tmp_path / "data" / "weights", "1m") as where:
        yield where


def fill(disk: Path, leave: int) -> Path:
    """Fill ``disk`` but for about ``leave`` bytes; returns the filler file."""
    filler = disk / ".filler"  # a leading dot: never a run id the store would look at
    with filler.open("wb") as f:
        free = subprocess.run(["df", "-B1", "--output=avail", str(disk)], capture_output=True,
                              text=True, check=True).stdout.split()[-1]
        f.write(b"\0" * max(0, int(free) - leave))
    return filler


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_upload_into_a_full_disk_is_refused_and_retried_once_space_returns(
    brokers: Stack, tmp_path: Path, small_disk: Path,
) -> None:
    cluster = start_cluster(tmp_path, brokers, spot=0, reserved=0, engine="emu",
                            env={"RLBOOST_EMU_TIME_SCALE": "0.0"})
    weights = httpx.Client(base_url=cluster.env["RLBOOST_WEIGHTS_URL"], timeout=10)
    try:
        with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], timeout=10) as client:
            run_id = client.post("/v1/runs", json=SPEC).json()["id"]
            end = time.monotonic() + 60
            while weights.get(f"/v1/weights/{run_id}/0/manifest").status_code != 200:
                assert time.monotonic() < end, "version 0 was never published"
                time.sleep(0.1)
            filler = fill(small_disk, ROOM_BYTES)
            cluster.add_instance("reserved", "reserved-0")
            # The trainer's upload of version 1 runs out of space: 507 with a detail, again
            # on each retry, and nothing of version 1 is published or served meanwhile. Past
            # its upload's own retries (5) the trainer retries the whole step's publish.
            end = time.monotonic() + 60
            while metric(weights.get("/metrics").text,
                         'rlboost_weights_errors_total{status="507"}') < UPLOAD_TRIES + 2:
                assert time.monotonic() < end, "uploads were not refused for want of space"
                assert not cluster.dead(), cluster.dead()[0].tail(40)
                time.sleep(0.2)
            trainer_log = (tmp_path / "logs" / "trainer.log").read_text()
            assert "retrying the step" in trainer_log, trainer_log[-3000:]
            log = (tmp_path / "logs" / "weights.log").read_text()
            assert "No space left on device" in log or "storage failure" in log, log[-2000:]
            for path in ("manifest", "files/weights.bin", "files/config.json"):
                resp = weights.get(f"/v1/weights/{run_id}/1/{path}")
                assert resp.status_code == 404 and resp.json()["detail"], (path, resp.text)
            assert not (small_disk / run_id / "1").exists()
            assert client.get(f"/v1/runs/{run_id}").json()["step"] == 0  # it waits
            assert not cluster.dead()
            # A PUT of our own, to see the refusal's shape: 507, a detail, no traceback.
            resp = weights.put(f"/v1/weights/{run_id}/9/files/probe.bin",
                               content=b"x" * (256 << 10))
            assert resp.status_code == 507, resp.text
            assert "space" in resp.json()["detail"].lower(), resp.text
            filler.unlink()
            final = wait_run(client, run_id, 120, cluster)
            assert final["state"] == "succeeded", final
            check_run(client, run_id, SPEC, EMU_REWARD)
            text = weights.get("/metrics").text
            log = (tmp_path / "logs" / "weights.log").read_text()
            # Versions 0, 1 and 2, each published and announced once: the refused attempts
            # left nothing that a retry could publish a second time.
            assert len(re.findall(rf"published {run_id}/1 ", log)) == 1, log[-3000:]
            assert metric(text, "rlboost_weights_commits_total") == 3
            assert metric(text, "rlboost_weights_announced_total") == 3
            manifest = weights.get(f"/v1/weights/{run_id}/1/manifest").json()
            assert [f["size"] for f in manifest["files"] if f["name"] == "weights.bin"] == [
                PRESETS["emu"].checkpoint_bytes]
    finally:
        weights.close()
        with contextlib.suppress(Exception):
            cluster.stop()
