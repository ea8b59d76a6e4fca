"""Streaming = batch for every algorithm, with several passes and mini-batches per step.

The streaming side is :class:`StepTrainer` as the trainer drives it: groups added one at a
time in a shuffled order, then ``step`` at the barrier. The batch side is written here from
the definitions: every group at once, final advantages from
:func:`~trainer_svc.learn.algorithms.advantages.step_advantages`, old (and reference) log-probs in
one forward with the step's weights, then ``updates_per_step`` passes of ``minibatches``
optimizer steps, each on the mini-batch's whole objective divided by its denominator.
float64 model, SGD (Adam's first step is scale-free and would hide a wrong denominator),
``atol = 1e-12`` on every parameter after the step. HF's RMSNorm computes in float32 whatever
the model's dtype; the fixture of tests/support/float64.py keeps it in float64, or
REINFORCE++'s streamed parts (two gradient sums combined at the barrier) would differ from the
direct sum at ~1e-8 by float32 rounding alone, which says nothing about streaming.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from shared.algorithm import Algorithm, AlgorithmConfig, OffPolicy
from tests.support.float64 import (
    float64_rms_norm,  # noqa: F401 (autouse fixture)
    model64,
)
from trainer_svc.embedded import task
from trainer_svc.learn.algorithms import advantages, logprobs, losses
from trainer_svc.learn.algorithms.off_policy import behaviour_weights
from trainer_svc.learn.step_trainer import Group, RunShape, StepTrainer

MAX_NEW = 8
GROUPS = 4
LR = 2.0  # large, so a second pass moves ratios past the clip and clip_fraction is non-zero
TEMPERATURE = 0.7  # T != 1: every log-prob is taken at the sampling temperature


def _groups(seed: int = 7) -> list[Group]:
    rng = random.Random(seed)
    mu_rng = random.Random(seed + 1)  # apart, so the groups themselves stay as they were
    out = []
    for index in range(GROUPS):
        prompt = task.make_prompt(rng.randrange(10), rng.randint(1, 3))
        responses = []
        for _ in range(4):
            body = [rng.choice(task.DIGIT_IDS) for _ in range(rng.randint(1, MAX_NEW))]
            # Some responses run out of budget without an EOS: truncated.
            responses.append(body if len(body) == MAX_NEW else [*body, task.EOS_ID])
        rewards = [task.reward(prompt, r) for r in responses]
        if index == 1:
            rewards = [0.25] * 4  # all equal: no signal for group-relative estimators
        else:
            rewards[0], rewards[1] = 0.0, 1.0
        # What an engine would report it sampled each token with (off-policy cases read it);
        # one response's is unknown, as from an engine that gives none (weighted 1).
        behaviour = [[-3.0 * mu_rng.random() for _ in r] for r in responses]
        behaviour[2] = []
        out.append(Group(prompt_index=index, prompts=[prompt] * 4, responses=responses,
                         rewards=rewards, truncated=[len(r) == MAX_NEW for r in responses],
                         behaviour=behaviour))
    return out


def _batch_step(model: torch.nn.Module, cfg: AlgorithmConfig, groups: list[Group],
                reference: torch.nn.Module | None) -> None:
    """The batch computation the streamed step must equal (module doc)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    shaped = []
    for g in groups:
        lengths = [len(r) for r in g.responses]
        rewards = advantages.shaped(g.rewards, lengths, MAX_NEW, cfg.overlong_buffer) \
            if cfg.overlong_buffer else list(g.rewards)
        shaped.append((torch.tensor(rewards, dtype=torch.float64), lengths))
    adv = [a for group in advantages.step_advantages(cfg.estimator, shaped) for a in group]
    prompts = [p for g in groups for p in g.prompts]
    responses = [r for g in groups for r in g.responses]
    behaviour = [b for g in groups for b in (g.behaviour or [[]] * len(g.responses))]
    with torch.no_grad():
        old = logprobs.response_logprobs(model, prompts, responses, task.PAD_ID, TEMPERATURE)
        ref = logprobs.response_logprobs(reference, prompts, responses, task.PAD_ID,
                                         TEMPERATURE) if reference is not None else None
    per_group = len(groups[0].responses)
    bounds = [k * len(groups) // cfg.minibatches for k in range(cfg.minibatches + 1)]
    for _ in range(cfg.updates_per_step):
        for k in range(cfg.minibatches):
            rows = slice(bounds[k] * per_group, bounds[k + 1] * per_group)
            scores = logprobs.response_scores(model, prompts[rows], responses[rows],
                                              task.PAD_ID, temperature=TEMPERATURE,
                                              entropy=True)
            weights = None
            if cfg.off_policy is not OffPolicy.NONE:
                mu = [o if not b else torch.tensor(b, dtype=o.dtype)
                      for o, b in zip(old[rows], behaviour[rows], strict=True)]
                weights = behaviour_weights(cfg.off_policy, cfg.off_policy_cap, old[rows], mu)
            obj = losses.objective(cfg, scores.logprobs, old[rows], adv[rows],
                                   ref=ref[rows] if ref is not None else None,
                                   entropy=scores.entropy, weights=weights)
            obj.partial.backward()
            denom = losses.denominator(cfg.loss_agg, obj.counts, MAX_NEW)
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(1.0 / denom)
            torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.grad is not None], 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)


