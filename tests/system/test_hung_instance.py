"""A rollout instance whose engine hangs while its process goes on heartbeating costs a step a
bounded delay, never the run.

Real processes on real brokers, emu engine. Beside a healthy spot instance, a second one runs
with ``RLBOOST_EMU_STALL_AFTER_S``: half a second after its first decode step its engine
produces nothing more and its decode-step count stops, while its heartbeats (and so its
leases' renewals) go on. Without the progress check its responses never finish and the step's
barrier never comes. With it, the manager drains the instance (its engine has not advanced
while it holds work), its responses migrate from their last committed tokens, and the run
succeeds with exactly the samples a fault-free run produces (the emu oracle); the revocation
shows in the manager's counters and the instance stays ``draining`` in ``GET /v1/instances``.
The step it hung in must end within the stated bound (docs/invariants.md, "Hung and slow
instances") of a step without the hang.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rlboost.launcher import Cluster
from rlboost.stack import Stack
from tests.support.cluster import start_cluster, wait_run
from tests.support.invariants import check_run, step_records
from tests.system.test_faults import FAST, REWARD, oracle

pytestmark = pytest.mark.slow

PROGRESS_TIMEOUT_S = 3.0
HUNG = "hung-0"
# 32 responses of up to 240 tokens, 16 to each instance (its batch): the hung one stalls
# holding most of its 16 (the emu length model's mean is 60 tokens, ~1 s of decode).
SPEC: dict[str, Any] = {"model": "emu", "steps": 3, "prompts_per_step": 8,
                        "samples_per_prompt": 4, "max_new_tokens": 240, "seed": 11,
                        "seeding": {"mode": "off"}}
ENV = {**FAST, "RLBOOST_PROGRESS_TIMEOUT_S": str(PROGRESS_TIMEOUT_S), "RLBOOST_MAX_BATCH": "16"}
# One emu decode step at batch 16: 10 ms + 0.3 ms a sequence (rollout_svc/engines/emu.py).
DECODE_S = 0.010 + 0.0003 * 16


def hang_bound_s(max_new_tokens: int) -> float:
    """What one hung instance may add to a step (docs/invariants.md): the progress timeout,
    plus the instance TTL by which a lease of an engine that reports its steps is judged
    later, the reaper's period and a heartbeat (the engine's count is seen on beats), plus
    regenerating one whole response, twice for this busy machine's emulation lag."""
    slack = float(FAST["RLBOOST_INSTANCE_TTL_S"]) + 0.5 + float(FAST["RLBOOST_HEARTBEAT_S"])
    return PROGRESS_TIMEOUT_S + slack + 2 * max_new_tokens * DECODE_S


def counter(text: str, name: str, labels: str = "") -> float:
    found = re.search(rf"^{name}{re.escape(labels)} (\S+)", text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.fixture
def cluster(brokers: Stack, tmp_path: Path) -> Iterator[Cluster]:
    c = start_cluster(tmp_path, brokers, spot=1, reserved=0, engine="emu", env=ENV)
    c.add_instance("spot", HUNG, extra={"RLBOOST_EMU_STALL_AFTER_S": "0.5"})
    try:
        yield c
    finally:
        c.stop()


def test_a_hung_instance_is_drained_and_its_work_migrates(cluster: Cluster) -> None:
    url = cluster.env["RLBOOST_MANAGER_URL"]
    with httpx.Client(base_url=url, timeout=10) as client:
        end = time.monotonic() + 60
        while len(client.get("/v1/instances").json()) < 2:  # both take the first step's work
            assert time.monotonic() < end, "the instances did not register"
            time.sleep(0.1)
        run_id = client.post("/v1/runs", json=SPEC).json()["id"]
        final = wait_run(client, run_id, 180, cluster)
        assert final["state"] == "succeeded", final
        by_step = check_run(client, run_id, SPEC, REWARD)
        for step, samples in by_step.items():
            for s in samples:
                assert s["response_token_ids"] == oracle(SPEC, s, step)
        records = step_records(client, run_id)
        hung_steps = [n for n, samples in by_step.items()
                      if any(HUNG in s["instances"] for s in samples)]
        metrics = client.get("/metrics").text
        instances = {i["id"]: i for i in client.get("/v1/instances").json()}
    stuck = counter(metrics, "rlboost_stuck_engines_total")
    revoked = {reason: counter(metrics, "rlboost_lease_revocations_total",
                               f'{{reason="{reason}"}}')
               for reason in ("engine_stuck", "no_progress", "backup")}
    rollout_s = [round(r["rollout_s"], 2) for r in records]
    bound = hang_bound_s(SPEC["max_new_tokens"])
    print(f"hung instance: drained {stuck:.0f}x, revocations {revoked}, it contributed to "
          f"steps {hung_steps}; rollout_s by step {rollout_s}, migrations "
          f"{[r['migrations'] for r in records]}, bound {bound:.1f}s over a clean step")
    assert stuck >= 1 and revoked["engine_stuck"] >= 1
    assert instances[HUNG]["state"] == "draining", instances
    # It committed tokens before it hung, and they were continued elsewhere, not thrown away.
    assert hung_steps and records[hung_steps[0]]["migrations"] > 0
    # The hang cost the step it hit at most the bound over the steps it did not hit.
    clean = [r["rollout_s"] for n, r in enumerate(records) if n not in hung_steps]
    assert clean, "the hung instance took part in every step: it was never drained"
    assert max(r["rollout_s"] for r in records) <= max(clean) + bound, rollout_s
