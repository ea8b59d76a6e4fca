"""Observation tokens never receive gradient, for every algorithm and ``loss_agg`` mode.

Multi-turn responses interleave model turns with observation turns (shared.turns); the trainer
trains only the model turns' tokens. Against a float64 reference written here from the
definitions, veRL-style: every response scored whole, each per-token term (policy loss, KL,
entropy) multiplied by the 0/1 loss mask, each denominator built from the mask (trained tokens,
responses with a trained token, per-response trained-token means), GSPO's sequence ratio the
masked mean, REINFORCE++'s whitening over trained tokens only. :class:`StepTrainer` (groups
streamed in a shuffled order, two passes of two mini-batches, SGD) must end on the reference's
weights to 1e-12 and report its loss; and a spy on the logits shows that the rows predicting
an observation token get a gradient of exactly zero while the rows predicting model tokens do
not. The float64 set-up is tests/support/float64.py (its RMSNorm patch included).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from shared.algorithm import Algorithm, AlgorithmConfig, KlEstimator, LossAgg, PolicyLoss, Scope
from shared.turns import Turn, loss_mask
from tests.support.float64 import (
    float64_rms_norm,  # noqa: F401 (autouse fixture)
    model64,
)
from trainer_svc.embedded import task
from trainer_svc.learn.algorithms import advantages, logprobs
from trainer_svc.learn.step_trainer import Group, RunShape, StepTrainer

MAX_NEW = 12
GROUPS = 4
LR = 2.0  # large, so the second pass moves ratios past the clip
TEMPERATURE = 0.7


def _trajectory(rng: random.Random, shape: str) -> tuple[list[int], list[Turn]]:
    """A response and its turns: ``mom`` model-observation-model, ``mo`` ending on an
    observation (cut by the budget), ``m`` one model turn, ``o`` observation only."""
    parts = {"m": lambda: rng.randint(1, 4), "o": lambda: rng.randint(1, 3)}
    tokens: list[int] = []
    turns: list[Turn] = []
    for i, kind in enumerate(shape):
        n = parts[kind]()
        tokens += [rng.choice(task.DIGIT_IDS) for _ in range(n)]
        role = "model" if kind == "m" else "observation"
        turns.append(Turn(role=role, start=len(tokens) - n, end=len(tokens),
                          call_id="" if kind == "m" else f"call-{i}",
                          observation="" if kind == "m" else "7"))
    if shape.endswith("m"):
        tokens.append(task.EOS_ID)
        turns[-1] = Turn(role="model", start=turns[-1].start, end=len(tokens))
    return tokens, turns


SHAPES = [["mom", "mo", "m", "mom"], ["mom", "mom", "mo", "m"], ["mo", "o", "mom", "mom"],
          ["m", "mom", "mom", "mo"]]


def _groups(seed: int = 7) -> list[Group]:
    rng = random.Random(seed)
    out = []
    for index in range(GROUPS):
        prompt = task.make_prompt(rng.randrange(10), rng.randint(1, 3))
        made = [_trajectory(rng, s) for s in SHAPES[index]]
        responses = [r for r, _ in made]
        rewards = [0.0, 1.0, 0.5, 0.25] if index != 1 else [0.25] * 4  # group 1: no signal
        out.append(Group(prompt_index=index, prompts=[prompt] * 4, responses=responses,
                         rewards=rewards, truncated=[r[-1] != task.EOS_ID for r in responses],
                         loss_masks=[loss_mask(t, len(r)) for r, t in made]))
    return out


# --- the reference ---------------------------------------------------------------------------


def _advantages(cfg: AlgorithmConfig, groups: list[Group]) -> list[torch.Tensor]:
    """Per response, per token (whole response): the final advantage."""
    values: list[float] = []
    for g in groups:
        rewards = list(g.rewards)
        if cfg.overlong_buffer:  # on whole lengths: the budget counts observation tokens
            rewards = advantages.shaped(rewards, [len(r) for r in g.responses], MAX_NEW,
                                        cfg.overlong_buffer, cfg.overlong_penalty_factor)
        raw = advantages.raw_advantages(cfg.estimator, torch.tensor(rewards, dtype=torch.float64),
                                        [1] * len(rewards))
        values += [float(a[0]) for a in raw]
    masks = [torch.tensor(m, dtype=torch.float64) for g in groups for m in g.loss_masks or []]
    if cfg.scope is Scope.BATCH:  # whitened over the trained tokens of the step
        per_token = torch.cat([torch.full((int(m.sum()),), v, dtype=torch.float64)
                               for v, m in zip(values, masks, strict=True)])
        mean, var = float(per_token.mean()), float(per_token.var(unbiased=True))
        values = [(v - mean) / (var + 1e-8) ** 0.5 for v in values]
    return [torch.full((len(m),), v, dtype=torch.float64)
            for v, m in zip(values, masks, strict=True)]


def _kl(d: torch.Tensor, estimator: KlEstimator) -> torch.Tensor:
    return {KlEstimator.K1: d, KlEstimator.K2: 0.5 * d * d,
            KlEstimator.K3: torch.exp(-d) + d - 1.0}[estimator]


def _masked_loss(cfg: AlgorithmConfig, new: list[torch.Tensor], old: list[torch.Tensor],
                 adv: list[torch.Tensor], ref: list[torch.Tensor] | None,
                 ent: list[torch.Tensor], masks: list[torch.Tensor]) -> torch.Tensor:
    sums, means = [], []
    for i, (n, o, a, m) in enumerate(zip(new, old, adv, masks, strict=True)):
        log_ratio = n - o
        if cfg.policy_loss is PolicyLoss.SEQUENCE_CLIP:
            seq = torch.exp((log_ratio * m).sum() / m.sum().clamp(min=1)).detach()
            ratio = seq * torch.exp(n - n.detach())
        else:
            ratio = torch.exp(log_ratio)
        term = torch.maximum(-a * ratio,
                             -a * ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high))
        if ref is not None and cfg.kl_coef:
            term = term + cfg.kl_coef * _kl(n - ref[i], cfg.kl_estimator)
        term = (term - cfg.entropy_coef * ent[i]) * m
        sums.append(term.sum())
        if m.sum() > 0:
            means.append(term.sum() / m.sum())
    trained = sum(float(m.sum()) for m in masks)
    seqs = len(means)
    match cfg.loss_agg:
        case LossAgg.TOKEN_MEAN:
            return torch.stack(sums).sum() / (trained or 1.0)
        case LossAgg.SEQ_MEAN_TOKEN_SUM:
            return torch.stack(sums).sum() / (seqs or 1)
        case LossAgg.SEQ_MEAN_TOKEN_MEAN:
            return torch.stack(means).sum() / (seqs or 1)
        case LossAgg.SEQ_MEAN_TOKEN_SUM_NORM:
            return torch.stack(sums).sum() / ((seqs * MAX_NEW) or 1)


def _reference_step(model: torch.nn.Module, cfg: AlgorithmConfig, groups: list[Group],
                    reference: torch.nn.Module | None) -> list[float]:
    """The reference step (module doc); returns each optimizer step's loss."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    adv = _advantages(cfg, groups)
    prompts = [p for g in groups for p in g.prompts]
    responses = [r for g in groups for r in g.responses]
    masks = [torch.tensor(m, dtype=torch.float64) for g in groups for m in g.loss_masks or []]
    with torch.no_grad():  # whole responses: no mask reaches the reference's scoring
        old = logprobs.response_logprobs(model, prompts, responses, task.PAD_ID, TEMPERATURE)
        ref = logprobs.response_logprobs(reference, prompts, responses, task.PAD_ID,
                                         TEMPERATURE) if reference is not None else None
    per = len(groups[0].responses)
    bounds = [k * len(groups) // cfg.minibatches for k in range(cfg.minibatches + 1)]
    losses = []
    for _ in range(cfg.updates_per_step):
        for k in range(cfg.minibatches):
            rows = slice(bounds[k] * per, bounds[k + 1] * per)
            scores = logprobs.response_scores(model, prompts[rows], responses[rows],
                                              task.PAD_ID, temperature=TEMPERATURE, entropy=True)
            assert scores.entropy is not None
            loss = _masked_loss(cfg, scores.logprobs, old[rows], adv[rows],
                                ref[rows] if ref is not None else None, scores.entropy,
                                masks[rows])
            loss.backward()
            losses.append(float(loss.detach()))
            torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.grad is not None], 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return losses


