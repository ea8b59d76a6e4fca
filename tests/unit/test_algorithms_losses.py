"""Policy losses, KL terms and loss aggregation against float64 loop references, and streaming.

References, written per token with ``math`` and Python loops:
- the clipped token objective with decoupled bounds: DAPO (arXiv 2503.14476) eq. 8 and §3.1
  (clip-higher); with eps_low = eps_high it is PPO/GRPO's;
- GSPO (arXiv 2507.18071): the sequence objective eq. 5 with the sequence ratio of eq. 7,
  ``s_i = (pi(y_i|x) / pi_old(y_i|x))^(1/|y_i|)``;
- the KL estimators k1, k2, k3 of Schulman's "Approximating KL Divergence" (2020);
- veRL's ``agg_loss`` modes, and Dr. GRPO's constant normaliser (arXiv 2503.20783 §3.1).

"Streaming" is what the trainer does: each group's partial sum is backpropagated as it comes,
and the accumulated gradient is divided once by the step's denominator. It must equal the batch
computation over all responses at once, for every algorithm and every aggregation mode.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest
import torch

from shared.algorithm import (
    Algorithm,
    AlgorithmConfig,
    KlEstimator,
    LossAgg,
    PolicyLoss,
    Scope,
)
from shared.protocol import STEP_STATS
from trainer_svc.learn.algorithms import advantages as adv
from trainer_svc.learn.algorithms import losses
from trainer_svc.learn.algorithms.losses import AggCounts, aggregate, denominator, partial_sum
from trainer_svc.learn.algorithms.stats import TrainStats, response_stats

Rows = list[list[float]]
LOW, HIGH = 0.2, 0.28
NORM_LEN = 12


def _case(seed: int, n: int = 12, spread: float = 0.6) -> tuple[Rows, Rows, list[float]]:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 7) for _ in range(n)]
    new = [[-rng.uniform(0.05, 3.0) for _ in range(k)] for k in lengths]
    # log-ratios in [-spread, spread]: both clip bounds are crossed.
    old = [[x - rng.uniform(-spread, spread) for x in row] for row in new]
    a = [rng.uniform(-2.0, 2.0) for _ in lengths]
    a[0], a[1] = 1.5, -1.5
    return new, old, a


def _leaves(rows: Rows) -> list[torch.Tensor]:
    return [torch.tensor(r, dtype=torch.float64, requires_grad=True) for r in rows]


def _consts(rows: Rows) -> list[torch.Tensor]:
    return [torch.tensor(r, dtype=torch.float64) for r in rows]


def _grad(t: torch.Tensor) -> torch.Tensor:
    assert t.grad is not None
    return t.grad


def _per_token(a: list[float], rows: Rows) -> list[torch.Tensor]:
    return [torch.full((len(r),), x, dtype=torch.float64) for x, r in zip(a, rows, strict=True)]


# --- the clipped token objective -------------------------------------------------------------


def ref_token_clip(new: Rows, old: Rows, a: list[float], low: float, high: float
                   ) -> tuple[Rows, Rows, list[list[bool]]]:
    """Per-token loss -min(r A, clip(r, 1-low, 1+high) A), d loss / d new, and clipped flags."""
    loss, grad, flags = [], [], []
    for i in range(len(new)):
        lr, gr, fr = [], [], []
        for t in range(len(new[i])):
            r = math.exp(new[i][t] - old[i][t])
            c = min(max(r, 1.0 - low), 1.0 + high)
            lr.append(-min(r * a[i], c * a[i]))
            # The clipped branch is the minimum, and flat, only beyond the bound the advantage
            # pushes towards; elsewhere d/dnew of -r A is -A r.
            flat = (a[i] > 0 and r > 1.0 + high) or (a[i] < 0 and r < 1.0 - low)
            gr.append(0.0 if flat else -a[i] * r)
            fr.append(flat)
        loss.append(lr)
        grad.append(gr)
        flags.append(fr)
    return loss, grad, flags


@pytest.mark.parametrize(("seed", "low", "high"), [(0, 0.2, 0.2), (1, LOW, HIGH), (2, LOW, HIGH)])
def test_token_clip_matches_reference(seed: int, low: float, high: float) -> None:
    new, old, a = _case(seed)
    ref_loss, ref_grad, ref_flags = ref_token_clip(new, old, a, low, high)
    flat_flags = [f for row in ref_flags for f in row]
    assert any(flat_flags) and not all(flat_flags)
    leaves = _leaves(new)
    got, flags = losses.policy_token_losses(PolicyLoss.TOKEN_CLIP, leaves, _consts(old),
                                            _per_token(a, new), low, high)
    for g, r in zip(got, ref_loss, strict=True):
        assert g.tolist() == pytest.approx(r, rel=1e-13, abs=1e-13)
    assert [f.tolist() for f in flags] == ref_flags
    torch.stack([g.sum() for g in got]).sum().backward()
    for leaf, r in zip(leaves, ref_grad, strict=True):
        assert leaf.grad is not None
        assert leaf.grad.tolist() == pytest.approx(r, rel=1e-13, abs=1e-13)


# --- GSPO --------------------------------------------------------------------------------------


def ref_gspo(new: Rows, old: Rows, a: list[float], low: float, high: float
             ) -> tuple[float, Rows]:
    """Eq. 5 with eq. 7's ratio: -(1/G) sum_i min(s_i A_i, clip(s_i) A_i), and its gradient."""
    g = len(new)
    total, grad = 0.0, []
    for i in range(g):
        n = len(new[i])
        s = math.exp(sum(new[i][t] - old[i][t] for t in range(n)) / n)
        c = min(max(s, 1.0 - low), 1.0 + high)
        total += -min(s * a[i], c * a[i]) / g
        flat = (a[i] > 0 and s > 1.0 + high) or (a[i] < 0 and s < 1.0 - low)
        # d s_i / d new[i][t] = s_i / |y_i|
        grad.append([0.0 if flat else -a[i] * s / n / g] * n)
    return total, grad


