"""The run spec's data fields: names and defaults as the design writes them, conflicts refused."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from shared.errors import ProtocolError
from shared.protocol import decode
from shared.spec import RunSpec

ROOT = Path(__file__).resolve().parents[2]


def spec(body: dict[str, object]) -> RunSpec:
    return decode(json.dumps(body).encode(), RunSpec)


def test_the_data_fields_have_the_designs_names_and_defaults() -> None:
    run = spec({"model": "tiny-chat", "dataset": {"path": "d.jsonl"},
                "eval": {"path": "e.jsonl", "every": 5}})
    assert run.dataset is not None and run.eval is not None
    assert msgspec.to_builtins(run.dataset) == {
        "path": "d.jsonl", "prompt_key": "prompt", "answer_key": "answer", "split": "train"}
    assert (run.eval.every, run.eval.prompt_key, run.eval.answer_key) == (5, "prompt", "answer")
    assert run.reward is None and run.reward_name == "math"  # a dataset's default reward
    assert run.chat_template is None and run.system_prompt is None
    assert RunSpec().task == "arith-seq" and RunSpec().dataset is None  # the default run


@pytest.mark.parametrize("reward", ["math", "exact", "python:my_rewards:score",
                                    "python:pkg.mod:fn_2"])
def test_reward_names_that_are_accepted(reward: str) -> None:
    assert spec({"model": "tiny-chat", "dataset": {"path": "d.jsonl"},
                 "reward": reward}).reward_name == reward


@pytest.mark.parametrize("body, says", [
    ({"reward": "mathh"}, "reward"),  # an unknown reward name
    ({"reward": "python:mod"}, "reward"),  # no function
    ({"reward": "python:mod:fn:extra"}, "reward"),
    ({"reward": "python:1mod:fn"}, "reward"),
    ({"dataset": {"path": ""}}, "path"),
    ({"dataset": {"path": "d.jsonl", "prompt": "q"}}, "prompt"),  # unknown field
    ({"dataset": {"prompt_key": "q"}}, "path"),  # no path
    ({"eval": {"path": "e.jsonl", "every": 0}}, "every"),
    ({"chat_template": "yes"}, "chat_template"),
])
def test_bad_data_fields_are_refused_naming_the_field(body: dict[str, object], says: str) -> None:
    with pytest.raises(ProtocolError, match=says):
        spec({"model": "tiny-chat", "dataset": {"path": "d.jsonl"}, **body})


@pytest.mark.parametrize("body, says", [
    ({"reward": "math"}, "reward needs a dataset"),
    ({"eval": {"path": "e.jsonl"}}, "eval needs a dataset"),
    ({"system_prompt": "Be brief."}, "system_prompt needs a dataset"),
    ({"dataset": {"path": "d.jsonl"}}, "model 'tiny' knows only"),  # model defaults to tiny
])
def test_fields_that_do_not_fit_together_are_refused(body: dict[str, object], says: str) -> None:
    with pytest.raises(ProtocolError, match=says):
        spec(body)


def test_the_shipped_example_spec_is_valid_and_its_files_exist() -> None:
    body = json.loads((ROOT / "examples" / "tiny-chat-math.json").read_text())
    run = spec(body)
    assert run.model == "tiny-chat" and run.reward_name == "math" and run.eval is not None
    assert run.dataset is not None and (ROOT / run.dataset.path).is_file()
    assert (ROOT / run.eval.path).is_file()