# --- the trainer --------------------------------------------------------------------------------


class _Spy(torch.nn.Module):
    """The model, keeping each forward's logits (and their gradient) for inspection."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def forward(self, **kw: Any) -> Any:
        out = self.inner(**kw)
        if out.logits.requires_grad:
            out.logits.retain_grad()
            self.seen.append((kw["input_ids"], kw["attention_mask"], out.logits))
        return out


def _trained_step(model: torch.nn.Module, cfg: AlgorithmConfig, groups: list[Group],
                  reference: torch.nn.Module | None) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    trainer = StepTrainer(model, opt, cfg, RunShape(MAX_NEW, TEMPERATURE, GROUPS), task.PAD_ID,
                          reference=reference)
    order = list(groups)
    random.Random(1).shuffle(order)
    for g in order:
        trainer.add_group(g)
    return trainer.step()


def _config(algorithm: str, knobs: dict[str, object]) -> AlgorithmConfig:
    return AlgorithmConfig.for_run(
        {"algorithm": algorithm, "updates_per_step": 2, "minibatches": 2,
         "dynamic_sampling": False, **knobs}, max_new_tokens=MAX_NEW, groups_per_step=GROUPS)


# Each algorithm as its paper sets it (with them all four loss_agg modes), then each KL
# estimator a loss term may use and the entropy term beside the mask.
CASES = [(a.value, {}) for a in Algorithm] + [
    ("grpo", {"kl_coef": 0.1, "kl_estimator": "k3", "entropy_coef": 0.01,
              "loss_agg": "seq_mean_token_mean"}),
    ("reinforce_pp", {"kl_coef": 0.05, "kl_estimator": "k2", "entropy_coef": 0.01,
                      "loss_agg": "seq_mean_token_sum"}),
    ("gspo", {"kl_coef": 0.1, "kl_estimator": "k2", "loss_agg": "token_mean"}),
    ("dr_grpo", {"entropy_coef": 0.02}),
]
IDS = [f"{a}{'+' if k else ''}{'-'.join(k)}" for a, k in CASES]


@pytest.mark.parametrize(("algorithm", "knobs"), CASES, ids=IDS)
def test_the_masked_step_equals_the_float64_reference(algorithm: str,
                                                      knobs: dict[str, object]) -> None:
    cfg = _config(algorithm, knobs)
    reference = model64(seed=1) if cfg.needs_reference else None
    groups = _groups()
    trained, expected = model64(), model64()
    stats = _trained_step(trained, cfg, groups, reference)
    losses = _reference_step(expected, cfg, groups, reference)

    moved = 0.0
    for (name, pt), pe, p0 in zip(trained.named_parameters(), expected.parameters(),
                                  model64().parameters(), strict=True):
        torch.testing.assert_close(pt, pe, rtol=0, atol=1e-12, msg=name)
        moved = max(moved, float((pt - p0).detach().abs().max()))
    assert moved > 1e-6  # the step did something, so equality is not vacuous
    assert stats["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-9, abs=1e-12)
    masks = [m for g in groups for m in g.loss_masks or []]
    assert stats["trained_tokens"] == sum(map(sum, masks)) < stats["tokens"] == sum(map(len, masks))


def test_the_mask_changes_the_step() -> None:
    """The reference is not blind to the mask: training every token lands elsewhere."""
    cfg = _config("grpo", {})
    masked, unmasked = model64(), model64()
    _trained_step(masked, cfg, _groups(), None)
    _trained_step(unmasked, cfg, [Group(g.prompt_index, g.prompts, g.responses, g.rewards,
                                        g.truncated) for g in _groups()], None)
    gap = max(float((a - b).detach().abs().max()) for a, b in zip(masked.parameters(),
                                                          unmasked.parameters(), strict=True))
    assert gap > 1e-4


@pytest.mark.parametrize("algorithm", [a.value for a in Algorithm])
def test_observation_logits_get_exactly_zero_gradient(algorithm: str) -> None:
    cfg = _config(algorithm, {"kl_coef": 0.1, "entropy_coef": 0.01})
    groups = _groups()
    spy = _Spy(model64())
    _trained_step(spy, cfg, groups, model64(seed=1))
    masks = {tuple(p + r): m for g in groups for p, r, m in
             zip(g.prompts, g.responses, g.loss_masks or [], strict=True)}
    observed = trained = 0
    assert spy.seen
    for ids, attention, logits in spy.seen:
        assert logits.grad is not None
        for row in range(ids.shape[0]):
            seq = tuple(ids[row, : int(attention[row].sum())].tolist())
            mask = masks[seq]
            start = len(seq) - len(mask) - 1  # the logits row predicting response token 0
            for t, m in enumerate(mask):
                grad = logits.grad[row, start + t]
                if m:
                    trained += bool(grad.abs().max() > 0)
                else:
                    assert torch.equal(grad, torch.zeros_like(grad)), (row, t)
                    observed += 1
    assert observed > 0 and trained > 0


def test_a_mask_of_all_ones_is_no_mask_bit_for_bit() -> None:
    cfg = _config("gspo", {"kl_coef": 0.1, "entropy_coef": 0.01})
    groups = _groups()
    ones = [Group(g.prompt_index, g.prompts, g.responses, g.rewards, g.truncated,
                  [[1] * len(r) for r in g.responses]) for g in groups]
    plain = [Group(g.prompt_index, g.prompts, g.responses, g.rewards, g.truncated)
             for g in groups]
    a, b = model64(), model64()
    sa = _trained_step(a, cfg, ones, model64(seed=1))
    sb = _trained_step(b, cfg, plain, model64(seed=1))
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert sa == sb


def test_a_mask_of_the_wrong_length_is_refused() -> None:
    g = _groups()[0]
    bad = Group(g.prompt_index, g.prompts, g.responses, g.rewards, g.truncated,
                [m[:-1] for m in g.loss_masks or []])
    model = model64()
    trainer = StepTrainer(model, torch.optim.SGD(model.parameters(), lr=LR),
                          _config("grpo", {}), RunShape(MAX_NEW, TEMPERATURE, GROUPS),
                          task.PAD_ID)
    with pytest.raises(ValueError, match="loss mask lengths"):
        trainer.add_group(bad)
