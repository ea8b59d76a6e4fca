"""The environment contract: names, loading through the reward path, step results, call ids,
the calculator built-in and the spec fields (in-process: no workers)."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest

from shared.names import call_id, request_id
from shared.protocol import decode
from shared.spec import RunSpec
from trainer_svc.inputs.calculator import CalculatorEnv, evaluate
from trainer_svc.inputs.envs import (
    EnvNameError,
    InvalidStep,
    StepResult,
    check_spec,
    check_step_result,
    resolve_env,
)
from trainer_svc.inputs.python_env import PythonEnv

USER_ENV = '''
class Echo:
    def __init__(self, prompt, answer, seed):
        self.prompt, self.seed = prompt, seed

    def step(self, action, call_id):
        return {"observation": f"{self.prompt}|{action}|{call_id}|{self.seed}",
                "reward": None, "done": False}

not_callable = 3
'''


def test_call_id_is_a_pure_function_of_request_and_turn() -> None:
    rid = request_id("run-1", 4, 2, 7)
    assert call_id(rid, 3) == call_id(request_id("run-1", 4, 2, 7), 3) == "run-1:4:2:7:3"
    ids = {call_id(request_id("run-1", s, p, k), t)
           for s in range(2) for p in range(2) for k in range(2) for t in range(3)}
    assert len(ids) == 24  # distinct for every (step, prompt, sample, turn)
    with pytest.raises(ValueError, match="turn"):
        call_id(rid, -1)


def test_builtins_resolve_and_make_episodes() -> None:
    calc = resolve_env("calculator")("q", "#### 3", 0)
    assert calc.step("<calc>1+2</calc>", "c")["observation"] == "3"
    py = resolve_env("python", tool_s=2.0)("q", None, 0)
    assert isinstance(py, PythonEnv)
    assert py.limits.wall_s == pytest.approx(1.6) and py.limits.cpu_s == 2


def test_user_factory_loads_from_the_reward_path(tmp_path: Path) -> None:
    (tmp_path / "echo_env_mod.py").write_text(USER_ENV)
    try:
        env = resolve_env("python:echo_env_mod:Echo", [str(tmp_path)])("hi", None, 5)
        assert env.step("act", "r:0:0:0:1") == {"observation": "hi|act|r:0:0:0:1|5",
                                                "reward": None, "done": False}
    finally:
        sys.modules.pop("echo_env_mod", None)


@pytest.mark.parametrize(("spec", "cause"), [
    ("nope", "unknown env"),
    ("python:onlymodule", "expected python:<module>:<factory>"),
    ("python:echo_env_mod2:Missing", "has no attribute 'Missing'"),
    ("python:echo_env_mod2:not_callable", "is not callable"),
    ("python:absent_env_mod:Echo", "No module named 'absent_env_mod' in the reward path"),
    # An installed package or the standard library: refused before anything is imported.
    ("python:json:loads", "No module named 'json' in the reward path"),
    ("python:os:system", "No module named 'os' in the reward path"),
])
def test_bad_env_specs_name_the_cause(tmp_path: Path, spec: str, cause: str) -> None:
    (tmp_path / "echo_env_mod2.py").write_text(USER_ENV)
    try:
        with pytest.raises(EnvNameError, match=cause) as err:
            resolve_env(spec, [str(tmp_path)])
        assert str(err.value).startswith(f"env {spec!r}")
    finally:
        sys.modules.pop("echo_env_mod2", None)


def test_a_module_outside_the_roots_is_refused(tmp_path: Path) -> None:
    outside, root = tmp_path / "outside", tmp_path / "root"
    outside.mkdir()
    root.mkdir()
    (outside / "stray_env_mod.py").write_text(USER_ENV)
    with pytest.raises(EnvNameError, match="No module named 'stray_env_mod'"):
        resolve_env("python:stray_env_mod:Echo", [str(root)])
    assert "stray_env_mod" not in sys.modules
    check_spec("python:stray_env_mod:Echo")  # well formed; only loading refuses it


@pytest.mark.parametrize(("value", "why"), [
    ("text", "not a dict"),
    ({"observation": 3, "reward": None, "done": False}, "observation is int"),
    ({"observation": None, "reward": "1", "done": True}, "not a finite number"),
    ({"observation": None, "reward": float("nan"), "done": True}, "not a finite number"),
    ({"observation": None, "reward": None, "done": 1}, "done is int"),
    ({"observation": None, "reward": None}, "done required"),
    ({"observation": None, "done": True, "extra": 1}, "expected observation"),
])
def test_step_results_outside_the_contract_are_refused(value: object, why: str) -> None:
    with pytest.raises(InvalidStep, match=why):
        check_step_result(value)


def test_step_results_inside_the_contract() -> None:
    assert check_step_result({"observation": "o", "reward": True, "done": True}) == \
        StepResult("o", 1.0, True)
    assert check_step_result({"done": False}) == StepResult(None, None, False)


@pytest.mark.parametrize(("expression", "value"), [
    ("2*(3+4)", "14"), ("7/2", "3.5"), ("8/2", "4"), (" 10 // 3 ", "3"), ("-(2**3)", "-8"),
    ("1/3", "0.3333333333"),
])
def test_calculator_evaluates_arithmetic(expression: str, value: str) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(("expression", "why"), [
    ("1/0", "ZeroDivisionError"), ("9**999", "exponent"), ("x+1", "not defined"),
    ("__import__('os')", "error"), ("'a'*3", "not a number"), ("", "empty"),
    ("1+" * 150 + "1", "longer than"), ("(2).__class__", "error"),
])
def test_calculator_refuses_what_is_not_arithmetic(expression: str, why: str) -> None:
    out = evaluate(expression)
    assert out.startswith("error") and why in out


def test_a_calculator_episode_calls_the_tool_then_answers() -> None:
    env = CalculatorEnv("Tom has 7 apples and buys 5. How many?", "7+5=12\n#### 12", 0)
    first = env.step("I add. <calc>7+5</calc>", "r:0:0:0:0")
    assert first == {"observation": "12", "reward": None, "done": False}
    assert env.step("#### 12", "r:0:0:0:1") == {"observation": None, "reward": 1.0,
                                                 "done": True}
    wrong = CalculatorEnv("q", "#### 12", 0).step("<calc>7-5</calc> so #### 2", "c")
    assert wrong == {"observation": None, "reward": 0.0, "done": True}  # the answer wins
    assert CalculatorEnv("q", "#### 12", 0).step("no idea", "c")["reward"] == 0.0


def test_run_spec_env_fields_default_and_bound() -> None:
    spec = RunSpec()
    assert (spec.env, spec.max_turns, spec.max_tool_s, spec.max_observation_tokens) == \
        ("", 1, 10.0, 256)
    base = b'"model": "tiny-chat", "dataset": {"path": "d.jsonl"}'
    ok = decode(b'{' + base + b', "env": "calculator", "max_turns": 4}', RunSpec)
    assert (ok.env, ok.max_turns) == ("calculator", 4)
    assert decode(b'{' + base + b', "env": "python:m.sub:make"}', RunSpec).env == \
        "python:m.sub:make"
    for body, why in [
        (b', "env": "shell"', "env 'shell': unknown"),
        (b', "env": "python:m"', "unknown; use one of calculator, python"),
        (b', "max_turns": 2', "max_turns 2 needs an env"),
        (b', "env": "calculator", "max_turns": 33', "<= 32"),
        (b', "env": "calculator", "max_tool_s": 0', "> 0.0"),
        (b', "env": "calculator", "max_observation_tokens": 0', ">= 1"),
    ]:
        with pytest.raises(Exception, match=why):
            decode(b'{' + base + body + b'}', RunSpec)
    with pytest.raises(Exception, match="env needs a dataset"):
        decode(b'{"env": "calculator"}', RunSpec)
    with pytest.raises(Exception, match="dynamic_sampling is not supported"):
        decode(b'{"model": "emu", "env": "python:m:f", "max_turns": 3, '
               b'"dynamic_sampling": true}', RunSpec)
    # The emulated model's environments read the task's prompts: no dataset needed.
    assert decode(b'{"model": "emu", "env": "python:m:f", "max_turns": 3}', RunSpec).env
    assert msgspec.json.decode(msgspec.json.encode(ok))["env"] == "calculator"