def _streamed_step(model: torch.nn.Module, cfg: AlgorithmConfig, groups: list[Group],
                   reference: torch.nn.Module | None) -> dict[str, float]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    trainer = StepTrainer(model, opt, cfg, RunShape(MAX_NEW, TEMPERATURE, GROUPS), task.PAD_ID,
                          reference=reference)
    order = list(groups)
    random.Random(1).shuffle(order)  # groups complete in any order
    for g in order:
        trainer.add_group(g)
    return trainer.step()


CASES = [(a.value, {}) for a in Algorithm] + [
    # DAPO's dynamic sampling: the mini-batches are known only at the barrier, nothing streams.
    ("dapo", {"dynamic_sampling": True}),
    # Batch-normalised advantages with the KL and entropy terms streaming beside them.
    ("reinforce_pp_baseline", {"kl_coef": 0.05, "kl_estimator": "k3", "entropy_coef": 0.01}),
    ("grpo", {"kl_coef": 0.1, "kl_estimator": "k2", "loss_agg": "seq_mean_token_mean"}),
    # Off-policy corrections: group scope streams the weighted objective, batch scope the
    # weighted first-pass parts; several passes reuse the step's proximal log-probs.
    ("grpo", {"off_policy": "tis", "updates_per_step": 2}),
    ("reinforce_pp", {"off_policy": "decoupled", "off_policy_cap": 3.0}),
]


@pytest.mark.parametrize(("algorithm", "knobs"), CASES, ids=[f"{a}{'+' if k else ''}"
                                                           f"{'-'.join(k)}" for a, k in CASES])
def test_streaming_equals_batch_with_several_updates(algorithm: str, knobs: dict[str, object]
                                                     ) -> None:
    cfg = AlgorithmConfig.for_run(
        {"algorithm": algorithm, "updates_per_step": 2, "minibatches": 2,
         "dynamic_sampling": False, **knobs}, max_new_tokens=MAX_NEW, groups_per_step=GROUPS)
    reference = model64(seed=1) if cfg.needs_reference else None
    groups = _groups()
    streamed, batched = model64(), model64()
    stats = _streamed_step(streamed, cfg, groups, reference)
    _batch_step(batched, cfg, groups, reference)

    moved = 0.0
    for (name, ps), pb, p0 in zip(streamed.named_parameters(), batched.parameters(),
                                  model64().parameters(), strict=True):
        torch.testing.assert_close(ps, pb, rtol=0, atol=1e-12, msg=name)
        moved = max(moved, float((ps - p0).detach().abs().max()))
    assert moved > 1e-6  # the step did something, so equality is not vacuous
    assert stats["optimizer_steps"] == 4
    # The second pass runs on moved weights: some ratios leave the clip range.
    assert stats["clip_fraction"] > 0
    assert ("kl" in stats) is cfg.needs_reference
    if cfg.off_policy is not OffPolicy.NONE:  # the weights were applied, and differ from 1
        assert stats["off_policy_weight"] != pytest.approx(1.0, abs=1e-3)
        assert stats["behaviour_log_ratio_abs"] > 0
    if cfg.needs_reference:
        assert stats["kl"] > 0  # the reference is another model
    # One pass of two mini-batches streams at most its first: 1/4 of the backward, or
    # nothing where the mini-batches wait for the barrier.
    silent = cfg.scope.value == "group" and cfg.kl_coef == 0 and cfg.entropy_coef == 0
    live = [g for g in groups if not (silent and g.prompt_index == 1)]
    first = sum(len(r) for g in live if g.prompt_index < GROUPS // 2 for r in g.responses)
    total = 2 * sum(len(r) for g in live for r in g.responses)
    want = 0.0 if cfg.dynamic_sampling else first / total
    assert stats["streamed_fraction"] == pytest.approx(want)


def test_one_pass_streams_everything_and_reports_the_data() -> None:
    cfg = AlgorithmConfig.for_algorithm("grpo")
    groups = _groups()
    stats = _streamed_step(model64(), cfg, groups, None)
    lengths = [len(r) for g in groups for r in g.responses]
    assert stats["streamed_fraction"] == 1.0 and stats["optimizer_steps"] == 1
    assert stats["clip_fraction"] == 0.0  # ratio 1: nothing clips on the first pass
    assert stats["tokens"] == sum(lengths) and stats["groups"] == GROUPS
    assert stats["response_len_mean"] == pytest.approx(sum(lengths) / len(lengths))
    assert stats["response_len_max"] == max(lengths)
    truncated = sum(t for g in groups for t in g.truncated)
    assert stats["truncated_fraction"] == pytest.approx(truncated / len(lengths))
    adv = torch.cat([a for group in advantages.step_advantages(cfg.estimator, [
        (torch.tensor(g.rewards, dtype=torch.float64), [len(r) for r in g.responses])
        for g in groups]) for a in group])
    assert stats["advantage_mean"] == pytest.approx(float(adv.mean()), abs=1e-12)
    assert stats["advantage_std"] == pytest.approx(float(adv.std(unbiased=False)), rel=1e-9)
    assert "kl" not in stats and stats["entropy"] > 0


def test_a_step_without_signal_takes_no_optimizer_step() -> None:
    model = model64()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    trainer = StepTrainer(model, opt, AlgorithmConfig.for_algorithm("grpo"), RunShape(),
                          task.PAD_ID)
    g = _groups()[1]  # all-equal rewards
    trainer.add_group(g)
    before = [p.detach().clone() for p in model.parameters()]
    stats = trainer.step()
    assert stats["grad_norm"] == 0.0 and stats["optimizer_steps"] == 0
    assert stats["tokens"] == sum(len(r) for r in g.responses)
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)


