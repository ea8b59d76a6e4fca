"""A rank of a sharded trainer group SIGKILLed mid-step: torchrun restarts the group, the run ends.

The trainer runs as ``rlboost up --trainer-ranks 2`` starts it: ``python -m trainer_svc.torchrun
2`` (torchrun's agent, up to 3 restarts) with FSDP2 over two gloo ranks. Twice during the run,
once the step's first groups have reached the trainer (its gradients are accumulating), one
rank is SIGKILLed: rank 1 in one step, rank 0 (the service itself) in a later one. Each time
the surviving rank must leave rather than fail the run, torchrun must start a new group (the
agent process stays the same, the ranks are new processes) and the new rank 0 must restore
the last checkpoint and redo the step. The run then finishes with invariants 1-3 on every
step (tests.support.invariants.check_run). The same for a LoRA run, whose versions after the
first are then adapter-only.
"""

from __future__ import annotations

import itertools
import os
import random
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rlboost.launcher import Child, Cluster
from rlboost.stack import Stack
from tests.support.cluster import start_cluster, wait_run
from tests.support.invariants import check_run

pytestmark = pytest.mark.slow

SPEC = {"steps": 5, "prompts_per_step": 4, "samples_per_prompt": 4, "seed": 17,
        "max_new_tokens": 8}
KILLS = ((1, 1), (3, 0))  # (step, rank): a worker first, then the serving rank 0


@pytest.fixture
def cluster(brokers: Stack, tmp_path: Path) -> Iterator[Cluster]:
    c = start_cluster(tmp_path, brokers, env={"RLBOOST_TRAINER_SHARDING": "fsdp2"},
                      spot=1, reserved=1, trainer_ranks=2)
    try:
        yield c
    finally:
        c.stop()


