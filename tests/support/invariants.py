"""Checks of the design's invariants 1-3 on what the REST API says a run trained on."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import httpx
import msgspec
import pytest

from shared.digest import sample_digest
from shared.protocol import Sample
from shared.spec import RunSpec
from trainer_svc.embedded import task


def check_run(client: httpx.Client, run_id: str, spec: dict[str, Any],
              reward: Callable[[list[int], list[int]], float] = task.reward, *,
              prompts: Callable[[int], list[list[int]]] | None = None,
              eos_id: int | Collection[int] = task.EOS_ID,
              sample_reward: Callable[[dict[str, Any]], float] | None = None,
              ) -> dict[int, list[dict[str, Any]]]:
    """Assert invariants 1-3 for every step of a finished run; returns the samples by step.

    ``prompts(step)`` are the step's prompt ids (default: the built-in task's draw), ``eos_id``
    what ends a response (one id, or all of them: engines stop on each EOS id of the model),
    and ``sample_reward(sample)`` its expected reward from the whole sample (text included), in
    place of ``reward`` on its token ids."""
    run = msgspec.convert(spec, RunSpec)  # the body as submitted, with the manager's defaults
    ends = {eos_id} if isinstance(eos_id, int) else set(eos_id)
    steps: list[dict[str, Any]] = client.get(f"/v1/runs/{run_id}/steps").json()
    assert [s["step"] for s in steps] == list(range(run.steps))
    expected = run.prompts_per_step * run.samples_per_prompt
    by_step = {}
    for record in steps:
        n = record["step"]
        samples = client.get(f"/v1/runs/{run_id}/steps/{n}/samples").json()
        assert len(samples) == expected == record["responses"]
        keys = {(s["prompt_index"], s["sample_index"]) for s in samples}
        assert len(keys) == expected  # exactly once: no duplicates, none missing
        assert {s["weight_version"] for s in samples} == {n} == {record["weight_version"]}
        drawn = prompts(n) if prompts else task.make_prompts(run.seed, n, run.prompts_per_step)
        for s in samples:
            assert s["prompt_token_ids"] == drawn[s["prompt_index"]]
            assert 1 <= len(s["response_token_ids"]) <= run.max_new_tokens
            ended = s["response_token_ids"][-1] in ends
            assert ended or len(s["response_token_ids"]) == run.max_new_tokens
            assert not ends.intersection(s["response_token_ids"][:-1])
            assert s["instances"], "every response names who generated it"
            want = sample_reward(s) if sample_reward else reward(s["prompt_token_ids"],
                                                                 s["response_token_ids"])
            assert s["reward"] == pytest.approx(want)
        assert record["tokens"] == sum(len(s["response_token_ids"]) for s in samples)
        rewards = [s["reward"] for s in samples]
        assert record["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
        digest = sample_digest([msgspec.convert(s, Sample) for s in samples])
        assert digest.responses == expected and digest.tokens == record["tokens"]
        for key in ("step_s", "rollout_s", "train_s"):
            assert record[key] >= 0
        by_step[n] = samples
    return by_step


def step_records(client: httpx.Client, run_id: str) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = client.get(f"/v1/runs/{run_id}/steps").json()
    return records
