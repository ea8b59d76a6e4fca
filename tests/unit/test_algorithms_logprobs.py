"""Log-probs at the sampling temperature and dropout off, against a float64 loop reference.

The reference takes the model's logits one unpadded sequence at a time and computes the
tempered distribution by hand: ``log p_v = z_v / T - log sum_u exp(z_u / T)`` and
``H = -sum_v p_v log p_v``, with ``math`` in plain loops over the vocabulary (issue 12 part 6).
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import Qwen2ForCausalLM

from trainer_svc.embedded import task
from trainer_svc.embedded.tiny import tiny_config
from trainer_svc.learn.algorithms.logprobs import (
    dropout_off,
    logit_scale,
    response_logprobs,
    response_scores,
)


def _model(attention_dropout: float = 0.0) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = tiny_config()
    cfg.attention_dropout = attention_dropout
    model = Qwen2ForCausalLM(cfg).double()
    with torch.no_grad():
        # Sharper than a fresh init's near-uniform output, so the temperature matters.
        model.lm_head.weight.mul_(20.0)
    return model


def _batch(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    prompts, responses = [], []
    for _ in range(5):
        prompts.append(task.make_prompt(rng.randrange(10), rng.randint(1, 3))[: rng.randint(2, 9)])
        responses.append([rng.choice(task.DIGIT_IDS) for _ in range(rng.randint(1, 7))])
    responses[0].append(task.EOS_ID)
    return prompts, responses


def ref_scores(model: torch.nn.Module, prompt: list[int], response: list[int], temperature: float
               ) -> tuple[list[float], list[float]]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].tolist()
    t = 1.0 if temperature == 0 else temperature
    logps, ents = [], []
    for j, token in enumerate(response):
        z = [x / t for x in logits[len(prompt) - 1 + j]]
        top = max(z)
        lse = top + math.log(sum(math.exp(x - top) for x in z))
        logps.append(z[token] - lse)
        ent = 0.0
        for x in z:
            lp = x - lse
            ent -= math.exp(lp) * lp
        ents.append(ent)
    return logps, ents


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
def test_logprobs_and_entropy_at_temperature_match_reference(temperature: float) -> None:
    model = _model().eval()
    prompts, responses = _batch(1)
    got = response_scores(model, prompts, responses, task.PAD_ID, temperature=temperature,
                          entropy=True)
    assert got.entropy is not None
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        want_lp, want_h = ref_scores(model, p, r, temperature)
        assert got.logprobs[i].shape == (len(r),)
        assert got.logprobs[i].tolist() == pytest.approx(want_lp, rel=1e-9, abs=1e-10)
        assert got.entropy[i].tolist() == pytest.approx(want_h, rel=1e-9, abs=1e-10)
    if temperature != 1.0:
        plain = response_logprobs(model, prompts, responses, task.PAD_ID)
        assert not torch.allclose(plain[0], got.logprobs[0])  # the temperature did something


def test_greedy_temperature_scores_the_model_distribution() -> None:
    model = _model().eval()
    prompts, responses = _batch(2)
    greedy = response_logprobs(model, prompts, responses, task.PAD_ID, temperature=0.0)
    plain = response_logprobs(model, prompts, responses, task.PAD_ID, temperature=1.0)
    for a, b in zip(greedy, plain, strict=True):
        assert torch.equal(a, b)
    assert logit_scale(0.5) == 2.0
    with pytest.raises(ValueError):
        logit_scale(-0.1)
    with pytest.raises(ValueError):
        logit_scale(float("nan"))


def test_scores_carry_gradient() -> None:
    model = _model().eval()
    prompts, responses = _batch(3)
    got = response_scores(model, prompts, responses, task.PAD_ID, temperature=0.7, entropy=True)
    assert got.entropy is not None
    (torch.cat(got.logprobs).sum() + torch.cat(got.entropy).sum()).backward()
    assert model.lm_head.weight.grad is not None
    assert float(model.lm_head.weight.grad.abs().sum()) > 0


def test_dropout_off_is_deterministic_keeps_gradients_and_restores_modes() -> None:
    model = _model(attention_dropout=0.5).train()
    attn = model.model.layers[0].self_attn
    model.model.layers[1].eval()  # a submodule already in eval must stay so afterwards
    prompts, responses = _batch(4)
    torch.manual_seed(1)
    noisy = [response_logprobs(model, prompts, responses, task.PAD_ID) for _ in range(2)]
    # Dropout is active in train mode, so this test can see it being turned off.
    assert not all(torch.equal(a, b) for a, b in zip(*noisy, strict=True))
    with dropout_off(model):
        assert not model.training and not attn.training
        first = response_logprobs(model, prompts, responses, task.PAD_ID, temperature=1.3)
        second = response_logprobs(model, prompts, responses, task.PAD_ID, temperature=1.3)
        torch.cat(first).sum().backward()
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert model.training and attn.training
    assert not model.model.layers[1].training


def test_rejects_bad_batches() -> None:
    model = _model().eval()
    with pytest.raises(ValueError):
        response_scores(model, [[1]], [[2], [3]], task.PAD_ID)
    with pytest.raises(ValueError):
        response_scores(model, [[]], [[2]], task.PAD_ID)
    assert response_scores(model, [], [], task.PAD_ID, entropy=True).entropy == []