def test_gspo_equals_eq_5_in_value_and_gradient() -> None:
    low, high = 3e-4, 4e-4
    new, old, a = _case(3, spread=0.002)
    ref_total, ref_grad = ref_gspo(new, old, a, low, high)
    seq_ratios = [math.exp(sum(n - o for n, o in zip(rn, ro, strict=True)) / len(rn))
                  for rn, ro in zip(new, old, strict=True)]
    assert any(abs(s - 1) > 4e-4 for s in seq_ratios)  # some sequences clip
    assert any(abs(s - 1) < 3e-4 for s in seq_ratios)  # and some do not
    cfg = AlgorithmConfig.for_algorithm("gspo")
    assert (cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.loss_agg) == (low, high,
                                                                      LossAgg.SEQ_MEAN_TOKEN_MEAN)
    leaves = _leaves(new)
    part = losses.objective(cfg, leaves, _consts(old), _per_token(a, new))
    loss = part.partial / denominator(cfg.loss_agg, part.counts)
    assert float(loss.detach()) == pytest.approx(ref_total, rel=1e-12)
    loss.backward()
    for leaf, r in zip(leaves, ref_grad, strict=True):
        assert leaf.grad is not None
        assert leaf.grad.tolist() == pytest.approx(r, rel=1e-10, abs=1e-14)


# --- KL estimators ---------------------------------------------------------------------------


def ref_kl(d: float, estimator: KlEstimator) -> tuple[float, float]:
    """Value and d/d(new) of each estimator at d = log pi - log pi_ref (Schulman 2020)."""
    if estimator is KlEstimator.K1:
        return d, 1.0
    if estimator is KlEstimator.K2:
        return 0.5 * d * d, d
    return math.exp(-d) + d - 1.0, 1.0 - math.exp(-d)


@pytest.mark.parametrize("estimator", list(KlEstimator))
def test_kl_estimators(estimator: KlEstimator) -> None:
    ds = [-1.3, -0.2, 0.0, 0.05, 0.9, 2.5]
    new = torch.tensor([-1.0] * len(ds), dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.0 - d for d in ds], dtype=torch.float64)
    out = losses.kl_estimate(new, ref, estimator)
    out.sum().backward()
    got = out.detach()
    assert new.grad is not None
    for i, d in enumerate(ds):
        value, slope = ref_kl(d, estimator)
        assert float(got[i]) == pytest.approx(value, rel=1e-12, abs=1e-15)
        assert float(new.grad[i]) == pytest.approx(slope, rel=1e-12, abs=1e-15)


