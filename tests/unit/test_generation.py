"""The one sampler (shared.generation): generate() draws exactly what the torch engine draws.

The torch engine schedules the same primitives in waves (tests/unit/test_engine_torch.py covers
its batching, resume and aborts); here :func:`generate`, the loop the trainer's eval and
self-checks run, is held to the engine's tokens request by request, and to its own rules.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rollout_svc.engines import GenRequest
from rollout_svc.engines.torch_engine import TorchEngine
from shared.generation import DrawKey, generate, sample_token
from shared.sampling import pick, uniform

VOCAB = 16
EOS = 15


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model")
    torch.manual_seed(4)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=True,
                         initializer_range=0.3)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def _prompts() -> list[list[int]]:
    return [[(5 * i + j) % 14 + 1 for j in range(1 + 2 * i)] for i in range(5)]


def _engine_tokens(model_dir: Path, prompts: list[list[int]], keys: list[DrawKey],
                   temperature: float, max_new_tokens: int) -> list[list[int]]:
    engine = TorchEngine(threads=1, max_batch=2)
    engine.load(model_dir, "run", 1)
    for i, (prompt, key) in enumerate(zip(prompts, keys, strict=True)):
        engine.add(GenRequest(
            request_id=str(i), prompt_token_ids=prompt, committed_token_ids=[],
            max_new_tokens=max_new_tokens, temperature=temperature, seed=key.seed,
            step=key.step, prompt_index=key.prompt_index, sample_index=key.sample_index,
            eos_token_id=EOS, weight_version=1))
    out: list[list[int]] = [[] for _ in prompts]
    while engine.has_work():
        for event in engine.step():
            out[int(event.request_id)].append(event.token_id)
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.0, 0.6])
def test_generate_draws_what_the_torch_engine_draws(model_dir: Path, temperature: float) -> None:
    model = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    prompts = _prompts()
    keys = [DrawKey(9, 3, i, i % 2) for i in range(len(prompts))]
    got = generate(model, prompts, 10, temperature, [EOS], keys)
    assert got == _engine_tokens(model_dir, prompts, keys, temperature, 10)
    for response in got:
        assert 1 <= len(response) <= 10
        assert EOS not in response[:-1]
        assert len(response) == 10 or response[-1] == EOS


def test_every_eos_stops_and_rows_do_not_depend_on_each_other(model_dir: Path) -> None:
    model = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    prompts = _prompts()
    keys = [DrawKey(1, 0, i, 0) for i in range(len(prompts))]
    free = generate(model, prompts, 12, 1.0, [], keys)
    assert all(len(r) == 12 for r in free)
    stops = {free[0][2], free[1][0]}
    cut = generate(model, prompts, 12, 1.0, stops, keys)
    for whole, response in zip(free, cut, strict=True):
        end = next((k + 1 for k, t in enumerate(whole) if t in stops), len(whole))
        assert response == whole[:end]
    assert [generate(model, [p], 12, 1.0, [], [k])[0] for p, k in zip(prompts, keys, strict=True)
            ] == free


def test_sample_token_is_the_keyed_inverse_cdf() -> None:
    logits = torch.tensor([0.5, 2.0, -1.0, 1.0])
    key = DrawKey(2, 5, 7, 1)
    probs = torch.softmax(logits.double() / 0.8, dim=-1)
    expected = pick(torch.cumsum(probs, dim=-1).tolist(), uniform(2, 5, 7, 1, 3))
    assert sample_token(logits, 0.8, key, 3) == expected
    assert sample_token(logits, 0.0, key, 3) == 1
    draws = {sample_token(logits, 1.0, key, pos) for pos in range(256)}
    assert draws == {0, 1, 2, 3}, "positions are independent draws over the whole support"


def test_sample_token_draws_what_pick_draws_over_the_whole_vocabulary() -> None:
    """The C search keeps shared.sampling.pick's rule exactly: vocabularies from 2 to 150k,
    peaked rows whose tail underflows to 0 (runs of equal cumulative values), and temperatures
    around 1; every draw equals pick over the same float64 cumulative list."""
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for vocab, scale in ((2, 1.0), (14, 3.0), (1000, 40.0), (151_936, 8.0)):
        for r in range(6):
            logits = torch.randn(vocab, generator=gen) * scale
            for temperature in (0.6, 1.0, 1.3):
                key = DrawKey(r, vocab, 3, 1)
                probs = torch.softmax(logits.double() / temperature, dim=-1)
                cumulative = torch.cumsum(probs, dim=-1).tolist()
                for pos in range(4):
                    expected = pick(cumulative, uniform(r, vocab, 3, 1, pos))
                    assert sample_token(logits, temperature, key, pos) == expected
                    checked += 1
    assert checked == 4 * 6 * 3 * 4


def test_generate_refuses_bad_arguments(model_dir: Path) -> None:
    model = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    key = DrawKey(0, 0, 0, 0)
    assert generate(model, [], 4, 1.0, [EOS], []) == []
    assert generate(model, [[1, 2]], 0, 1.0, [EOS], [key]) == [[]]
    with pytest.raises(ValueError, match="draw keys"):
        generate(model, [[1, 2]], 4, 1.0, [EOS], [])
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[]], 4, 1.0, [EOS], [key])
    with pytest.raises(ValueError, match="temperature"):
        generate(model, [[1]], 4, -0.5, [EOS], [key])
