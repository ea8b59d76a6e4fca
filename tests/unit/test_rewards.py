"""Built-in reward functions and reward-name resolution (in-process: no workers)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from trainer_svc.inputs.rewards import (
    RewardNameError,
    check_spec,
    exact_reward,
    math_reward,
    normalize,
    resolve_reward,
)


@pytest.mark.parametrize(("response", "answer"), [
    ("0.75", "\\boxed{3/4}"),
    ("The answer is $\\frac{3}{4}$.", "3/4"),
    ("\\boxed{0.5}", "\\frac{1}{2}"),
    ("7+5=12\n#### 12", "7+5=12\n#### 12"),
    ("so she has 12 left", "#### 12"),
    ("1234", "1,234"),
    ("#### -5", "-5"),
])
def test_math_accepts_equivalent_final_answers(response: str, answer: str) -> None:
    assert math_reward("q", response, answer) == 1.0


@pytest.mark.parametrize(("response", "answer"), [
    ("7+5=12\n#### 13", "7+5=12\n#### 12"),
    # The value after #### is the final answer, even when the working says otherwise.
    ("12\n#### 11", "#### 12"),
    ("", "12"),
    ("twelve", "12"),
    ("0.76", "\\boxed{3/4}"),
])
def test_math_rejects_other_answers(response: str, answer: str) -> None:
    assert math_reward("q", response, answer) == 0.0


def test_math_needs_a_parseable_answer() -> None:
    with pytest.raises(ValueError, match="needs an answer"):
        math_reward("q", "12", None)
    with pytest.raises(ValueError, match="cannot parse the answer"):
        math_reward("q", "12", "no number here")


def test_exact_normalisation() -> None:
    assert normalize("  The   Cat\tsat.\n") == "the cat sat"
    assert normalize("Paris.") == normalize("paris") == "paris"
    assert normalize("3+4=7\n#### 7.") == "7"
    assert normalize("a.b.") == "a.b"
    assert exact_reward("q", " PARIS. ", "Paris") == 1.0
    assert exact_reward("q", "working\n#### 42", "6*7=42\n#### 42") == 1.0
    assert exact_reward("q", "Lyon", "Paris") == 0.0
    assert exact_reward("q", "4 2", "42") == 0.0
    with pytest.raises(ValueError, match="needs an answer"):
        exact_reward("q", "x", None)


def test_spec_syntax() -> None:
    for good in ("math", "exact", "python:pkg.mod:fn"):
        check_spec(good)
    for bad, cause in [("maths", "unknown reward"), ("python:mod", "expected python:"),
                       ("python::fn", "expected python:"), ("python:a:b:c", "expected python:")]:
        with pytest.raises(RewardNameError, match=cause) as err:
            check_spec(bad)
        assert err.value.spec == bad


def test_resolve_from_the_reward_path_and_the_builtin_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # restored after the test
    first, second = tmp_path / "a", tmp_path / "b"
    for d, value in ((first, 1.0), (second, 2.0)):
        d.mkdir()
        (d / "i12_user_reward.py").write_text(f"def score(p, r, a):\n    return {value}\n")
    fn = resolve_reward("python:i12_user_reward:score", [str(first), str(second)])
    assert fn("p", "r", None) == 1.0  # the first directory listed wins
    assert resolve_reward("python:trainer_svc.inputs.rewards:exact_reward") is exact_reward
    assert resolve_reward("math") is math_reward


def test_resolve_names_the_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "i12_broken.py").write_text("raise RuntimeError('bad import')\n")
    (tmp_path / "i12_value.py").write_text("score = 3\n")
    cases = [
        ("python:i12_missing:f", "cannot import module 'i12_missing'"),
        ("python:i12_broken:f", "RuntimeError: bad import"),
        ("python:i12_value:nope", "has no attribute 'nope'"),
        ("python:i12_value:score", "is not callable"),
    ]
    for spec, cause in cases:
        with pytest.raises(RewardNameError, match=cause):
            resolve_reward(spec, [str(tmp_path)])


@pytest.mark.parametrize(("spec", "cause"), [
    ("python:os:system", "No module named 'os' in the reward path"),
    ("python:subprocess:run", "No module named 'subprocess' in the reward path"),
    ("python:math_verify:parse", "No module named 'math_verify' in the reward path"),
    ("python:trainer_svc.saved:SavedRun", "No module named 'trainer_svc' in the reward path"),
])
def test_modules_outside_the_reward_path_are_refused_unimported(
        spec: str, cause: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "math_verify", raising=False)
    with pytest.raises(RewardNameError, match=cause):
        resolve_reward(spec, [str(tmp_path)])
    assert "math_verify" not in sys.modules  # refused before its import-time code ran


def test_a_reward_path_file_shadowed_by_a_loaded_module_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    # json is imported already: importing "json" would give the standard library's, whose
    # dumps the spec would then call, though a json.py is on the reward path.
    (tmp_path / "json.py").write_text("def dumps(p, r, a):\n    return 1.0\n")
    with pytest.raises(RewardNameError, match=r"loads from .*json.*not from the reward path"):
        resolve_reward("python:json:dumps", [str(tmp_path)])
