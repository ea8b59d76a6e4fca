"""The embedded text model tiny-chat: tokenizer, chat template, offline loading, generation.

The build here runs a few warm-up steps (the key covers the step count, so it never meets a
real build); the warm-up's effect on reward is measured by ``trainer_svc.selfcheck.chat``.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared.generation import DrawKey, generate
from trainer_svc.embedded import tiny_chat as tc
from trainer_svc.inputs.chat import ChatFormat, eos_token_ids

QUICK_STEPS = 3


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    data_dir = tmp_path_factory.mktemp("data")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tc, "WARMUP_STEPS", QUICK_STEPS)
        yield data_dir, tc.build_tiny_chat(data_dir, seed=0)


def test_directory_is_keyed_complete_and_cached(built: tuple[Path, Path],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    data_dir, model_dir = built
    monkeypatch.setattr(tc, "WARMUP_STEPS", QUICK_STEPS)
    assert model_dir == data_dir / "models" / f"tiny-chat-{tc.tiny_chat_key(0)}"
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "generation_config.json"} <= names
    assert [p.name for p in model_dir.parent.iterdir()] == [model_dir.name]
    monkeypatch.setattr(tc, "build_into", lambda *a: pytest.fail("rebuilt a cached model"))
    assert tc.build_tiny_chat(data_dir, seed=0) == model_dir
    assert tc.tiny_chat_key(0) != tc.tiny_chat_key(1)


def test_tokenizer_round_trips_any_utf8(built: tuple[Path, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(built[1], local_files_only=True)
    assert type(tok).__name__ == "Qwen2Tokenizer"  # what transformers forces for qwen2
    samples = ["Mia has 7 cards.", "héllo wörld ☃ 日本語 🎉", "tabs\tand\nnewlines  ",
               "e\u0301 (decomposed)", "\x00\x7f", "#### 1,234.5 = \\boxed{3/4}"]
    for text in samples:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        # The normalizer is NFC, as in Qwen's own tokenizer.
        assert tok.decode(ids) == unicodedata.normalize("NFC", text)
    # Trained merges make the problem text compact: whole words, one token per digit.
    words = tok(" Mia has 7 cards. How many apples?", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(words) == [
        "ĠMia", "Ġhas", "Ġ", "7", "Ġcards", ".", "ĠHow", "Ġmany", "Ġapples", "?"]
    assert tok.convert_ids_to_tokens(tok("123", add_special_tokens=False)["input_ids"]) == [
        "1", "2", "3"]
    # The loaded tokenizer is the trained one, id for id.
    trained = tc.train_tokenizer()
    text = "Tom has 9 stamps. He gets 3 more stamps.\n9+3=12\n#### 12"
    assert trained(text)["input_ids"] == tok(text)["input_ids"]


def test_special_tokens_and_chat_template(built: tuple[Path, Path]) -> None:
    model_dir = built[1]
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids = {t: tok.convert_tokens_to_ids(t) for t in tc.SPECIAL_TOKENS}
    assert ids == {tc.ENDOFTEXT: 0, tc.IM_START: 1, tc.IM_END: 2}
    assert (tok.eos_token, tok.pad_token) == (tc.IM_END, tc.ENDOFTEXT)
    assert eos_token_ids(model_dir, tok) == [2, 0]
    chat = ChatFormat(tok, system_prompt="Be brief.")
    rendered = chat.render("What is 2+2?")
    assert rendered.prompt_text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.prompt_token_ids[0] == 1 and rendered.prompt_token_ids.count(2) == 2
    assert tok.decode(rendered.prompt_token_ids) == rendered.prompt_text


def test_loads_with_auto_classes_and_generates(built: tuple[Path, Path]) -> None:
    model_dir = built[1]
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert model.config.model_type == "qwen2"
    assert model.generation_config.eos_token_id == [2, 0]
    ids = ChatFormat(tok).render("Anna has 3 apples. How many apples?").prompt_token_ids
    torch.manual_seed(0)
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                         dtype=torch.long), max_new_tokens=6)
    assert out.shape[0] == 1 and 1 <= out.shape[1] - len(ids) <= 6


def test_batched_sampling_matches_one_prompt_at_a_time(built: tuple[Path, Path]) -> None:
    model_dir = built[1]
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    chat = ChatFormat(tok)
    prompts = [chat.render(p).prompt_token_ids for p in
               ("Tom has 2 cards.", "Lucy had 14 shells and lost 5 of them. How many are left?")]
    assert len(prompts[0]) != len(prompts[1])  # left padding is exercised
    keys = [DrawKey(5, 0, i, 0) for i in range(len(prompts))]
    batched = generate(model, prompts, 8, 0.0, [2, 0], keys)
    alone = [generate(model, [p], 8, 0.0, [2, 0], [k])[0]
             for p, k in zip(prompts, keys, strict=True)]
    assert batched == alone
    sampled = generate(model, prompts * 4, 8, 1.0, [2, 0], keys * 4)
    assert sampled[:2] * 4 == sampled  # the same key draws the same response in any row
    assert sampled == [generate(model, [p], 8, 1.0, [2, 0], [k])[0]
                       for p, k in zip(prompts * 4, keys * 4, strict=True)]
    for response in batched + sampled:
        assert len(response) == 8 or response[-1] in (0, 2)


def test_build_is_deterministic_and_leaves_global_state(tmp_path: Path) -> None:
    torch.manual_seed(42)
    expected = torch.rand(3)
    torch.manual_seed(42)
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tc, "WARMUP_STEPS", 2)
        a = tc.build_tiny_chat(tmp_path / "a", seed=5)
        b = tc.build_tiny_chat(tmp_path / "b", seed=5)
    assert torch.equal(torch.rand(3), expected)
    assert torch.get_num_threads() == threads
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    wa = AutoModelForCausalLM.from_pretrained(a, local_files_only=True).state_dict()
    wb = AutoModelForCausalLM.from_pretrained(b, local_files_only=True).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
