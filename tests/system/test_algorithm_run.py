"""An algorithm's knobs reach the trainer through REST and show in the step records.

A 2-step tiny/torch run with batch-normalised advantages (REINFORCE++ with baseline), a KL
term against the frozen initial policy and two passes per step. Invariants 1-3 hold as for
GRPO, and each record carries the statistics only this configuration produces: a KL estimate,
two optimizer steps, half of the backward streamed (the first pass, before the barrier), and
a non-zero clip fraction from the second pass. ``make bench-algorithms`` runs every algorithm
long enough for its reward to rise.
"""

from __future__ import annotations

import httpx
import pytest

from rlboost.launcher import Cluster
from tests.support.cluster import wait_run
from tests.support.invariants import check_run, step_records

pytestmark = pytest.mark.slow

SPEC = {"steps": 2, "prompts_per_step": 4, "samples_per_prompt": 4, "seed": 3,
        "max_new_tokens": 8, "algorithm": "reinforce_pp_baseline", "kl_coef": 0.05,
        "updates_per_step": 2, "learning_rate": 0.01}


def test_knobs_reach_the_trainer_and_its_statistics_the_records(cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], timeout=10) as client:
        run = client.post("/v1/runs", json=SPEC).json()
        final = wait_run(client, run["id"], timeout_s=240, cluster=cluster)
        assert final["state"] == "succeeded", final
        check_run(client, run["id"], SPEC)
        records = step_records(client, run["id"])
    for record in records:
        assert record["optimizer_steps"] == 2
        assert record["streamed_fraction"] == pytest.approx(0.5)
        assert record["kl"] >= 0.0 and record["entropy"] > 0.0 and record["grad_norm"] > 0.0
        assert 0.0 < record["response_len_mean"] <= record["response_len_max"] <= 8
        assert 0.0 <= record["truncated_fraction"] <= 1.0
        assert record["advantage_std"] > 0.0
    # At step 0 the policy is the reference: KL is zero on its first pass, and the update
    # moves it away; a second pass at this learning rate moves some ratios past the clip.
    assert records[1]["kl"] > 0.0
    assert any(r["clip_fraction"] > 0.0 for r in records)
