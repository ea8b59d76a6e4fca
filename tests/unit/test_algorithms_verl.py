"""The algorithms against veRL's own functions (``verl.trainer.ppo.core_algos``), where installed.

veRL is no extra of rlboost's: its package metadata pins transformers below the version
rlboost uses, so it cannot sit in a resolved extra. It imports on the CPU, without its GPU
stack, from the packages the Makefile's ``VERL_CPU`` installs without dependency resolution
(``make test`` and ``make test-fast`` do, before the tiers run); elsewhere this module is
skipped, saying so. veRL works on padded ``(batch, length)`` tensors
with a response mask; the helpers below pad rlboost's ragged rows to compare.

Known, documented differences (asserted below, so a change on either side is noticed):
- a group of one: veRL's GRPO leaves ``r / (1 + eps)`` and its RLOO leaves ``r``; rlboost
  gives 0 (a single response has nothing to be compared with);
- ``seq_mean_token_mean``: veRL divides each response's token sum by ``length + 1e-8``, a
  relative difference below 1e-8, hence the looser tolerance (``REL``) for that mode and GSPO.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from shared.algorithm import AlgorithmConfig, Estimator, KlEstimator, LossAgg
from trainer_svc.learn.algorithms import advantages as adv
from trainer_svc.learn.algorithms import losses
from trainer_svc.learn.algorithms.losses import aggregate, denominator

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
verl_F = pytest.importorskip("verl.utils.torch_functional")
verl_config = pytest.importorskip("verl.workers.config")

VERL_MODE = {
    LossAgg.TOKEN_MEAN: "token-mean",
    LossAgg.SEQ_MEAN_TOKEN_SUM: "seq-mean-token-sum",
    LossAgg.SEQ_MEAN_TOKEN_MEAN: "seq-mean-token-mean",
    LossAgg.SEQ_MEAN_TOKEN_SUM_NORM: "seq-mean-token-sum-norm",
}
NORM_LEN = 10
# veRL's 1e-8 in seq-mean-token-mean (module doc); float64 round-off elsewhere.
REL = {LossAgg.SEQ_MEAN_TOKEN_MEAN: 1e-7}


def _pad(rows: list[torch.Tensor], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.zeros(len(rows), width, dtype=torch.float64)
    mask = torch.zeros(len(rows), width, dtype=torch.float64)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
        mask[i, : r.numel()] = 1
    return out, mask


def _rows(padded: torch.Tensor, lengths: list[int]) -> list[list[float]]:
    return [padded[i, :n].tolist() for i, n in enumerate(lengths)]


def _groups(seed: int) -> list[tuple[list[float], list[int]]]:
    rng = random.Random(seed)
    out = []
    for size in (4, 6, 3, 5):
        rewards = [rng.choice([0.0, 0.25, 0.5, 1.0]) for _ in range(size)]
        rewards[0], rewards[1] = 0.0, 1.0
        out.append((rewards, [rng.randint(1, NORM_LEN) for _ in range(size)]))
    out.append(([0.5] * 4, [3, 9, 1, 4]))  # all equal
    return out


def _verl_inputs(groups: list[tuple[list[float], list[int]]]
                 ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, list[int]]:
    lengths = [n for _, lens in groups for n in lens]
    scores = torch.zeros(len(lengths), NORM_LEN, dtype=torch.float64)
    mask = torch.zeros(len(lengths), NORM_LEN, dtype=torch.float64)
    index, k = [], 0
    for g, (rewards, lens) in enumerate(groups):
        for r, n in zip(rewards, lens, strict=True):
            scores[k, n - 1] = r  # the outcome reward sits on the last response token
            mask[k, :n] = 1
            index.append(f"prompt-{g}")
            k += 1
    return scores, mask, np.array(index, dtype=object), lengths


def _ours(estimator: Estimator, groups: list[tuple[list[float], list[int]]]) -> list[list[float]]:
    out = adv.step_advantages(
        estimator, [(torch.tensor(r, dtype=torch.float64), lens) for r, lens in groups])
    return [t.tolist() for g in out for t in g]


@pytest.mark.parametrize(("estimator", "call"), [
    (Estimator.GRPO, lambda s, m, i: core_algos.compute_grpo_outcome_advantage(s, m, i)),
    (Estimator.DR_GRPO, lambda s, m, i: core_algos.compute_grpo_outcome_advantage(
        s, m, i, norm_adv_by_std_in_grpo=False)),
    (Estimator.RLOO, lambda s, m, i: core_algos.compute_rloo_outcome_advantage(s, m, i)),
    (Estimator.REINFORCE_PP_BASELINE, lambda s, m, i:
        core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(s, m, i)),
    (Estimator.REINFORCE_PP, lambda s, m, i:
        core_algos.compute_reinforce_plus_plus_outcome_advantage(
            s, m, config=SimpleNamespace(gamma=1.0))),
])
@pytest.mark.parametrize("seed", [0, 1])
def test_advantages_equal_verl(estimator: Estimator, call, seed: int) -> None:
    groups = _groups(seed)
    scores, mask, index, lengths = _verl_inputs(groups)
    theirs, _ = call(scores.clone(), mask, index)
    for got, want in zip(_ours(estimator, groups), _rows(theirs, lengths), strict=True):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_group_of_one_differs_from_verl_as_documented() -> None:
    scores, mask, index, _ = _verl_inputs([([0.75], [3])])
    grpo, _ = core_algos.compute_grpo_outcome_advantage(scores.clone(), mask, index)
    rloo, _ = core_algos.compute_rloo_outcome_advantage(scores.clone(), mask, index)
    assert float(grpo[0, 0]) == pytest.approx(0.75 / (1 + 1e-6))
    assert float(rloo[0, 0]) == pytest.approx(0.75)
    for estimator in (Estimator.GRPO, Estimator.RLOO):
        assert _ours(estimator, [([0.75], [3])]) == [[0.0, 0.0, 0.0]]


def _actor(low: float, high: float, scale: int | None = None) -> object:
    cfg = verl_config.ActorConfig(strategy="fsdp", clip_ratio=low, clip_ratio_low=low,
                                  clip_ratio_high=high, ppo_micro_batch_size_per_gpu=1,
                                  ppo_mini_batch_size=4, rollout_n=1)
    if scale is not None:
        cfg.global_batch_info["loss_scale_factor"] = scale
    return cfg


def _policy_case(seed: int, spread: float):
    rng = random.Random(seed)
    lengths = [rng.randint(1, NORM_LEN) for _ in range(9)]
    new = [torch.tensor([-rng.uniform(0.05, 3.0) for _ in range(n)], dtype=torch.float64)
           for n in lengths]
    old = [t - torch.tensor([rng.uniform(-spread, spread) for _ in range(t.numel())],
                            dtype=torch.float64) for t in new]
    a = [torch.full((n,), rng.uniform(-2, 2), dtype=torch.float64) for n in lengths]
    return lengths, new, old, a


@pytest.mark.parametrize("mode", [LossAgg.TOKEN_MEAN, LossAgg.SEQ_MEAN_TOKEN_SUM,
                                  LossAgg.SEQ_MEAN_TOKEN_MEAN])
def test_token_clip_loss_equals_verl_vanilla(mode: LossAgg) -> None:
    # Log-ratios within +-0.6: veRL's dual clip (at 3) never binds, so the objectives agree.
    lengths, new, old, a = _policy_case(2, 0.6)
    cfg = AlgorithmConfig.for_algorithm("dapo", loss_agg=mode)
    leaves = [t.clone().requires_grad_(True) for t in new]
    part = losses.objective(cfg, leaves, old, a)
    ours = part.partial / denominator(mode, part.counts)
    ours.backward()
    padded_new, mask = _pad(new, NORM_LEN)
    padded_new.requires_grad_(True)
    theirs, metrics = core_algos.compute_policy_loss_vanilla(
        _pad(old, NORM_LEN)[0], padded_new, _pad(a, NORM_LEN)[0], mask,
        loss_agg_mode=VERL_MODE[mode], config=_actor(0.2, 0.28))
    theirs.backward()
    rel = REL.get(mode, 1e-12)
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=rel)
    assert padded_new.grad is not None
    for leaf, want in zip(leaves, _rows(padded_new.grad, lengths), strict=True):
        assert leaf.grad is not None
        assert leaf.grad.tolist() == pytest.approx(want, rel=max(rel, 1e-10), abs=1e-15)
    clip_fraction = part.stats.clipped_tokens / part.stats.loss_tokens
    assert clip_fraction == pytest.approx(metrics["actor/pg_clipfrac"], rel=1e-6)
    assert 0 < clip_fraction < 1


def test_gspo_loss_equals_verl_gspo() -> None:
    lengths, new, old, a = _policy_case(3, 0.002)
    cfg = AlgorithmConfig.for_algorithm("gspo")
    leaves = [t.clone().requires_grad_(True) for t in new]
    part = losses.objective(cfg, leaves, old, a)
    ours = part.partial / denominator(cfg.loss_agg, part.counts)
    ours.backward()
    padded_new, mask = _pad(new, NORM_LEN)
    padded_new.requires_grad_(True)
    theirs, _ = core_algos.compute_policy_loss_gspo(
        _pad(old, NORM_LEN)[0], padded_new, _pad(a, NORM_LEN)[0], mask,
        config=_actor(3e-4, 4e-4))
    theirs.backward()
    rel = REL[LossAgg.SEQ_MEAN_TOKEN_MEAN]
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=rel)
    assert padded_new.grad is not None
    for leaf, want in zip(leaves, _rows(padded_new.grad, lengths), strict=True):
        assert leaf.grad is not None
        assert leaf.grad.tolist() == pytest.approx(want, rel=rel, abs=1e-15)
    assert 0 < part.stats.clipped_tokens < part.stats.loss_tokens


@pytest.mark.parametrize("mode", list(LossAgg))
def test_aggregation_equals_verl_agg_loss(mode: LossAgg) -> None:
    rng = random.Random(6)
    rows = [torch.tensor([rng.uniform(-1, 1) for _ in range(rng.randint(1, NORM_LEN))],
                         dtype=torch.float64) for _ in range(7)]
    padded, mask = _pad(rows, NORM_LEN)
    theirs = float(core_algos.agg_loss(padded, mask, VERL_MODE[mode], loss_scale_factor=NORM_LEN))
    ours = float(aggregate(rows, mode, NORM_LEN))
    assert ours == pytest.approx(theirs, rel=REL.get(mode, 1e-12))


@pytest.mark.parametrize(("ours", "names"), [
    (KlEstimator.K1, ("k1", "kl")), (KlEstimator.K2, ("k2", "mse")),
    (KlEstimator.K3, ("k3", "low_var_kl")),
])
def test_kl_estimators_equal_verl_kl_penalty(ours: KlEstimator, names: tuple[str, str]) -> None:
    rng = random.Random(8)
    logp = torch.tensor([[-rng.uniform(0.1, 3) for _ in range(6)]], dtype=torch.float64)
    ref = logp + torch.tensor([[rng.uniform(-2, 2) for _ in range(6)]], dtype=torch.float64)
    got = losses.kl_estimate(logp, ref, ours)
    for name in names:
        torch.testing.assert_close(got, core_algos.kl_penalty(logp, ref, name), rtol=1e-13,
                                   atol=1e-15)


def test_entropy_equals_verl_entropy_from_logits() -> None:
    from transformers import Qwen2ForCausalLM

    from trainer_svc.embedded import task
    from trainer_svc.embedded.tiny import tiny_config
    from trainer_svc.learn.algorithms.logprobs import response_scores

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_config()).double().eval()
    prompt, response = task.make_prompt(3, 2), [task.DIGIT_IDS[1], task.DIGIT_IDS[4], task.EOS_ID]
    got = response_scores(model, [prompt], [response], task.PAD_ID, temperature=0.7,
                          entropy=True).entropy
    assert got is not None
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0]
    rows = logits[len(prompt) - 1: len(prompt) - 1 + len(response)] / 0.7
    torch.testing.assert_close(got[0].detach(), verl_F.entropy_from_logits(rows), rtol=1e-10,
                               atol=1e-12)
