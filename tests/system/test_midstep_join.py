"""A rollout instance that joins in the middle of a step serves that step with its version.

Real processes on real brokers, emu engine. Only a reserved instance runs at first, with room for
two responses at a time, so a step is long (the rest of its responses wait in the queue). Once
step ``JOIN_STEP`` (>= 1, so versions ``JOIN_STEP - 1`` and ``JOIN_STEP`` both exist) is under
way, a spot instance starts. It must come up holding the step's version, take the queued
responses of that very step, and generate them from that version: the samples endpoint names it
among the step's producers, with ``weight_version`` equal to the step, and its tokens equal the
emu oracle's for that version (emu tokens are a function of the weight version, so a joiner that
generated with any other version produces other tokens).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from rlboost.launcher import Child, Cluster
from rlboost.stack import Stack
from tests.support.cluster import start_cluster, wait_run
from tests.support.invariants import check_run, step_records
from tests.system.test_faults import FAST, REWARD, oracle

pytestmark = pytest.mark.slow

T = TypeVar("T")
JOIN_STEP = 1
JOINER = "join-0"
RESERVED_BATCH = 2
# 32 responses of ~40 tokens on average (the emu length model: a quarter of the budget), two at
# a time, take the reserved instance alone ~10 s a step: about twice what a joiner needs to
# start, pull the version and load it (the emu spot load alone is 4 s), so the step is still
# generating, most of its responses queued, when the joiner is ready (measured: 5 of 32 done).
# Seeding off: once a spot instance is alive, queued responses go to spot instances only, so the
# joiner takes all of them.
SPEC: dict[str, Any] = {"model": "emu", "steps": 3, "prompts_per_step": 8,
                        "samples_per_prompt": 4, "max_new_tokens": 160, "seed": 5,
                        "seeding": {"mode": "off"}}


def wait_until(what: str, timeout_s: float, probe: Callable[[], T | None]) -> T:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = probe()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def join_mid_step(cluster: Cluster, client: httpx.Client, run_id: str, logs: Path) -> Child:
    """Start the joiner once step ``JOIN_STEP`` is generating; returns it."""

    def mid_step() -> dict[str, Any] | None:
        run: dict[str, Any] = client.get(f"/v1/runs/{run_id}").json()
        assert run["state"] in ("queued", "running") and run["step"] <= JOIN_STEP, run
        progress = run["progress"]
        # Committed tokens of the step: its version exists and it is generating.
        started = run["step"] == JOIN_STEP and progress.get("state") == "rollout" \
            and progress["tokens"] > 0
        return run if started else None

    wait_until(f"step {JOIN_STEP} to generate", 40, mid_step)
    # Not Cluster.add_instance: the joiner needs its own batch size (the cluster's is the
    # reserved instance's two). In cluster.children, so cluster.stop() ends it.
    joiner = Child(JOINER, [sys.executable, "-m", "rollout_svc"], {
        **cluster.env, "RLBOOST_ENGINE": "emu", "RLBOOST_INSTANCE_ID": JOINER,
        "RLBOOST_INSTANCE_KIND": "spot", "RLBOOST_MAX_BATCH": "32",
    }, logs / f"{JOINER}.log")
    joiner.start()
    cluster.children.append(joiner)
    return joiner


def test_midstep_joiner_serves_the_step_with_its_version(brokers: Stack, tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path, brokers, spot=0, reserved=1, engine="emu",
                            env={**FAST, "RLBOOST_MAX_BATCH": str(RESERVED_BATCH)})
    try:
        with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], timeout=10) as client:
            run_id = client.post("/v1/runs", json=SPEC).json()["id"]
            joiner = join_mid_step(cluster, client, run_id, tmp_path / "logs")

            def joiner_ready() -> dict[str, Any] | None:
                assert joiner.alive(), joiner.tail()
                mine = [i for i in client.get("/v1/instances").json() if i["id"] == JOINER]
                return mine[0] if mine and mine[0]["state"] == "ready" else None

            ready = wait_until("the joiner to be ready", 30, joiner_ready)
            run = client.get(f"/v1/runs/{run_id}").json()
            # The first version it serves is the step's own, never the one before it.
            assert (ready["run_id"], ready["weight_version"]) == (run_id, JOIN_STEP), ready
            progress = run["progress"]
            # Not an assertion of the property, but of the setting: responses beyond the two the
            # reserved instance holds are still queued for the joiner. If this fails, the step
            # ended (nearly) before the joiner was up: make the step longer.
            assert run["step"] == JOIN_STEP and progress["state"] == "rollout" and \
                progress["responses_done"] + RESERVED_BATCH < progress["responses_total"], run

            final = wait_run(client, run_id, 60, cluster)
            assert final["state"] == "succeeded", final
            by_step = check_run(client, run_id, SPEC, REWARD)
            versions = [r["weight_version"] for r in step_records(client, run_id)]
            assert versions == list(range(SPEC["steps"]))

            joined = [s for s in by_step[JOIN_STEP] if JOINER in s["instances"]]
            assert joined, f"{JOINER} generated nothing of step {JOIN_STEP}"
            assert not any(JOINER in s["instances"] for s in by_step[JOIN_STEP - 1])
            for step, samples in by_step.items():
                for s in samples:
                    if JOINER in s["instances"]:
                        assert s["weight_version"] == step, s
                        # The tokens themselves are those of the step's version.
                        assert s["response_token_ids"] == oracle(SPEC, s, step), s
    finally:
        cluster.stop()


def test_without_midstep_join_a_joiner_waits_for_the_next_step(
    brokers: Stack, tmp_path: Path
) -> None:
    """The ablation switch (weights only at step boundaries): the same joiner sits out the step
    it arrived in, while the reserved side finishes it, and works from the next step on."""
    cluster = start_cluster(tmp_path, brokers, spot=0, reserved=1, engine="emu",
                            env={**FAST, "RLBOOST_MAX_BATCH": str(RESERVED_BATCH),
                                 "RLBOOST_MIDSTEP_JOIN": "off"})
    try:
        with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], timeout=10) as client:
            run_id = client.post("/v1/runs", json=SPEC).json()["id"]
            join_mid_step(cluster, client, run_id, tmp_path / "logs")
            assert wait_run(client, run_id, 90, cluster)["state"] == "succeeded"
            by_step = check_run(client, run_id, SPEC, REWARD)
            assert not any(JOINER in s["instances"] for s in by_step[JOIN_STEP])
            assert any(JOINER in s["instances"] for s in by_step[JOIN_STEP + 1])
    finally:
        cluster.stop()