def test_k1_and_k3_are_unbiased_estimates_of_kl() -> None:
    """Sampled from p, the mean of k1 and of k3 is KL(p || q); k3 is never negative."""
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    exact = float((p * (p / q).log()).sum())
    for estimator in (KlEstimator.K1, KlEstimator.K3):
        values = losses.kl_estimate(p.log(), q.log(), estimator)
        assert float((p * values).sum()) == pytest.approx(exact, rel=1e-12)
    assert bool((losses.kl_estimate(p.log(), q.log(), KlEstimator.K3) >= 0).all())


# --- aggregation -------------------------------------------------------------------------------


def ref_agg(rows: Rows, mode: LossAgg, norm_len: int) -> float:
    nonempty = [r for r in rows if r]
    if mode is LossAgg.TOKEN_MEAN:
        return sum(x for r in rows for x in r) / sum(len(r) for r in rows)
    if mode is LossAgg.SEQ_MEAN_TOKEN_SUM:
        return sum(sum(r) for r in nonempty) / len(nonempty)
    if mode is LossAgg.SEQ_MEAN_TOKEN_MEAN:
        return sum(sum(r) / len(r) for r in nonempty) / len(nonempty)
    return sum(sum(r) for r in nonempty) / (len(nonempty) * norm_len)


@pytest.mark.parametrize("mode", list(LossAgg))
def test_aggregation_modes_and_their_streaming(mode: LossAgg) -> None:
    rng = random.Random(5)
    rows = [[rng.uniform(-1, 1) for _ in range(rng.randint(0, 6))] for _ in range(15)]
    rows[3] = []  # an empty response counts towards nothing
    want = ref_agg(rows, mode, NORM_LEN)
    got = aggregate(_consts(rows), mode, NORM_LEN)
    assert float(got) == pytest.approx(want, rel=1e-13)
    # Streamed in groups of uneven size, in a shuffled order.
    cuts = [0, 4, 5, 11, 15]
    parts = [rows[a:b] for a, b in itertools.pairwise(cuts)]
    rng.shuffle(parts)
    num = sum(float(partial_sum(_consts(p), mode)) for p in parts)
    counts = sum((AggCounts.of([len(r) for r in p]) for p in parts), AggCounts())
    assert num / denominator(mode, counts, NORM_LEN) == pytest.approx(want, rel=1e-13)


def test_token_sum_norm_needs_a_constant() -> None:
    with pytest.raises(ValueError):
        denominator(LossAgg.SEQ_MEAN_TOKEN_SUM_NORM, AggCounts(4, 2))
    assert denominator(LossAgg.TOKEN_MEAN, AggCounts()) == 1.0


# --- streaming == batch, every algorithm x every aggregation ---------------------------------

Group = tuple[list[float], Rows, Rows, Rows, Rows]  # rewards, new, old, ref, entropy


def _step(seed: int) -> list[Group]:
    rng = random.Random(seed)
    out: list[Group] = []
    for size, equal in ((4, False), (1, False), (6, True), (3, False), (5, False)):
        lengths = [rng.randint(1, NORM_LEN) for _ in range(size)]
        lengths[0] = NORM_LEN  # a truncated response, at the budget
        rewards = [0.5] * size if equal else [rng.choice([0.0, 0.3, 0.7, 1.0]) for _ in lengths]
        new = [[-rng.uniform(0.05, 3.0) for _ in range(k)] for k in lengths]
        old = [[x - rng.uniform(-0.4, 0.4) for x in r] for r in new]
        ref = [[x - rng.uniform(-0.5, 0.5) for x in r] for r in new]
        ent = [[rng.uniform(0.1, 2.0) for _ in range(k)] for k in lengths]
        out.append((rewards, new, old, ref, ent))
    return out


