"""A trainer told to stop mid-step leaves at once rather than after the step, and a restarted
one finishes the run from the committed samples. Real brokers and processes: the manager, the
weight service, the trainer, and a rollout instance that joins late.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from rlboost.stack import Stack
from tests.support.cluster import start_cluster, wait_run
from tests.support.invariants import check_run
from trainer_svc.learn.policies import PRESETS, EmuPolicy

pytestmark = pytest.mark.slow

EMU_REWARD = EmuPolicy(PRESETS["emu"], Path("/nonexistent"), 0.0).reward


def test_a_trainer_stopped_mid_step_exits_and_a_restarted_one_finishes_the_run(
    brokers: Stack, tmp_path: Path,
) -> None:
    # No rollout instance at first: step 0 can never complete, so the trainer is inside it.
    cluster = start_cluster(tmp_path, brokers, spot=0, reserved=0, engine="emu",
                            env={"RLBOOST_EMU_TIME_SCALE": "0.0"})
    spec = {"model": "emu", "steps": 2, "prompts_per_step": 2, "samples_per_prompt": 2,
            "max_new_tokens": 8, "seed": 3, "seeding": {"mode": "off"}}
    try:
        with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], timeout=10) as client:
            run_id = client.post("/v1/runs", json=spec).json()["id"]
            end = time.monotonic() + 60
            while not client.get(f"/v1/runs/{run_id}").json().get("progress"):
                assert time.monotonic() < end, "step 0 never started"
                time.sleep(0.1)
            time.sleep(1.0)  # well into the step's wait for samples
            trainer = next(c for c in cluster.children if c.name == "trainer")
            assert trainer.proc is not None and trainer.alive()
            trainer.signal(signal.SIGTERM)
            try:
                assert trainer.proc.wait(timeout=10) == 0, trainer.tail()
            except subprocess.TimeoutExpired:
                pytest.fail(f"the trainer went on with its step after SIGTERM:\n{trainer.tail()}")
            trainer.start()
            cluster.add_instance("spot", "spot-late")
            final = wait_run(client, run_id, 120, cluster)
            assert final["state"] == "succeeded", final
            check_run(client, run_id, spec, EMU_REWARD)
    finally:
        cluster.stop()
