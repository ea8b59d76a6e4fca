"""The reward scorer: user functions in worker processes, failures counted as reward 0."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

from trainer_svc.inputs.rewards import RewardNameError
from trainer_svc.inputs.scorer import RewardScorer

USER_REWARDS = '''
import asyncio, os, time

def length(prompt, response, answer):
    return len(response) / 10

async def async_match(prompt, response, answer):
    await asyncio.sleep(0.01)
    return float(response == answer)

def picky(prompt, response, answer):
    if "bad" in response:
        raise KeyError(response)
    return 1.0

def slow(prompt, response, answer):
    if response == "slow":
        time.sleep(60)
    return 1.0

def odd(prompt, response, answer):
    return {"nan": float("nan"), "str": "1.0", "true": True}.get(response, 0.5)

def dies(prompt, response, answer):
    if response == "die":
        os._exit(3)
    return 1.0

def environ(prompt, response, answer):
    import json
    with open(prompt, "w") as f:  # the prompt names where to write what the worker sees
        json.dump(dict(os.environ), f)
    return 1.0

def echo_prompt(prompt, response, answer):
    print("rewards may print", prompt)  # must not corrupt the worker channel
    return float(len(prompt))
'''


@pytest.fixture
def reward_dir(tmp_path: Path) -> Path:
    d = tmp_path / "rewards"
    d.mkdir()
    (d / "i12_user_rewards.py").write_text(USER_REWARDS)
    return d


def _scorer(name: str, reward_dir: Path, **kwargs: Any) -> RewardScorer:
    return RewardScorer(f"python:i12_user_rewards:{name}", reward_path=[str(reward_dir)],
                        **kwargs)


async def test_builtin_math_in_workers() -> None:
    async with RewardScorer("math") as s:
        rewards, errors = await s.score_many([
            ("q", "7+5=12\n#### 12", "7+5=12\n#### 12"),
            ("q", "0.75", "\\boxed{3/4}"),
            ("q", "#### 11", "#### 12"),
        ])
    assert (rewards, errors) == ([1.0, 1.0, 0.0], 0)


async def test_user_function_from_the_reward_path(reward_dir: Path) -> None:
    async with _scorer("length", reward_dir) as s:
        assert await s.score_many([("p", "abcde", None), ("p", "", "x")]) == ([0.5, 0.0], 0)
    async with _scorer("echo_prompt", reward_dir, workers=1) as s:
        assert await s.score_many([("four", "r", None)] * 3) == ([4.0] * 3, 0)


async def test_async_user_function(reward_dir: Path) -> None:
    async with _scorer("async_match", reward_dir) as s:
        rewards, errors = await s.score_many([("p", "a", "a"), ("p", "a", "b")] * 3)
    assert (rewards, errors) == ([1.0, 0.0] * 3, 0)


async def test_raising_calls_score_zero_are_counted_and_logged_once(
    reward_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="trainer_svc.inputs.scorer")
    async with _scorer("picky", reward_dir) as s:
        rewards, errors = await s.score_many(
            [("p", "good", None), ("p", "bad 1", None), ("p", "bad 2", None)])
        assert (rewards, errors) == ([1.0, 0.0, 0.0], 2)
        assert await s.score_many([("p", "bad 3", None)]) == ([0.0], 1)
        assert s.counts.raised == s.counts.total == 3
    logged = [r for r in caplog.records if "raised an exception" in r.getMessage()]
    assert len(logged) == 1
    assert "Traceback" in logged[0].getMessage() and "KeyError" in logged[0].getMessage()


async def test_timeout_kills_the_call_and_the_next_call_works(reward_dir: Path) -> None:
    async with _scorer("slow", reward_dir, timeout_s=1.0) as s:
        started = time.monotonic()
        rewards, errors = await s.score_many(
            [("p", "slow", None), ("p", "fast", None), ("p", "slow", None), ("p", "x", None)])
        assert time.monotonic() - started < 20  # both workers time out together, ~1 s
        assert (rewards, errors) == ([0.0, 1.0, 0.0, 1.0], 2)
        assert s.counts.timeouts == 2
        # The killed workers were replaced.
        assert await s.score_many([("p", "fast", None)] * 4) == ([1.0] * 4, 0)


async def test_the_event_loop_keeps_running_during_a_slow_reward(reward_dir: Path) -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.05)
            ticks += 1

    async with _scorer("slow", reward_dir, timeout_s=1.0, workers=1) as s:
        task = asyncio.create_task(ticker())
        await s.score_many([("p", "slow", None)])
        task.cancel()
    assert ticks >= 10


async def test_invalid_values_and_dying_workers_are_counted(reward_dir: Path) -> None:
    async with _scorer("odd", reward_dir) as s:
        rewards, errors = await s.score_many(
            [("p", "nan", None), ("p", "str", None), ("p", "true", None), ("p", "x", None)])
        assert (rewards, errors) == ([0.0, 0.0, 1.0, 0.5], 2)
        assert s.counts.invalid == 2
    async with _scorer("dies", reward_dir, workers=1) as s:
        assert await s.score_many([("p", "die", None), ("p", "ok", None)]) == ([0.0, 1.0], 1)
        assert s.counts.crashed == 1


@pytest.mark.parametrize(("name", "cause"), [
    ("python:i12_nowhere:f", "cannot import module 'i12_nowhere'"),
    ("python:i12_user_rewards:missing", "has no attribute 'missing'"),
])
async def test_unresolvable_functions_fail_at_start(reward_dir: Path, name: str,
                                                    cause: str) -> None:
    scorer = RewardScorer(name, reward_path=[str(reward_dir)])
    with pytest.raises(RewardNameError, match=cause) as err:
        await scorer.start()
    assert err.value.spec == name
    with pytest.raises(RewardNameError, match="unknown reward"):
        RewardScorer("nonsense")


SECRETS = {"RLBOOST_WEIGHTS_TOKEN": "w-secret", "RLBOOST_API_TOKEN": "api-secret",
           "NATS_TRAINER_PASSWORD": "nats-secret", "RLBOOST_NATS_URL": "nats://t:pw@h:4222",
           "RLBOOST_REDIS_URL": "redis://:pw@h:6379/0", "HF_TOKEN": "hf-secret",
           "AWS_SECRET_ACCESS_KEY": "aws-secret"}


async def test_workers_get_a_scrubbed_environment(
        reward_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reward reads os.environ in its worker: none of the trainer's secrets are there, what
    it needs to run is, and a name the operator passes (RLBOOST_REWARD_ENV) is."""
    for name, value in {**SECRETS, "OMP_NUM_THREADS": "1", "LC_ALL": "C.UTF-8",
                        "JUDGE_API_KEY": "asked-for"}.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "env.json"
    async with _scorer("environ", reward_dir, workers=1,
                       pass_env=["JUDGE_API_KEY"]) as s:
        assert await s.score_many([(str(out), "r", None)]) == ([1.0], 0)
    seen = json.loads(out.read_text())
    assert not SECRETS.keys() & seen.keys(), seen.keys()
    assert not any(v in str(seen) for v in SECRETS.values())
    assert {k: seen.get(k) for k in ("OMP_NUM_THREADS", "LC_ALL", "JUDGE_API_KEY")} == {
        "OMP_NUM_THREADS": "1", "LC_ALL": "C.UTF-8", "JUDGE_API_KEY": "asked-for"}
    assert seen["PATH"] == os.environ["PATH"]
    # With no names passed, the name asked for above stays out too.
    async with _scorer("environ", reward_dir, workers=1) as s:
        assert await s.score_many([(str(out), "r", None)]) == ([1.0], 0)
    seen = json.loads(out.read_text())
    assert not SECRETS.keys() & seen.keys() and "JUDGE_API_KEY" not in seen
