"""The embedded tiny model: offline HF loading, tokenizer ids, caching, partial competence."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared.generation import DrawKey, generate
from trainer_svc.embedded import task, tiny
from trainer_svc.learn.checkpoint import load_policy


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    data_dir = tmp_path_factory.mktemp("data")
    return data_dir, tiny.build_tiny(data_dir, seed=0)


def test_directory_is_keyed_and_complete(built: tuple[Path, Path]) -> None:
    data_dir, model_dir = built
    assert model_dir.parent == data_dir / "models"
    assert model_dir.name == f"tiny-{tiny.tiny_key(0)}"
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    # No temporary build directory is left beside it.
    assert [p.name for p in (data_dir / "models").iterdir()] == [model_dir.name]


def test_loads_offline_with_auto_classes(built: tuple[Path, Path]) -> None:
    _, model_dir = built
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    assert model.config.vocab_size == len(task.VOCAB)
    assert model.generation_config.eos_token_id == task.EOS_ID
    assert model.generation_config.pad_token_id == task.PAD_ID
    out = model(input_ids=torch.tensor([task.make_prompt(1, 2)])).logits
    assert out.shape == (1, task.PROMPT_LEN, len(task.VOCAB))


def test_tokenizer_round_trips_digits_and_specials(built: tuple[Path, Path]) -> None:
    _, model_dir = built
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.sep_token_id) == (
        task.PAD_ID, task.BOS_ID, task.EOS_ID, task.SEP_ID,
    )
    ids = tok.encode("0 1 2 3 4 5 6 7 8 9", add_special_tokens=False)
    assert ids == task.DIGIT_IDS
    # transformers forces its Qwen2 tokenizer class on a qwen2 model; it decodes without
    # separators, which is fine for a one-character-per-token vocabulary.
    assert tok.decode(ids).replace(" ", "") == "0123456789"
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids
    prompt = task.make_prompt(3, 2)
    assert tok.encode("<bos> 3 2 <sep>", add_special_tokens=False) == prompt


def test_cache_hit_returns_same_dir_without_rebuilding(
    built: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    data_dir, model_dir = built

    def boom(*args: object) -> None:
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(tiny, "_build_into", boom)
    assert tiny.build_tiny(data_dir, seed=0) == model_dir
    # A different seed is a different model: it must not hit this cache entry.
    assert tiny.tiny_key(1) != tiny.tiny_key(0)


def test_losing_a_build_race_keeps_the_winner(
    built: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, model_dir = built
    data_dir = tmp_path / "race"
    final = data_dir / "models" / model_dir.name

    def racing_build(out_dir: Path, seed: int) -> None:
        # The other process finishes first, while we are still building.
        import shutil

        shutil.copytree(model_dir, final)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(tiny, "_build_into", racing_build)
    assert tiny.build_tiny(data_dir, seed=0) == final
    assert (final / "model.safetensors").is_file()
    assert sorted(p.name for p in final.parent.iterdir()) == [final.name]


def test_warmed_up_policy_is_partially_competent(built: tuple[Path, Path]) -> None:
    _, model_dir = built
    model = load_policy(model_dir)
    prompts = [p for p in task.all_prompts() for _ in range(8)]
    keys = [DrawKey(123, 0, i // 8, i % 8) for i in range(len(prompts))]
    responses = generate(model, prompts, task.DEFAULT_MAX_NEW_TOKENS, 1.0, [task.EOS_ID], keys,
                         task.PAD_ID)
    rewards = [task.reward(p, r) for p, r in zip(prompts, responses, strict=True)]
    mean = statistics.fmean(rewards)
    assert 0.25 <= mean <= 0.75, mean
    # It has learned the format: nearly every response is 5 digits and an EOS.
    well_formed = sum(len(r) == task.RESPONSE_LEN + 1 and r[-1] == task.EOS_ID for r in responses)
    assert well_formed >= 0.9 * len(responses)


def test_build_is_deterministic_and_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(42)
    expected = torch.rand(3)
    torch.manual_seed(42)
    # A cheap build: the determinism of init + warm-up does not depend on the step count.
    a_dir = tmp_path / "a"
    b_dir = tmp_path / "b"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny, "WARMUP_STEPS", 3)
        a = tiny.build_tiny(a_dir, seed=5)
        b = tiny.build_tiny(b_dir, seed=5)
    assert torch.equal(torch.rand(3), expected)
    wa, wb = load_policy(a).state_dict(), load_policy(b).state_dict()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