def _run(cfg: AlgorithmConfig, step: list[Group], streamed: bool
         ) -> tuple[float, list[list[torch.Tensor]], TrainStats]:
    """The step loss and d loss / d (new log-probs, entropies) per group."""
    new = [_leaves(g[1]) for g in step]
    ent = [_leaves(g[4]) for g in step]
    raw = [adv.raw_advantages(cfg.estimator, torch.tensor(g[0], dtype=torch.float64),
                              [len(r) for r in g[1]]) for g in step]
    # Batch-scope estimators need every group's raw advantages: the barrier.
    w = adv.batch_whitening(cfg.estimator, raw)
    final = [[w.apply(t) for t in g] for g in raw]
    stats = TrainStats()
    if streamed:
        counts, value = AggCounts(), 0.0
        for i, g in enumerate(step):
            part = losses.objective(cfg, new[i], _consts(g[2]), final[i], ref=_consts(g[3]),
                                    entropy=ent[i])
            part.partial.backward()  # into .grad, one group at a time
            counts, value = counts + part.counts, value + float(part.partial.detach())
            stats.merge(part.stats)
        scale = denominator(cfg.loss_agg, counts, NORM_LEN)
        loss = value / scale
        grads = [[_grad(t) / scale for t in new[i] + ent[i]] for i in range(len(step))]
    else:
        part = losses.objective(cfg, [t for g in new for t in g],
                                [t for g in step for t in _consts(g[2])],
                                [t for g in final for t in g],
                                ref=[t for g in step for t in _consts(g[3])],
                                entropy=[t for g in ent for t in g])
        total = part.partial / denominator(cfg.loss_agg, part.counts, NORM_LEN)
        total.backward()
        loss = float(total.detach())
        grads = [[_grad(t) for t in new[i] + ent[i]] for i in range(len(step))]
        stats = part.stats
    return loss, grads, stats