def test_a_group_added_twice_is_refused() -> None:
    model = model64()
    trainer = StepTrainer(model, torch.optim.SGD(model.parameters(), lr=LR),
                          AlgorithmConfig.for_algorithm("grpo"), RunShape(), task.PAD_ID)
    trainer.add_group(_groups()[0])
    with pytest.raises(ValueError, match="twice"):
        trainer.add_group(_groups()[0])


def test_dr_grpo_divides_every_mini_batch_by_the_budget_not_its_longest_response() -> None:
    """Dr. GRPO (arXiv 2503.20783 §3.1): each response's token sum over the generation budget,
    a run constant. Here no response comes near the budget (at most 5 of 16 tokens), and each
    of the 2 x 2 optimizer steps' loss must still be ``sum_i sum_t l_it / (N_mb * 16)``, with
    ``l_it = max(-A_i r_it, -A_i clip(r_it, 0.8, 1.2))`` and ``A_i = r_i - mean(group)``."""
    budget, lr = 16, 0.5
    rng = random.Random(3)
    groups = []
    for index in range(GROUPS):
        prompt = task.make_prompt(rng.randrange(10), 2)
        responses = [[*(rng.choice(task.DIGIT_IDS) for _ in range(rng.randint(1, 4))),
                      task.EOS_ID] for _ in range(4)]
        groups.append(Group(prompt_index=index, prompts=[prompt] * 4, responses=responses,
                            rewards=[rng.choice([0.0, 0.5, 1.0]) for _ in range(3)] + [0.25],
                            truncated=[False] * 4))
    cfg = AlgorithmConfig.for_run({"algorithm": "dr_grpo", "minibatches": 2,
                                   "updates_per_step": 2}, max_new_tokens=budget,
                                  groups_per_step=GROUPS)
    assert cfg.loss_agg.value == "seq_mean_token_sum_norm"
    trained, expected = model64(), model64()
    trainer = StepTrainer(trained, torch.optim.SGD(trained.parameters(), lr=lr), cfg,
                          RunShape(budget, TEMPERATURE, GROUPS), task.PAD_ID)
    for g in groups:
        trainer.add_group(g)
    stats = trainer.step(max_grad_norm=math.inf)  # no clip: it would rescale the gradient

    opt = torch.optim.SGD(expected.parameters(), lr=lr)
    prompts = [p for g in groups for p in g.prompts]
    responses = [r for g in groups for r in g.responses]
    adv = [x - sum(g.rewards) / 4 for g in groups for x in g.rewards]
    with torch.no_grad():
        old = logprobs.response_logprobs(expected, prompts, responses, task.PAD_ID, TEMPERATURE)
    values, by_longest = [], []
    for _ in range(2):
        for rows in (range(0, 8), range(8, 16)):  # mini-batch k: groups 2k and 2k + 1
            new = logprobs.response_scores(expected, [prompts[i] for i in rows],
                                           [responses[i] for i in rows], task.PAD_ID,
                                           temperature=TEMPERATURE).logprobs
            total = sum((torch.maximum(-adv[i] * torch.exp(n - old[i]), -adv[i] * torch.clamp(
                torch.exp(n - old[i]), 0.8, 1.2)).sum() for i, n in zip(rows, new, strict=True)),
                torch.zeros((), dtype=torch.float64))
            loss = total / (len(rows) * budget)
            loss.backward()
            values.append(float(loss.detach()))
            by_longest.append(float(total.detach()) / (len(rows) * max(len(responses[i])
                                                                         for i in rows)))
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert max(len(r) for r in responses) <= 5 < budget
    assert stats["optimizer_steps"] == 4
    assert stats["loss"] == pytest.approx(sum(values) / 4, rel=1e-9, abs=1e-13)
    # The longest response's length would give a loss over three times as large.
    assert abs(sum(by_longest) / 4 - stats["loss"]) > 0.5 * abs(stats["loss"]) > 1e-4
    moved = 0.0
    for (name, pt), pe, p0 in zip(trained.named_parameters(), expected.parameters(),
                                  model64().parameters(), strict=True):
        torch.testing.assert_close(pt, pe, rtol=0, atol=1e-12, msg=name)
        moved = max(moved, float((pt - p0).detach().abs().max()))
    assert moved > 1e-6
