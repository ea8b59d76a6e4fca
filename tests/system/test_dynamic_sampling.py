"""DAPO's dynamic sampling through REST: only informative groups are trained on, exactly once.

A 2-step tiny/torch run with two samples per prompt: early on most groups score alike (both
responses wrong the same way), so steps are extended with more prompts drawn from the run seed
until four groups with differing rewards are complete; the extra responses still in flight
then are aborted. Invariants 1-3 hold over what the samples endpoint serves, which is exactly
the kept groups (the trainer's digest check failed the run otherwise), each of them with
rewards that differ, and the records count what was filtered and discarded.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rlboost.launcher import Cluster
from rlboost.stack import Stack
from tests.support.cluster import start_cluster, wait_run
from tests.support.invariants import check_run, step_records
from trainer_svc.embedded import task

pytestmark = pytest.mark.slow

SPEC = {"steps": 2, "prompts_per_step": 4, "samples_per_prompt": 2, "seed": 5,
        "max_new_tokens": 8, "algorithm": "dapo", "dynamic_sampling": True,
        "max_gen_batches": 4, "learning_rate": 0.01}
MAX_PROMPTS = 4 * 4


@pytest.fixture
def cluster(brokers: Stack, tmp_path: Path) -> Iterator[Cluster]:
    """Four responses at a time per instance: an extension's later groups are still queued or
    generating when the step closes, so some are aborted in flight."""
    c = start_cluster(tmp_path, brokers, spot=2, reserved=1, env={"RLBOOST_MAX_BATCH": "4"})
    try:
        yield c
    finally:
        c.stop()


def test_only_informative_groups_are_trained_and_aborted_work_is_counted(
        cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], timeout=10) as client:
        run = client.post("/v1/runs", json=SPEC).json()
        final = wait_run(client, run["id"], timeout_s=240, cluster=cluster)
        assert final["state"] == "succeeded", final
        # Extra prompts are the run seed's draw past prompts_per_step (a prefix-stable draw).
        by_step = check_run(client, run["id"], SPEC, prompts=lambda n: task.make_prompts(
            SPEC["seed"], n, MAX_PROMPTS))
        records = step_records(client, run["id"])
        metrics = client.get("/metrics").text
    for record in records:
        groups: dict[int, list[float]] = defaultdict(list)
        for s in by_step[record["step"]]:
            groups[s["prompt_index"]].append(s["reward"])
        assert len(groups) == SPEC["prompts_per_step"] == record["groups_kept"]
        for rewards in groups.values():
            assert len(set(rewards)) > 1, "a kept group's rewards are all equal"
        assert record["dynamic_sampling_capped"] == 0
        assert record["groups_kept"] + record["groups_filtered"] + record["groups_discarded"] \
            == record["prompts_generated"] <= MAX_PROMPTS
        # The lowest-index informative groups: nothing above the last kept one is filtered.
        assert max(groups) < record["prompts_generated"]
        assert record["groups_filtered"] <= max(groups) + 1 - len(groups)
    assert any(r["prompts_generated"] > SPEC["prompts_per_step"] for r in records), records
    assert any(r["groups_filtered"] > 0 for r in records), records
    # Step 0 of seed 5 is extended by 8 prompts (16 responses) while 3 instances generate 12
    # at a time: at its close, responses beyond the kept groups are complete or in flight.
    discarded = sum(r["tokens_discarded"] for r in records)
    assert discarded > 0, records
    assert any(r["responses_aborted"] > 0 for r in records), records
    exported = [float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("rlboost_tokens_discarded_total")]
    assert exported and exported[0] >= discarded