@pytest.mark.parametrize("mode", list(LossAgg))
@pytest.mark.parametrize("algorithm", list(Algorithm))
def test_streaming_equals_batch(algorithm: Algorithm, mode: LossAgg) -> None:
    cfg = AlgorithmConfig.for_algorithm(algorithm, loss_agg=mode, kl_coef=0.1,
                                        kl_estimator="k3", entropy_coef=0.01)
    step = _step(hash((algorithm.value, mode.value)) % 1000)
    s_loss, s_grads, s_stats = _run(cfg, step, streamed=True)
    b_loss, b_grads, b_stats = _run(cfg, step, streamed=False)
    assert s_loss == pytest.approx(b_loss, rel=1e-13, abs=1e-15)
    moved = 0.0
    for gs, gb in zip(s_grads, b_grads, strict=True):
        for a, b in zip(gs, gb, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
            moved = max(moved, float(b.abs().max()))
    assert moved > 1e-3  # the gradient is not vacuously zero
    assert s_stats.clipped_tokens == b_stats.clipped_tokens
    assert s_stats.summary() == pytest.approx(b_stats.summary(), rel=1e-12)


@pytest.mark.parametrize("mode", list(LossAgg))
@pytest.mark.parametrize("algorithm", [Algorithm.REINFORCE_PP, Algorithm.REINFORCE_PP_BASELINE])
def test_first_pass_parts_stream_batch_estimators_before_the_barrier(
        algorithm: Algorithm, mode: LossAgg) -> None:
    """At ratio 1 the loss is linear in the advantage: two sums per group, combined at the end."""
    cfg = AlgorithmConfig.for_algorithm(algorithm, loss_agg=mode)
    assert cfg.scope is Scope.BATCH
    step = _step(17)
    # The reference: the ordinary objective with the whitened advantages, old = new.
    new_b = [_leaves(g[1]) for g in step]
    raw = [adv.raw_advantages(cfg.estimator, torch.tensor(g[0], dtype=torch.float64),
                              [len(r) for r in g[1]]) for g in step]
    w = adv.batch_whitening(cfg.estimator, raw)
    flat_new = [t for g in new_b for t in g]
    part = losses.objective(cfg, flat_new, [t.detach() for t in flat_new],
                            [w.apply(t) for g in raw for t in g])
    total = part.partial / denominator(mode, part.counts, NORM_LEN)
    total.backward()
    # Streaming: P_adv and P_one per group into two gradient buffers, before w is known.
    new_s = [_leaves(g[1]) for g in step]
    g_adv: list[torch.Tensor] = []
    g_one: list[torch.Tensor] = []
    p_adv = p_one = 0.0
    counts = AggCounts()
    for i in range(len(step)):
        pa, po = losses.first_pass_parts(new_s[i], raw[i], mode)
        g_adv += list(torch.autograd.grad(pa, new_s[i], retain_graph=True))
        g_one += list(torch.autograd.grad(po, new_s[i]))
        p_adv, p_one = p_adv + float(pa.detach()), p_one + float(po.detach())
        counts = counts + AggCounts.of([len(r) for r in step[i][1]])
    scale = w.scale / denominator(mode, counts, NORM_LEN)
    # Under token-weighted modes the whitened loss is a sum that cancels to ~0: compare at the
    # scale of its parts.
    tol = 1e-13 * scale * (abs(p_adv) + abs(w.mean * p_one))
    assert scale * (p_adv - w.mean * p_one) == pytest.approx(float(total.detach()), abs=tol)
    for leaf, grad_adv, grad_one in zip(flat_new, g_adv, g_one, strict=True):
        assert leaf.grad is not None
        torch.testing.assert_close(scale * (grad_adv - w.mean * grad_one), leaf.grad, rtol=1e-12,
                                   atol=1e-15)


def test_objective_requires_what_its_terms_need() -> None:
    new, old, a = _case(0, n=2)
    cfg = AlgorithmConfig.for_algorithm("grpo", kl_coef=0.1)
    with pytest.raises(ValueError):
        losses.objective(cfg, _leaves(new), _consts(old), _per_token(a, new))
    with pytest.raises(ValueError):
        losses.objective(AlgorithmConfig.for_algorithm("grpo", entropy_coef=0.01),
                         _leaves(new), _consts(old), _per_token(a, new))
    with pytest.raises(ValueError):
        losses.objective(AlgorithmConfig.for_algorithm("grpo"), _leaves(new), _consts(old),
                         [*_per_token(a, new)[:1], torch.zeros(99, dtype=torch.float64)])


# --- statistics ----------------------------------------------------------------------------


def test_stats_sum_and_summarise() -> None:
    new, old, a = _case(1)
    cfg = AlgorithmConfig.for_algorithm("dapo")
    _, _, flags = ref_token_clip(new, old, a, cfg.clip_ratio_low, cfg.clip_ratio_high)
    ref_logp = [[x - 0.1 for x in r] for r in new]
    part = losses.objective(cfg, _leaves(new), _consts(old), _per_token(a, new),
                            ref=_consts(ref_logp), entropy=_consts([[0.5] * len(r) for r in new]))
    tokens = sum(len(r) for r in new)
    s = part.stats.merge(response_stats([len(r) for r in new], [True] + [False] * 11,
                                        _per_token(a, new)))
    got = s.summary()
    token_adv = [x for x, r in zip(a, new, strict=True) for _ in r]
    mean = sum(token_adv) / tokens
    assert got["clip_fraction"] == pytest.approx(sum(f for r in flags for f in r) / tokens)
    assert got["kl"] == pytest.approx(math.exp(-0.1) + 0.1 - 1)  # k3 at d = 0.1 everywhere
    assert got["entropy"] == pytest.approx(0.5)
    assert got["advantage_mean"] == pytest.approx(mean)
    assert got["advantage_std"] == pytest.approx(
        math.sqrt(sum((x - mean) ** 2 for x in token_adv) / tokens))
    assert got["response_len_mean"] == pytest.approx(tokens / 12)
    assert got["response_len_max"] == max(len(r) for r in new)
    assert got["truncated_fraction"] == pytest.approx(1 / 12)
    assert "kl" not in TrainStats().summary()


# --- the same through a real model: score, stream, divide at the barrier ---------------------


def _tiny(seed: int, attention_dropout: float = 0.0) -> torch.nn.Module:
    from transformers import Qwen2ForCausalLM

    from trainer_svc.embedded.tiny import tiny_config

    torch.manual_seed(seed)
    cfg = tiny_config()
    cfg.attention_dropout = attention_dropout
    model: torch.nn.Module = Qwen2ForCausalLM(cfg).double()
    return model.train()


@pytest.mark.parametrize(("algorithm", "mode", "temperature"), [
    (Algorithm.REINFORCE_PP_BASELINE, LossAgg.SEQ_MEAN_TOKEN_MEAN, 0.7),
    (Algorithm.GSPO, LossAgg.TOKEN_MEAN, 1.3),
    (Algorithm.DR_GRPO, LossAgg.SEQ_MEAN_TOKEN_SUM_NORM, 1.0),
    (Algorithm.DAPO, LossAgg.TOKEN_MEAN, 0.7),
])
def test_model_gradient_streamed_by_group_equals_batch(
        algorithm: Algorithm, mode: LossAgg, temperature: float) -> None:
    from trainer_svc.embedded import task
    from trainer_svc.learn.algorithms.logprobs import dropout_off, response_scores

    # A narrow clip, so that some ratios between these near-uniform random models clip.
    narrow = {} if algorithm is Algorithm.GSPO else {"clip_ratio_low": 0.1, "clip_ratio_high": 0.1}
    cfg = AlgorithmConfig.for_algorithm(algorithm, loss_agg=mode, kl_coef=0.05,
                                        entropy_coef=0.01, **narrow)
    rng = random.Random(21)
    groups: list[tuple[list[list[int]], list[list[int]], list[float]]] = []
    for size in (4, 1, 3):
        prompt = task.make_prompt(rng.randrange(10), rng.randint(1, 3))
        responses = [[rng.choice(task.DIGIT_IDS) for _ in range(rng.randint(1, NORM_LEN))]
                     for _ in range(size)]
        groups.append(([prompt] * size, responses, [task.reward(prompt, r) for r in responses]))
    # The generating policy and the reference differ from the trained one, so ratios clip.
    behaviour, reference = _tiny(1).eval(), _tiny(2).eval()

    def constants(model: torch.nn.Module, prompts: list[list[int]],
                  responses: list[list[int]]) -> list[torch.Tensor]:
        with torch.no_grad():
            return response_scores(model, prompts, responses, task.PAD_ID,
                                   temperature=temperature).logprobs

    def run(streamed: bool) -> tuple[list[torch.Tensor], int]:
        model = _tiny(0, attention_dropout=0.3)
        raw = [adv.raw_advantages(cfg.estimator, torch.tensor(g[2], dtype=torch.float64),
                                  [len(r) for r in g[1]]) for g in groups]
        w = adv.batch_whitening(cfg.estimator, raw)
        batches = groups if streamed else [([p for g in groups for p in g[0]],
                                             [r for g in groups for r in g[1]],
                                             [x for g in groups for x in g[2]])]
        advs = [[w.apply(t) for t in g] for g in raw] if streamed else [
            [w.apply(t) for g in raw for t in g]]
        counts, clipped = AggCounts(), 0
        with dropout_off(model):
            for (prompts, responses, _), a in zip(batches, advs, strict=True):
                scores = response_scores(model, prompts, responses, task.PAD_ID,
                                         temperature=temperature, entropy=True)
                part = losses.objective(cfg, scores.logprobs,
                                        constants(behaviour, prompts, responses), a,
                                        ref=constants(reference, prompts, responses),
                                        entropy=scores.entropy)
                part.partial.backward()
                counts, clipped = counts + part.counts, clipped + part.stats.clipped_tokens
        scale = denominator(cfg.loss_agg, counts, NORM_LEN)
        return [_grad(p) / scale for p in model.parameters()], clipped

    streamed, s_clipped = run(True)
    batched, b_clipped = run(False)
    assert s_clipped == b_clipped > 0
    for s, b in zip(streamed, batched, strict=True):
        torch.testing.assert_close(s, b, rtol=1e-9, atol=1e-12)
    assert max(float(b.abs().max()) for b in batched) > 1e-4


def test_every_statistic_reaches_the_step_record() -> None:
    # The manager copies only STEP_STATS into a step's record: a statistic the trainer computes
    # but the set lacks is silently dropped (the off-policy ones once were).
    stats = TrainStats()
    for f in dataclasses.fields(stats):
        setattr(stats, f.name, 2)
    summary = stats.summary()
    assert {"kl", "entropy", "clip_fraction", "off_policy_weight"} <= summary.keys()
    assert summary.keys() <= STEP_STATS, summary.keys() - STEP_STATS
