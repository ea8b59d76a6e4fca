"""The env pool: episodes in worker processes, timeouts, contract breaches and the counters
(real worker processes)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from trainer_svc.inputs.envs import EnvNameError
from trainer_svc.inputs.tool_pool import EnvPool, byte_fit

USER_ENVS = '''
import os, time

class Tool:
    """Appends each call id to a file; behaves badly on request."""
    def __init__(self, prompt, answer, seed):
        if prompt == "boom":
            raise RuntimeError("factory exploded")
        self.log = os.environ["CALL_LOG"]

    def step(self, action, call_id):
        with open(self.log, "a") as f:
            f.write(call_id + "\\n")
        if action == "hang":
            time.sleep(600)
        if action == "raise":
            raise KeyError("step exploded")
        if action == "int":
            return {"observation": 42, "reward": None, "done": False}
        if action == "list":
            return ["not", "a", "dict"]
        if action == "long":
            return {"observation": "é" * 1000, "reward": None, "done": False}
        if action == "done":
            return {"observation": None, "reward": 0.5, "done": True}
        return {"observation": "ok " + action, "reward": None, "done": False}

    def restore(self, history):
        if history and history[-1]["action"] == "unrestorable":
            raise ValueError("cannot rebuild from " + history[-1]["call_id"])
        self.restored = len(history)
'''


def failures(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value("rlboost_env_call_failures_total", {"reason": reason}) or 0.0


def value(registry: CollectorRegistry, name: str) -> float:
    return registry.get_sample_value(name) or 0.0


@pytest.fixture
def user_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "envs"
    root.mkdir()
    (root / "call_log_env.py").write_text(USER_ENVS)
    monkeypatch.setenv("CALL_LOG", str(tmp_path / "calls.log"))
    return root


def pool(root: Path, registry: CollectorRegistry, **kw: object) -> EnvPool:
    opts: dict[object, object] = {"tool_s": 1.0, "workers": 2, "max_turns": 4,
                                  "max_observation_tokens": 64}
    opts.update(kw)
    return EnvPool("python:call_log_env:Tool", dirs=[root], registry=registry,
                   pass_env=["CALL_LOG"], **opts)  # type: ignore[arg-type]


async def test_episodes_step_with_deterministic_call_ids(user_root: Path, tmp_path: Path) -> None:
    registry = CollectorRegistry()
    async with pool(user_root, registry) as envs:
        assert await envs.open("r:1:0:0", "p", None, 7) is None
        assert await envs.open("r:1:0:1", "p", None, 7) is None
        a = await envs.step("r:1:0:0", 0, "a")
        b = await envs.step("r:1:0:1", 0, "b")
        done = await envs.step("r:1:0:0", 1, "done")
        envs.committed(2)  # the commit path's hook
    assert (a.call_id, a.observation, a.done, a.error) == ("r:1:0:0:0", "ok a", False, None)
    assert (b.call_id, b.observation) == ("r:1:0:1:0", "ok b")
    assert (done.reward, done.done, done.error) == (0.5, True, None)
    assert (tmp_path / "calls.log").read_text().split() == ["r:1:0:0:0", "r:1:0:1:0",
                                                           "r:1:0:0:1"]
    assert value(registry, "rlboost_env_calls_total") == 3
    assert value(registry, "rlboost_env_calls_committed_total") == 2


async def test_a_hanging_tool_is_killed_within_max_tool_s(user_root: Path) -> None:
    registry = CollectorRegistry()
    async with pool(user_root, registry, workers=1) as envs:
        await envs.open("r:1:0:0", "p", None, 0)
        await envs.open("r:1:0:1", "p", None, 0)  # same worker: lost with it
        started = time.monotonic()
        hung = await envs.step("r:1:0:0", 0, "hang")
        took = time.monotonic() - started
        other = await envs.step("r:1:0:1", 0, "x")
        # The worker is replaced: a new episode runs.
        await envs.open("r:1:0:2", "p", None, 0)
        fresh = await envs.step("r:1:0:2", 0, "y")
    assert 1.0 <= took < 1.0 + 1.5, took
    assert (hung.error, hung.done, hung.reward, hung.observation) == ("timeout", True, 0.0, None)
    assert other.error == "lost" and other.done
    assert fresh.observation == "ok y" and fresh.error is None
    assert value(registry, "rlboost_env_call_timeouts_total") == 1
    assert failures(registry, "timeout") == 1 and failures(registry, "lost") == 1


async def test_bad_steps_are_counted_and_end_the_episode(
        user_root: Path, caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    async with pool(user_root, registry) as envs:
        outcomes = {}
        for n, action in enumerate(("int", "list", "raise")):
            await envs.open(f"r:1:{n}:0", "p", None, 0)
            outcomes[action] = await envs.step(f"r:1:{n}:0", 0, action)
        boom = await envs.open("r:1:9:0", "boom", None, 0)
        after_boom = await envs.step("r:1:9:0", 0, "x")
        await envs.open("r:1:8:0", "p", None, 0)
        again = await envs.step("r:1:8:0", 0, "int")
        after_end = await envs.step("r:1:0:0", 1, "x")  # ended by its invalid step
    assert outcomes["int"].error == "invalid" and "observation is int" in outcomes["int"].detail
    assert outcomes["list"].error == "invalid" and "not a dict" in outcomes["list"].detail
    assert outcomes["raise"].error == "raised" and "step exploded" in outcomes["raise"].detail
    assert all(o.done and o.reward == 0.0 for o in outcomes.values())
    assert boom is not None and boom.error == "factory" and "factory exploded" in boom.detail
    assert after_boom.error == "lost" and after_end.error == "lost"
    assert again.error == "invalid"
    assert failures(registry, "invalid") == 3 and failures(registry, "raised") == 1
    assert failures(registry, "factory") == 1
    # The first of each reason is logged with its cause, the rest only counted.
    invalid_logs = [r for r in caplog.records if "(invalid)" in r.getMessage()]
    assert len(invalid_logs) == 1


async def test_limits_cut_observations_and_turns(user_root: Path) -> None:
    registry = CollectorRegistry()
    async with pool(user_root, registry, max_turns=2, max_observation_tokens=64) as envs:
        await envs.open("r:1:0:0", "p", None, 0)
        long = await envs.step("r:1:0:0", 0, "long")
        last = await envs.step("r:1:0:0", 1, "x")  # the last turn: made done
        await envs.open("r:1:1:0", "p", None, 0)
        past = await envs.step("r:1:1:0", 2, "x")
    assert long.truncated and long.observation == "é" * 32 and not long.done
    assert (last.done, last.observation, last.error) == (True, None, None)
    assert past.error == "max_turns" and past.done
    assert value(registry, "rlboost_env_observations_truncated_total") == 1
    assert failures(registry, "max_turns") == 1


async def test_builtin_calculator_through_the_pool() -> None:
    async with EnvPool("calculator", tool_s=30.0, workers=1, max_turns=3) as envs:
        await envs.open("r:0:0:0", "Anna has 4 bags of 3 apples.", "4*3=12\n#### 12", 0)
        calc = await envs.step("r:0:0:0", 0, "<calc>4*3</calc>")
        answer = await envs.step("r:0:0:0", 1, "#### 12")
    assert calc.observation == "12" and not calc.done
    assert answer.reward == 1.0 and answer.done and answer.error is None


async def test_an_unknown_or_unloadable_env_fails_at_start(tmp_path: Path) -> None:
    with pytest.raises(EnvNameError, match="unknown env"):
        EnvPool("shell")
    envs = EnvPool("python:nowhere_env:Tool", dirs=[tmp_path], workers=1)
    with pytest.raises(EnvNameError, match="No module named 'nowhere_env'"):
        await envs.start()


async def test_calls_wait_for_a_busy_worker_without_the_wait_counting(user_root: Path) -> None:
    registry = CollectorRegistry()
    async with pool(user_root, registry, workers=1, tool_s=2.0) as envs:
        for k in range(3):
            await envs.open(f"r:1:0:{k}", "p", None, 0)
        outs = await asyncio.gather(*(envs.step(f"r:1:0:{k}", 0, "x") for k in range(3)))
    assert [o.observation for o in outs] == ["ok x"] * 3
    assert failures(registry, "timeout") == 0


def test_byte_fit_never_splits_a_character() -> None:
    assert byte_fit("abc", 5) == ("abc", False)
    assert byte_fit("éé", 3) == ("é", True)


def test_pools_of_successive_runs_share_one_registry(user_root: Path) -> None:
    """A trainer opens a pool per run on its one registry: the second must not fail on
    counters the first registered, and both count into them."""
    registry = CollectorRegistry()
    first = pool(user_root, registry)
    second = pool(user_root, registry)
    first.committed()
    second.committed(2)
    assert value(registry, "rlboost_env_calls_committed_total") == 3


async def test_restore_rebuilds_or_fails_counted(user_root: Path) -> None:
    registry = CollectorRegistry()
    async with pool(user_root, registry) as envs:
        await envs.open("r:1:0:0", "p", None, 0)
        ok = await envs.restore("r:1:0:0", 1, [{"call_id": "r:1:0:0:0", "action": "a",
                                                "observation": "ok a"}])
        held = envs.holds("r:1:0:0")
        await envs.open("r:1:1:0", "p", None, 0)
        bad = await envs.restore("r:1:1:0", 1, [{"call_id": "r:1:1:0:0",
                                                 "action": "unrestorable", "observation": ""}])
        after = await envs.step("r:1:1:0", 1, "x")
        never = await envs.restore("r:1:2:0", 1, [])
    assert ok is None and held
    assert bad is not None and (bad.error, bad.done, bad.call_id) == ("restore", True, "r:1:1:0:1")
    assert "cannot rebuild from r:1:1:0:0" in bad.detail
    assert after.error == "lost" and not envs.holds("r:1:1:0")
    assert never is not None and never.error == "lost"
    assert failures(registry, "restore") == 1 and failures(registry, "lost") == 2
