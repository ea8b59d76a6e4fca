"""GRPO math against independent references: float64, explicit Python loops, no vectorization."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import Qwen2ForCausalLM

from trainer_svc import grpo, task
from trainer_svc.model import tiny_config

EPS, EPS_HIGH = 0.2, 0.28


def ref_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    n = len(rewards)
    mean = sum(rewards) / n
    if n < 2 or all(r == rewards[0] for r in rewards):
        return [0.0] * n
    var = sum((r - mean) ** 2 for r in rewards) / (n - 1)
    return [(r - mean) / (math.sqrt(var) + eps) for r in rewards]


def ref_token_terms(new: list[list[float]], old: list[list[float]], adv: list[float],
                    eps: float, eps_high: float) -> tuple[float, list[list[float]]]:
    """The loss sum and d(loss)/d(new logprob) per token, one token at a time."""
    total = 0.0
    grads: list[list[float]] = []
    for i in range(len(new)):
        a = adv[i]
        row: list[float] = []
        for t in range(len(new[i])):
            ratio = math.exp(new[i][t] - old[i][t])
            clipped_ratio = min(max(ratio, 1.0 - eps), 1.0 + eps_high)
            total += -min(ratio * a, clipped_ratio * a)
            # The clipped branch is the minimum (and flat) only past the bound on the side
            # the advantage pushes towards; anywhere else the gradient is -A * ratio.
            flat = (a > 0 and ratio > 1.0 + eps_high) or (a < 0 and ratio < 1.0 - eps)
            row.append(0.0 if flat else -a * ratio)
        grads.append(row)
    return total, grads


def test_group_advantages_match_loop_reference() -> None:
    rng = random.Random(0)
    for n in (2, 3, 8, 16):
        rewards = [rng.choice([0.0, 0.2, 0.4, 0.6, 0.8, 1.0]) for _ in range(n)]
        rewards[0], rewards[1] = 0.0, 1.0  # never all equal
        got = grpo.group_advantages(torch.tensor(rewards, dtype=torch.float64))
        assert got.tolist() == pytest.approx(ref_advantages(rewards), abs=1e-12)


def test_group_advantages_use_unbiased_std() -> None:
    got = grpo.group_advantages(torch.tensor([0.0, 1.0], dtype=torch.float64), eps=0.0)
    # mean 0.5, unbiased std sqrt(0.5): +-0.5/0.7071 (the biased std would give +-1)
    assert got.tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)])


@pytest.mark.parametrize("rewards", [[0.4] * 8, [1.0], [0.0, 0.0]])
def test_group_without_signal_gets_zero_advantages(rewards: list[float]) -> None:
    got = grpo.group_advantages(torch.tensor(rewards, dtype=torch.float64))
    assert got.tolist() == [0.0] * len(rewards)


def _clipping_case(seed: int) -> tuple[list[list[float]], list[list[float]], list[float]]:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 7) for _ in range(12)]
    new = [[-rng.uniform(0.05, 3.0) for _ in range(n)] for n in lengths]
    # log-ratio in [-0.6, 0.6]: ratios 0.55..1.82, so both clip bounds are crossed.
    old = [[x - rng.uniform(-0.6, 0.6) for x in row] for row in new]
    adv = [rng.uniform(-2.0, 2.0) for _ in lengths]
    adv[0], adv[1] = 1.5, -1.5  # both signs for sure
    return new, old, adv


@pytest.mark.parametrize(("seed", "eps_high"), [(0, None), (1, EPS_HIGH), (2, EPS_HIGH)])
def test_loss_sum_and_gradient_match_loop_reference(seed: int, eps_high: float | None) -> None:
    new, old, adv = _clipping_case(seed)
    high = EPS if eps_high is None else eps_high
    # The case must exercise every branch, or this test could pass on a wrong formula.
    ratios = [
        (math.exp(n - o), a)
        for rn, ro, a in zip(new, old, adv, strict=True)
        for n, o in zip(rn, ro, strict=True)
    ]
    assert any(a > 0 and r > 1 + high for r, a in ratios)
    assert any(a < 0 and r < 1 - EPS for r, a in ratios)
    assert any(a > 0 and r < 1 - EPS for r, a in ratios)
    assert any(a < 0 and r > 1 + high for r, a in ratios)

    new_t = [torch.tensor(row, dtype=torch.float64, requires_grad=True) for row in new]
    old_t = [torch.tensor(row, dtype=torch.float64) for row in old]
    loss, tokens = grpo.grpo_token_loss_sum(
        new_t, old_t, torch.tensor(adv, dtype=torch.float64), EPS, eps_high
    )
    ref_loss, ref_grads = ref_token_terms(new, old, adv, EPS, high)
    assert tokens == sum(len(r) for r in new)
    assert float(loss.detach()) == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
    loss.backward()
    for t, ref_row in zip(new_t, ref_grads, strict=True):
        assert t.grad is not None
        assert t.grad.tolist() == pytest.approx(ref_row, rel=1e-12, abs=1e-12)


def test_ratio_one_reduces_to_policy_gradient() -> None:
    new = [torch.tensor([-0.5, -1.0], dtype=torch.float64, requires_grad=True)]
    loss, n = grpo.grpo_token_loss_sum(new, [new[0].detach()], torch.tensor([0.7]))
    assert n == 2 and float(loss.detach()) == pytest.approx(-1.4)
    loss.backward()
    assert new[0].grad is not None and new[0].grad.tolist() == pytest.approx([-0.7, -0.7])


def test_loss_rejects_mismatched_inputs() -> None:
    with pytest.raises(ValueError):
        grpo.grpo_token_loss_sum([torch.zeros(2)], [], torch.zeros(1))


def _model64(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(tiny_config()).to(torch.float64)


def _group(rng: random.Random, size: int) -> tuple[list[list[int]], list[list[int]], list[float]]:
    prompt = task.make_prompt(rng.randrange(10), rng.randint(1, 3))
    responses = [
        [rng.choice(task.DIGIT_IDS) for _ in range(rng.randint(1, 7))] + [task.EOS_ID]
        for _ in range(size)
    ]
    return [prompt] * size, responses, [task.reward(prompt, r) for r in responses]


def test_response_logprobs_batched_equals_one_at_a_time() -> None:
    model = _model64()
    rng = random.Random(3)
    prompts, responses, _ = _group(rng, 6)
    prompts[1] = prompts[1][:2]  # unequal prompt lengths too
    batched = grpo.response_logprobs(model, prompts, responses, task.PAD_ID)
    with torch.no_grad():
        for p, r, got in zip(prompts, responses, batched, strict=True):
            logits = model(input_ids=torch.tensor([p + r])).logits[0]
            logp = torch.log_softmax(logits, dim=-1)
            want = [float(logp[len(p) - 1 + j, tok]) for j, tok in enumerate(r)]
            assert got.shape == (len(r),)
            assert got.tolist() == pytest.approx(want, abs=1e-10)


def _batch_step(model, opt, groups, max_norm: float) -> None:
    """One step over all groups at once: the reference the streaming accumulator must equal."""
    prompts = [p for g in groups for p in g[0]]
    responses = [r for g in groups for r in g[1]]
    adv = torch.cat(
        [grpo.group_advantages(torch.tensor(g[2], dtype=torch.float64)) for g in groups]
    )
    new = grpo.response_logprobs(model, prompts, responses, task.PAD_ID)
    old = [t.detach() for t in new]
    loss, tokens = grpo.grpo_token_loss_sum(new, old, adv)
    loss.backward()
    # Scale after backward, as the accumulator does: HF's RMSNorm runs in float32 even in a
    # float64 model, so scaling before backward would differ at ~1e-7 for reasons unrelated
    # to streaming.
    for p in model.parameters():
        p.grad.mul_(1.0 / tokens)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("max_norm", [1e6, 0.05])
def test_streaming_groups_equal_one_batch(max_norm: float) -> None:
    rng = random.Random(7)
    groups = [_group(rng, 8), _group(rng, 8)]
    assert all(len(set(g[2])) > 1 for g in groups)
    streamed, batched = _model64(), _model64()
    # SGD, not Adam: Adam's first step is scale-free and would hide a wrong 1/tokens factor.
    opt_s = torch.optim.SGD(streamed.parameters(), lr=0.5)
    opt_b = torch.optim.SGD(batched.parameters(), lr=0.5)
    acc = grpo.GrpoAccumulator(streamed, opt_s, clip_eps=0.2, pad_id=task.PAD_ID)
    for g in groups:
        acc.add_group(*g)
    stats = acc.step(max_grad_norm=max_norm)
    _batch_step(batched, opt_b, groups, max_norm)

    assert stats["tokens"] == sum(len(r) for g in groups for r in g[1])
    assert stats["groups"] == 2 and stats["grad_norm"] > 0
    moved = 0.0
    for (name, ps), pb, p0 in zip(
        streamed.named_parameters(), batched.parameters(), _model64().parameters(), strict=True
    ):
        torch.testing.assert_close(ps, pb, rtol=0, atol=1e-12, msg=name)
        moved = max(moved, float((ps - p0).detach().abs().max()))
    assert moved > 1e-6  # the step did something, so equality is not vacuous


def test_zero_signal_group_counts_tokens_but_adds_no_gradient() -> None:
    rng = random.Random(11)
    model = _model64()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    acc = grpo.GrpoAccumulator(model, opt, pad_id=task.PAD_ID)
    prompts, responses, _ = _group(rng, 4)
    acc.add_group(prompts, responses, [0.6] * 4)
    assert all(p.grad is None for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    stats = acc.step()
    assert stats["tokens"] == sum(len(r) for r in responses)
    assert stats["grad_norm"] == 0.0
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)