def ranks_of(agent: int) -> dict[int, int]:
    """The live ranks torchrun's agent ``agent`` has started: rank -> pid (from /proc)."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != agent or stat.rsplit(")", 1)[1].split()[0] == "Z":
                continue
            env = dict(item.split("=", 1) for item in
                       (entry / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in item)
        except (OSError, IndexError, ValueError):
            continue  # gone between the listing and the read
        if "RANK" in env:
            found[int(env["RANK"])] = int(entry.name)
    return found


def wait_ranks(agent: int, count: int, timeout_s: float = 120) -> dict[int, int]:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        found = ranks_of(agent)
        if len(found) == count:
            return found
        time.sleep(0.2)
    raise AssertionError(f"torchrun agent {agent} has ranks {ranks_of(agent)}, not {count}")


def wait_accumulating(client: httpx.Client, run_id: str, step: int,
                      timeout_s: float = 240) -> None:
    """Until step ``step`` has committed at least one whole group: the trainer holds it."""
    end = time.monotonic() + timeout_s
    group = SPEC["samples_per_prompt"]
    while time.monotonic() < end:
        run = client.get(f"/v1/runs/{run_id}").json()
        progress = run.get("progress") or {}
        if run["step"] > step or run["state"] not in ("queued", "running"):
            raise AssertionError(f"step {step} ended before the kill: {run}")
        if run["step"] == step and progress.get("responses_done", 0) >= group:
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} never reached the trainer")


def trainer(cluster: Cluster) -> Child:
    return next(c for c in cluster.children if c.name == "trainer")


@pytest.mark.parametrize("lora", [None, {"rank": 4, "alpha": 8}], ids=["full", "lora"])
def test_rank_killed_mid_step_restarts_group(cluster: Cluster,
                                             lora: dict[str, int] | None) -> None:
    agent = trainer(cluster)
    assert agent.proc is not None
    rng = random.Random(int(os.environ.get("RLBOOST_TEST_SEED", "7")))
    killed: list[tuple[int, int, int]] = []  # (step, rank, pid) of every rank that was alive
    spec = SPEC if lora is None else {**SPEC, "lora": lora}
    with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], timeout=10) as client:
        run_id = client.post("/v1/runs", json=spec).json()["id"]
        for step, rank in KILLS:
            # After the last kill's step: a fast step can end inside the random pause below.
            step = max(step, killed[-1][0] + 1) if killed else step
            wait_accumulating(client, run_id, step)
            time.sleep(rng.uniform(0.0, 0.5))  # somewhere in the accumulation, not at its start
            pids = wait_ranks(agent.proc.pid, 2)
            os.kill(pids[rank], signal.SIGKILL)
            # torchrun's answer: a whole new group (no old rank survives), same agent.
            end = time.monotonic() + 120
            while set(ranks_of(agent.proc.pid).values()) & set(pids.values()):
                assert time.monotonic() < end, "torchrun did not tear the old group down"
                time.sleep(0.2)
            fresh = wait_ranks(agent.proc.pid, 2)
            assert not set(fresh.values()) & set(pids.values())
            assert agent.alive(), f"torchrun gave up:\n{agent.tail(40)}"
            # The step the kill cut short: with a rank gone no step can be reported finished
            # (publishing needs every rank), the old group is gone, and the new one is still
            # starting (its imports take seconds), so the run's step now is the one that was
            # in progress, or the next one if the kill fell between two steps.
            at = int(client.get(f"/v1/runs/{run_id}").json()["step"])
            assert at >= step, (at, step)
            killed.append((at, rank, pids[rank]))
            print(f"step {at}: SIGKILLed rank {rank} (pid {pids[rank]})")
        final = wait_run(client, run_id, timeout_s=300, cluster=cluster)
        assert final["state"] == "succeeded", (final, agent.tail(60))
        check_run(client, run_id, spec)
    # A LoRA run's sharded trainer publishes version 0 whole from both ranks, and every later
    # version as its adapter alone from rank 0 (docs/weights.md "LoRA versions").
    # Versions collected by now (RLBOOST_WEIGHTS_KEEP) answer 404; a LoRA run keeps its base.
    weights = cluster.env["RLBOOST_WEIGHTS_URL"]
    served = []
    for version in range(SPEC["steps"] + 1):
        reply = httpx.get(f"{weights}/v1/weights/{run_id}/{version}/manifest", timeout=10)
        if reply.status_code == 404:
            continue
        served.append(version)
        manifest = reply.json()
        assert ("adapter" in manifest) is (lora is not None and version > 0), (version, manifest)
    assert SPEC["steps"] in served and (lora is None or 0 in served), served
    assert [r for _, r, _ in killed] == [r for _, r in KILLS]
    assert all(a < b for (a, _, _), (b, _, _) in itertools.pairwise(killed))
    log = agent.log_path.read_text(errors="replace")
    # Every group (the first and one per kill) set up the run from a checkpoint; after a kill
    # in step s the new group resumed at version s (the step's weights, still unchanged) and
    # redid the step, or, when the kill fell after the step's checkpoint was written and
    # before its publish, at version s + 1: the update applied once, in that checkpoint, which
    # the new group publishes and reports without training the step again.
    versions = [int(v) for v in re.findall(rf"run {run_id}: model \S+ at version (\d+)", log)]
    assert len(versions) == 1 + len(killed) and versions[0] == 0, log[-4000:]
    assert all(v in (s, s + 1) for v, (s, _, _) in zip(versions[1:], killed, strict=True)), \
        (versions, killed, log[-4000:])
    # Each step's update was made once: no step reported finished twice (check_run has seen
    # every step finished, with its samples, in the manager). A step may lack its log line:
    # the kill fell after the manager took its report and before the line was written, so the
    # run had moved on to the next step when read, and the new group resumed at that version.
    done = [int(n) for n in re.findall(r"trainer: step (\d+) done", log)]
    assert done == sorted(set(done)), done
    cut = {s - 1 for (s, _, _), v in zip(killed, versions[1:], strict=True) if v == s}
    assert set(range(SPEC["steps"])) - set(done) <= cut, (done, killed, versions)
    # One new group per kill: a restart that failed to form its group (a stale peer address,
    # say) would use up another of torchrun's restarts and show here.
    assert log.count("trainer.dist: rank 0 of 2 on") == 1 + len(KILLS)
    assert "leaves the group" in log  # a survivor left instead of failing the run
    assert f"run {run_id} failed" not in log
