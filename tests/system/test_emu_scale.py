"""Several emulated instances in one process: they register, share work and leave together."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from rlboost.launcher import Child
from rlboost.stack import Stack
from shared.protocol import Sample, encode
from tests.support.cluster import start_cluster, wait_run
from tests.support.invariants import check_run
from tests.system.test_faults import FAST, REWARD

pytestmark = pytest.mark.slow

SPEC = {"model": "emu", "steps": 2, "prompts_per_step": 8, "samples_per_prompt": 4,
        "max_new_tokens": 32, "seed": 4}


def test_one_process_serves_four_instances(brokers: Stack, tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path, brokers, spot=0, reserved=1, engine="emu", env=FAST)
    group = Child("pack", [sys.executable, "-m", "rollout_svc"], {
        **cluster.env, "RLBOOST_ENGINE": "emu", "RLBOOST_INSTANCE_ID": "pack",
        "RLBOOST_INSTANCE_KIND": "spot", "RLBOOST_EMU_INSTANCES": "4",
        "RLBOOST_MAX_BATCH": "8"}, tmp_path / "pack.log")
    group.start()
    try:
        with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], timeout=10) as client:
            ids: set[str] = set()
            for _ in range(100):
                ids = {i["id"] for i in client.get("/v1/instances").json()}
                if {f"pack-{k}" for k in range(4)} <= ids:
                    break
                time.sleep(0.1)
            assert {f"pack-{k}" for k in range(4)} <= ids, ids
            run_id = client.post("/v1/runs", json=SPEC).json()["id"]
            assert wait_run(client, run_id, 120, cluster)["state"] == "succeeded"
            by_step = check_run(client, run_id, SPEC, REWARD)
            contributors = {i for samples in by_step.values() for s in samples
                            for i in s["instances"]}
            assert len(contributors & {f"pack-{k}" for k in range(4)}) >= 2
            group.signal(signal.SIGTERM)  # one notice reaches every instance of the process
            assert group.proc is not None and group.proc.wait(timeout=20) == 0
            left = {i["id"] for i in client.get("/v1/instances").json()}
            assert not left & {f"pack-{k}" for k in range(4)}
    finally:
        group.signal(signal.SIGKILL)
        cluster.stop()


@pytest.mark.parametrize("shape", [(32, 16, 2048), (2, 96, 8192)],
                         ids=["many-groups", "groups-over-1MB"])
def test_a_step_larger_than_one_message_still_trains(
    brokers: Stack, tmp_path: Path, shape: tuple[int, int, int]
) -> None:
    """A step whose samples exceed NATS's 1 MB payload: the trainer pages them after the
    barrier, instead of waiting for a reply that can't come; a group too large to stream is
    announced without its samples and trained from the pages."""
    prompts, samples_per_prompt, max_new_tokens = shape
    spec = {"model": "emu", "steps": 2, "prompts_per_step": prompts,
            "samples_per_prompt": samples_per_prompt, "max_new_tokens": max_new_tokens,
            "seed": 11}
    cluster = start_cluster(tmp_path, brokers, spot=2, reserved=1, engine="emu", env={
        **FAST, "RLBOOST_EMU_TIME_SCALE": "0.02", "RLBOOST_CHUNK_TOKENS": "256",
        "RLBOOST_MAX_BATCH": "256"})
    try:
        with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], timeout=30) as client:
            run_id = client.post("/v1/runs", json=spec).json()["id"]
            final = wait_run(client, run_id, 180, cluster)
            assert final["state"] == "succeeded", final
            by_step = check_run(client, run_id, spec, REWARD)
            for samples in by_step.values():
                size = len(encode([Sample(**{k: v for k, v in s.items() if k != "reward"})
                                   for s in samples]))
                assert size > 1024 * 1024  # the setting: more than one message could carry
    finally:
        cluster.stop()


def test_publish_time_covers_writing_the_version(brokers: Stack, tmp_path: Path) -> None:
    """``publish_s`` is the whole publish, the write of the version included: the seeding
    controller takes it out of the training a window can overlap, and with only the upload
    in it an emulated 11.3 s publish pinned the adaptive window at 0 s."""
    env = {**FAST, "RLBOOST_EMU_PUBLISH_S": "0.6"}
    cluster = start_cluster(tmp_path, brokers, spot=0, reserved=1, engine="emu", env=env)
    spec = {**SPEC, "steps": 3}
    try:
        with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], timeout=10) as client:
            run_id = client.post("/v1/runs", json=spec).json()["id"]
            assert wait_run(client, run_id, 120, cluster)["state"] == "succeeded"
            steps = client.get(f"/v1/runs/{run_id}/steps").json()
    finally:
        cluster.stop()
    assert len(steps) == spec["steps"]
    for s in steps:  # time scale 1: the emulated write sleeps 0.6 s of each step's training
        assert 0.6 <= s["publish_s"] <= s["train_s"], s
