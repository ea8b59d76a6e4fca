"""The run spec's data fields: names and defaults as the design writes them, conflicts refused."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from rollout_svc.engines.emu_models import SERVING
from shared.errors import ProtocolError
from shared.protocol import decode
from shared.spec import RunSpec, engine_mismatch
from trainer_svc.learn.compute_model import PRESETS

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


def test_the_shipped_agentic_example_spec_is_valid() -> None:
    body = json.loads((ROOT / "examples" / "tiny-chat-tools.json").read_text())
    run = spec(body)
    assert (run.model, run.env, run.reward_name) == ("tiny-chat-tools", "calculator", "math")
    assert 2 <= run.max_turns <= 4 and run.eval is None  # eval is single-turn (examples/README)
    assert run.dataset is not None and (ROOT / run.dataset.path).is_file()


def test_only_the_emu_engine_serves_an_emu_preset_and_it_serves_nothing_else() -> None:
    for preset in {*PRESETS, *SERVING}:  # every name the trainer or the emu engine knows
        assert engine_mismatch("emu", preset) is None
        for engine in ("torch", "sglang"):
            assert engine_mismatch(engine, preset) == f"engine {engine} cannot serve model {preset}"
    for model in ("tiny", "tiny-chat", "tiny-chat-tools", "/models/qwen", "emulator-7b"):
        assert engine_mismatch("emu", model) == f"engine emu cannot serve model {model}"
        assert engine_mismatch("torch", model) is None and engine_mismatch("sglang", model) is None
