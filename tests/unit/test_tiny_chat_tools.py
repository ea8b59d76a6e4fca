"""The embedded model tiny-chat-tools: its key, its warm-up conversations, and that it calls the
calculator.

The build here is a short warm-up on tool conversations only (the key covers the step count, so
it never meets a real build); the effect of RL on the tool share is measured by the example
``examples/tiny-chat-tools.json`` (examples/README.md).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared.generation import DrawKey, generate
from trainer_svc.embedded import tiny_chat as tc
from trainer_svc.embedded import tiny_chat_tools as tt
from trainer_svc.embedded import word_problems
from trainer_svc.inputs.calculator import CalculatorEnv
from trainer_svc.inputs.chat import ChatFormat, eos_token_ids

QUICK_STEPS = 80  # enough for the conversation's form (not its arithmetic): ~10 s on one core
EVAL = Path(__file__).resolve().parents[2] / "examples" / "data" / "word-problems-eval.jsonl"


def test_tiny_chat_key_is_unchanged_and_the_variant_covers_its_recipe(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # tiny-chat's cached builds stay valid: the variant left its recipe as it was.
    assert tc.tiny_chat_key(0) == "92c7e5672463eeb9"
    key = tt.tiny_chat_tools_key(0)
    assert key not in (tc.tiny_chat_key(0), tt.tiny_chat_tools_key(1))
    monkeypatch.setattr(tc, "WARMUP_STEPS", tc.WARMUP_STEPS + 1)
    assert tt.tiny_chat_tools_key(0) != key
    monkeypatch.undo()
    monkeypatch.setattr(tt, "TOOL_SHARE", 0.5)
    assert tt.tiny_chat_tools_key(0) != key


def test_warm_up_conversations_are_what_the_calculator_run_samples() -> None:
    tok = tt.train_tokenizer()
    chat = ChatFormat(tok)
    im_end = tc.token_id(tok, tc.IM_END)
    # The observation ids between turns are the trainer's own (ChatFormat.observation).
    obs = tok(tt.observation_text(tok, "12"), add_special_tokens=False)["input_ids"]
    assert obs == chat.observation("12", im_end)
    # The tool's syntax is merged into a few tokens by the variant's tokenizer.
    assert len(tok("<calc>7+5</calc>", add_special_tokens=False)["input_ids"]) <= 8

    train, _ = word_problems.splits()
    problem = next(p for p in train if p.answer.startswith("7+5="))
    target = tt.mixed_target(tok)
    rng = random.Random(0)
    drawn = [target(problem, rng) for _ in range(2000)]
    tools = [d for d in drawn if len(d) == 3]
    assert abs(len(tools) / len(drawn) - tt.TOOL_SHARE) < 0.04
    call, observation, final = tools[0]
    assert [call[1], observation[1], final[1]] == [True, False, True]  # no loss on the tool
    assert observation[0] == chat.observation("12", im_end)
    assert call[0][-1] == im_end and final[0][-1] == im_end
    env = CalculatorEnv(problem.prompt, problem.answer, 0)
    # Played against the calculator environment, the conversation earns the task's reward.
    assert env.step(chat.decode(call[0]), "c0") == {"observation": "12", "reward": None,
                                                    "done": False}
    assert env.step(chat.decode(final[0]), "c1") == {"observation": None, "reward": 1.0,
                                                     "done": True}
    direct = [d for d in drawn if len(d) == 1]
    assert all(tok.decode(d[0][0]).startswith("7+5=12\n#### ") for d in direct)


@pytest.fixture(scope="module")
def quick_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tc, "WARMUP_STEPS", QUICK_STEPS)
        mp.setattr(tt, "TOOL_SHARE", 1.0)
        model_dir = tt.build_tiny_chat_tools(tmp_path_factory.mktemp("data"), seed=0)
        assert model_dir.name == f"tiny-chat-tools-{tt.tiny_chat_tools_key(0)}"
        yield model_dir


def test_greedy_rollout_calls_the_calculator_then_answers(quick_model: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(quick_model, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(quick_model, local_files_only=True)
    chat, eos = ChatFormat(tok), eos_token_ids(quick_model, tok)
    rows = [json.loads(line) for line in EVAL.read_text().splitlines()[:8]]
    envs = [CalculatorEnv(r["prompt"], r["answer"], 0) for r in rows]
    seqs = [chat.render(r["prompt"]).prompt_token_ids for r in rows]
    keys = [DrawKey(0, 0, i, 0) for i in range(len(rows))]
    with torch.no_grad():
        calls = generate(model, seqs, 16, 0.0, eos, keys)
    for i, ids in enumerate(calls):
        action = chat.decode(ids)
        assert action.startswith("<calc>") and action.endswith("</calc>"), action
        out = envs[i].step(action, f"c{i}")
        assert not out["done"] and not out["observation"].startswith("error"), out
        seqs[i] = seqs[i] + ids + chat.observation(out["observation"], ids[-1])
    with torch.no_grad():
        finals = generate(model, seqs, 16, 0.0, eos, keys)
    for i, ids in enumerate(finals):
        out = envs[i].step(chat.decode(ids), f"f{i}")
        assert out["done"] and out["reward"] is not None, chat.decode(ids)
