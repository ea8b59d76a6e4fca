"""Chat formatting: template on or off, system prompts, decoding, EOS ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainer_svc.embedded import tiny
from trainer_svc.embedded import tiny_chat as tc
from trainer_svc.inputs.chat import ChatFormat, ChatFormatError, eos_token_ids, has_chat_template


@pytest.fixture(scope="module")
def chat_tok() -> Any:
    return tc.train_tokenizer()


def test_template_is_the_default_when_the_tokenizer_has_one(chat_tok: Any) -> None:
    assert has_chat_template(chat_tok)
    rendered = ChatFormat(chat_tok).render("Tom has 2 cards.")
    assert rendered.prompt == "Tom has 2 cards."
    assert rendered.prompt_text == (
        "<|im_start|>user\nTom has 2 cards.<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.prompt_token_ids == chat_tok(rendered.prompt_text,
                                                 add_special_tokens=False)["input_ids"]


def test_template_can_be_turned_off(chat_tok: Any) -> None:
    rendered = ChatFormat(chat_tok, chat_template=False).render("Tom has 2 cards.")
    assert rendered.prompt_text == "Tom has 2 cards."
    assert chat_tok.decode(rendered.prompt_token_ids) == "Tom has 2 cards."


def test_system_prompt_comes_first(chat_tok: Any) -> None:
    chat = ChatFormat(chat_tok, chat_template=True, system_prompt="Answer with ####.")
    assert chat.messages("q") == [{"role": "system", "content": "Answer with ####."},
                                  {"role": "user", "content": "q"}]
    assert chat.render("q").prompt_text.startswith("<|im_start|>system\nAnswer with ####.")


def test_options_the_tokenizer_cannot_honour() -> None:
    plain = tiny.build_tokenizer()
    assert not has_chat_template(plain)
    assert ChatFormat(plain).render("1 2").prompt_text == "1 2"
    with pytest.raises(ChatFormatError, match="has no chat template"):
        ChatFormat(plain, chat_template=True)
    with pytest.raises(ChatFormatError, match="system_prompt needs a chat template"):
        ChatFormat(plain, system_prompt="be nice")


def test_decode_skips_special_tokens(chat_tok: Any) -> None:
    ids = chat_tok("7+5=12\n#### 12<|im_end|><|endoftext|>", add_special_tokens=False)[
        "input_ids"]
    assert ids[-2:] == [2, 0]
    assert ChatFormat(chat_tok).decode(ids) == "7+5=12\n#### 12"


def test_eos_ids_from_generation_config_then_tokenizer(chat_tok: Any, tmp_path: Path) -> None:
    assert eos_token_ids(None, chat_tok) == [2]
    assert eos_token_ids(tmp_path, chat_tok) == [2]  # no generation_config.json there
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert eos_token_ids(tmp_path, chat_tok) == [0, 2]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert eos_token_ids(tmp_path, chat_tok) == [2, 0]

    class NoEos:
        eos_token_id = None

    (tmp_path / "generation_config.json").write_text("{}")
    with pytest.raises(ChatFormatError, match="no EOS token id"):
        eos_token_ids(tmp_path, NoEos())


def test_an_observation_continues_a_trajectory_as_the_template_renders_it(
        chat_tok: Any) -> None:
    """Prompt ids + the model's sampled turn (to its end-of-turn id) + the observation's ids
    decode to exactly what the template renders for the whole conversation, and the
    observation's ids are the template's text between the turns, tokenized once."""
    chat = ChatFormat(chat_tok)
    prompt = chat.render("Tom has 2 cards and buys 3.")
    turn = chat_tok("<calc>2+3</calc><|im_end|>", add_special_tokens=False)["input_ids"]
    obs = chat.observation("5", turn_end=turn[-1])
    assert chat_tok.decode(obs) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    conversation = [{"role": "user", "content": "Tom has 2 cards and buys 3."},
                    {"role": "assistant", "content": "<calc>2+3</calc>"},
                    {"role": "tool", "content": "5"}]
    rendered = chat_tok.apply_chat_template(conversation, tokenize=False,
                                            add_generation_prompt=True)
    assert chat_tok.decode(prompt.prompt_token_ids + turn + obs) == rendered
    assert ChatFormat(chat_tok, chat_template=False).observation("5", turn[-1]) == chat_tok(
        "5", add_special_tokens=False)["input_ids"]
