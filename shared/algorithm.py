"""The algorithm a run trains with: its name, every knob, and each paper's defaults.

Contract: :class:`AlgorithmConfig` is an immutable, validated value. Build it with
:meth:`AlgorithmConfig.for_algorithm` (or :meth:`AlgorithmConfig.from_spec` from a run spec's
flat fields): a knob left out, or given as ``None``, takes the algorithm's default from
:data:`DEFAULTS`. A bad value raises :class:`AlgorithmConfigError` naming the field, which the
manager turns into a 422. :meth:`AlgorithmConfig.check_run` checks the knobs that depend on
the run's shape (generation budget, prompts per step). It lives in ``shared`` because the run
spec validates it while parsing: the manager refuses a bad combination before a run exists.

:meth:`AlgorithmConfig.for_run` scales the two defaults that are sizes to the run, so a paper's
algorithm also runs on a small spec: DAPO's overlong buffer is the last fifth of the budget
(4096 of 20480 tokens), and the mini-batch count is at most the prompts per step (mini-batches
split a step by groups, as veRL's ``ppo_mini_batch_size`` counts prompts). A knob the user set
is never scaled; it is checked.

Where each default comes from (section and equation numbers of the papers' arXiv versions):

- ``grpo``: rlboost's objective before this package, kept so existing runs train the same:
  clip 0.2 both sides, ``token_mean``, no KL term. DeepSeekMath's GRPO (Shao et al. 2024,
  arXiv 2402.03300, §4.1) used the same clip with a per-response token mean
  (``seq_mean_token_mean``) and a k3 KL term with beta 0.04; set those knobs to get it.
- ``dr_grpo``: Liu et al. 2025 (arXiv 2503.20783, §3.1): advantages without the std division,
  and the per-response token *sum* over a constant (the generation budget) rather than over the
  response's length: ``seq_mean_token_sum_norm``; no KL term; clip as GRPO (veRL's
  docs/algo/grpo.md "DrGRPO" gives the same settings).
- ``dapo``: Yu et al. 2025 (arXiv 2503.14476): clip-higher eps_low 0.2, eps_high 0.28 (§3.1),
  dynamic sampling (§3.2, the constraint of eq. 11) *off* until the spec asks for it (the one
  default that departs from the paper: it changes what a step costs, more prompts generated and
  responses aborted, which a user should choose knowingly), token-level loss ``token_mean`` (§3.3,
  eq. 12), overlong reward shaping with a 4096-token buffer (§3.4, eq. 13) and penalty factor
  1.0 within a 20480-token budget (veRL's docs/algo/dapo.md), no KL term (§2.3); 16 gradient
  updates per rollout step (§4.1: 512 prompts x 16 responses, mini-batches of 512 responses;
  veRL's DAPO scripts: train_prompt_bsz 512, train_prompt_mini_bsz 32).
- ``rloo``: Ahmadian et al. 2024 (arXiv 2402.14740, §3): the leave-one-out baseline, and the
  whole response as one action, so the loss is the per-response token sum
  (``seq_mean_token_sum``, sum_t log pi = log pi(y|x)). The paper takes one plain policy-gradient
  step per batch; the clip (0.2, veRL's default) only binds when ``updates_per_step`` or
  ``minibatches`` exceed 1. The paper, and veRL's RLOO example, put a k1 KL penalty into the
  reward (coefficient 0.001 there); rlboost applies KL only as a loss term, default off.
- ``reinforce_pp``, ``reinforce_pp_baseline``: Hu 2025 (arXiv 2501.03262): PPO's clip 0.2 and
  token-level loss, advantages normalised over the whole batch (see
  :mod:`trainer_svc.learn.algorithms.advantages` for how the paper's token-level returns reduce with
  an outcome reward). The paper puts a k1 KL penalty into the reward (veRL's examples: 0.001);
  as for rloo, rlboost applies KL only as a loss term, default off.
- ``gspo``: Zheng et al. 2025 (arXiv 2507.18071): GRPO's advantages, the sequence-level ratio
  clipped to [1 - 3e-4, 1 + 4e-4] (§5.1: "the left and right clipping ranges in Equation (5)"),
  one loss term per response averaged over the group (eq. 5, i.e. ``seq_mean_token_mean``), each
  rollout batch split into four mini-batches (§5.1); no KL term. veRL's GSPO example script
  uses exactly these values, citing §5.1.

``kl_estimator`` defaults to ``k3`` everywhere (DeepSeekMath's estimator, veRL's
``low_var_kl``); it matters only when ``kl_coef`` > 0. There the KL is a loss term: the trainer
differentiates each sampled token's estimate with the sample held fixed, so what matters is the
divergence the estimator's *gradient* follows, not the one its value estimates (Tang & Munos
2025, "On a few pitfalls in KL divergence gradient estimation for RL", arXiv 2506.09477; Shah
et al. 2025, "A Comedy of Estimators", arXiv 2512.21852). Per token, in expectation over the
token ``y ~ pi(.|prefix)`` with the prefix fixed, ``d = log pi(y) - log pi_ref(y)``, and sums
over the vocabulary:

- ``k1 = d``: ``E[grad d] = sum_y pi grad log pi = grad sum_y pi = 0``. Its value is unbiased
  for KL(pi || pi_ref), but as a loss term it only adds noise, so ``k1`` with ``kl_coef`` > 0 is
  refused. (In the *reward*, where RLOO's and REINFORCE++'s papers put it, k1 is the right
  estimator; rlboost has no KL in the reward.)
- ``k2 = d^2 / 2``: ``E[d grad log pi] = sum_y d grad pi = grad KL(pi || pi_ref)`` (the term
  ``sum_y pi grad log pi`` of the exact gradient is 0): the reverse KL, the one the RL
  objective names.
- ``k3 = exp(-d) + d - 1``: ``E[(1 - pi_ref / pi) grad log pi] = -sum_y pi_ref grad log pi =
  grad KL(pi_ref || pi)``: the forward KL, although its value estimates the reverse one.

Summed over a response these are per-token gradients: how a token changes the prefixes of the
tokens after it is left out, so none is the gradient of the sequence-level KL (Tang & Munos).
tests/unit/test_algorithms_objective.py checks the three identities exactly on a categorical
policy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import Any


class Algorithm(StrEnum):
    GRPO = "grpo"
    DR_GRPO = "dr_grpo"
    DAPO = "dapo"
    RLOO = "rloo"
    REINFORCE_PP = "reinforce_pp"
    REINFORCE_PP_BASELINE = "reinforce_pp_baseline"
    GSPO = "gspo"


class LossAgg(StrEnum):
    """How per-token losses become the step loss (veRL's ``agg_loss`` modes, underscored)."""

    TOKEN_MEAN = "token_mean"
    SEQ_MEAN_TOKEN_SUM = "seq_mean_token_sum"
    SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq_mean_token_sum_norm"


class KlEstimator(StrEnum):
    """Schulman's estimators of KL(pi || pi_ref) from one sample (veRL: kl, mse, low_var_kl)."""

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"


class OffPolicy(StrEnum):
    """How the policy gradient corrects for tokens the trainer's policy did not sample
    (:mod:`trainer_svc.learn.algorithms.losses`, "Off-policy corrections")."""

    NONE = "none"  # the recomputed log-probs are taken as the behaviour policy's
    TIS = "tis"  # truncated importance sampling of proximal over behaviour, capped
    DECOUPLED = "decoupled"  # AReaL's decoupled PPO: clip against the proximal policy


class Estimator(StrEnum):
    """The advantage estimator an algorithm uses (:mod:`trainer_svc.learn.algorithms.advantages`).
    """

    GRPO = "grpo"
    DR_GRPO = "dr_grpo"
    RLOO = "rloo"
    REINFORCE_PP = "reinforce_pp"
    REINFORCE_PP_BASELINE = "reinforce_pp_baseline"


class Scope(StrEnum):
    """What an advantage depends on: its own group, or every group of the step."""

    GROUP = "group"  # final as soon as the group completes: the trainer may stream it
    BATCH = "batch"  # needs the whole step's rewards: final only after the barrier


class PolicyLoss(StrEnum):
    TOKEN_CLIP = "token_clip"  # PPO/GRPO/DAPO: one ratio and one clip per token
    SEQUENCE_CLIP = "sequence_clip"  # GSPO: one length-normalised ratio and clip per response


ESTIMATOR: dict[Algorithm, Estimator] = {
    Algorithm.GRPO: Estimator.GRPO,
    Algorithm.DR_GRPO: Estimator.DR_GRPO,
    Algorithm.DAPO: Estimator.GRPO,
    Algorithm.RLOO: Estimator.RLOO,
    Algorithm.REINFORCE_PP: Estimator.REINFORCE_PP,
    Algorithm.REINFORCE_PP_BASELINE: Estimator.REINFORCE_PP_BASELINE,
    Algorithm.GSPO: Estimator.GRPO,
}

SCOPE: dict[Estimator, Scope] = {
    Estimator.GRPO: Scope.GROUP,
    Estimator.DR_GRPO: Scope.GROUP,
    Estimator.RLOO: Scope.GROUP,
    Estimator.REINFORCE_PP: Scope.BATCH,
    Estimator.REINFORCE_PP_BASELINE: Scope.BATCH,
}

# Estimators that compare a response with the others of its group: in a group of one every
# advantage is 0 (reinforce_pp_baseline's too, after its whitening), so nothing would train.
GROUP_RELATIVE: frozenset[Estimator] = frozenset({
    Estimator.GRPO, Estimator.DR_GRPO, Estimator.RLOO, Estimator.REINFORCE_PP_BASELINE})

_COMMON: dict[str, Any] = {
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.2,
    "loss_agg": LossAgg.TOKEN_MEAN,
    "kl_coef": 0.0,
    "kl_estimator": KlEstimator.K3,
    "entropy_coef": 0.0,
    "overlong_buffer": 0,
    "overlong_penalty_factor": 1.0,
    "updates_per_step": 1,
    "minibatches": 1,
    "dynamic_sampling": False,
    "off_policy": OffPolicy.NONE,
    "off_policy_cap": None,
}
# The default cap of each correction's behaviour weight when the spec sets none: TIS truncates
# at 2 (the value Yao et al.'s TIS post runs with; veRL's example sets 10), decoupled PPO has
# no cap (AReaL's behav_imp_weight_cap defaults to None).
OFF_POLICY_CAP: dict[OffPolicy, float | None] = {
    OffPolicy.NONE: None, OffPolicy.TIS: 2.0, OffPolicy.DECOUPLED: None}

# Each algorithm's paper defaults (sources in the module docstring).
DEFAULTS: dict[Algorithm, dict[str, Any]] = {
    Algorithm.GRPO: dict(_COMMON),
    Algorithm.DR_GRPO: {**_COMMON, "loss_agg": LossAgg.SEQ_MEAN_TOKEN_SUM_NORM},
    # dynamic_sampling stays False (module doc): the paper's filter is opt-in.
    Algorithm.DAPO: {**_COMMON, "clip_ratio_high": 0.28, "overlong_buffer": 4096,
                     "minibatches": 16},
    Algorithm.RLOO: {**_COMMON, "loss_agg": LossAgg.SEQ_MEAN_TOKEN_SUM},
    Algorithm.REINFORCE_PP: dict(_COMMON),
    Algorithm.REINFORCE_PP_BASELINE: dict(_COMMON),
    Algorithm.GSPO: {**_COMMON, "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4,
                     "loss_agg": LossAgg.SEQ_MEAN_TOKEN_MEAN, "minibatches": 4},
}


# DAPO's generation budget (veRL's docs/algo/dapo.md): its 4096-token buffer is a fifth of it.
DAPO_MAX_LENGTH = 20480


class AlgorithmConfigError(ValueError):
    """A knob has a value the algorithm cannot use (not retryable: the spec is wrong)."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field  # the run-spec field at fault
        self.detail = detail  # why, in words a user can act on


@dataclass(frozen=True, slots=True, kw_only=True)
class AlgorithmConfig:
    """Every knob of the objective; see :data:`DEFAULTS` for each algorithm's values."""

    algorithm: Algorithm
    clip_ratio_low: float  # the ratio is clipped below at 1 - clip_ratio_low
    clip_ratio_high: float  # and above at 1 + clip_ratio_high (DAPO's clip-higher)
    loss_agg: LossAgg  # how per-token losses are averaged into the step loss
    kl_coef: float  # weight of the KL(pi || pi_ref) loss term; 0 loads no reference model
    kl_estimator: KlEstimator  # which one-sample KL estimator the term uses
    entropy_coef: float  # weight of the entropy bonus (subtracted from the loss)
    overlong_buffer: int  # DAPO: tokens before max_new_tokens where a length penalty ramps; 0 = off
    overlong_penalty_factor: float  # DAPO: the penalty at max_new_tokens
    updates_per_step: int  # passes (epochs) over the step's responses
    minibatches: int  # optimizer steps per pass, each on an equal share of the responses
    dynamic_sampling: bool  # DAPO: train only on groups whose rewards are not all equal
    off_policy: OffPolicy  # the behaviour-policy correction (OffPolicy)
    # TIS: the weight's truncation; decoupled: tokens whose weight exceeds it get no loss;
    # None: the correction's default (OFF_POLICY_CAP), which for decoupled is no cap
    off_policy_cap: float | None

    def __post_init__(self) -> None:
        def finite(name: str, value: float, low: float, high: float = math.inf) -> None:
            if not (math.isfinite(value) and low <= value <= high):
                raise AlgorithmConfigError(name, f"{value!r} is not in [{low}, {high}]")

        finite("clip_ratio_low", self.clip_ratio_low, 0.0, 1.0)
        if self.clip_ratio_low == 1.0:
            # The ratio's lower bound would be 0: nothing below would ever clip.
            raise AlgorithmConfigError("clip_ratio_low", "must be below 1")
        finite("clip_ratio_high", self.clip_ratio_high, 0.0)
        finite("kl_coef", self.kl_coef, 0.0)
        finite("entropy_coef", self.entropy_coef, -math.inf)
        finite("overlong_penalty_factor", self.overlong_penalty_factor, 0.0)
        for name in ("overlong_buffer", "updates_per_step", "minibatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise AlgorithmConfigError(name, f"{value!r} is not an integer")
        if self.overlong_buffer < 0:
            raise AlgorithmConfigError("overlong_buffer", "must be 0 (off) or positive")
        if self.updates_per_step < 1:
            raise AlgorithmConfigError("updates_per_step", "must be at least 1")
        if self.minibatches < 1:
            raise AlgorithmConfigError("minibatches", "must be at least 1")
        if self.off_policy_cap is not None:
            finite("off_policy_cap", self.off_policy_cap, 1.0)
            if self.off_policy is OffPolicy.NONE:
                raise AlgorithmConfigError("off_policy_cap", "needs off_policy tis or decoupled")
        if self.kl_coef > 0.0 and self.kl_estimator is KlEstimator.K1:
            raise AlgorithmConfigError(
                "kl_estimator", "k1 as a loss term (kl_coef > 0) has zero expected gradient "
                "(E[grad log pi] = 0) and regularises nothing; use k2 (its gradient is that of "
                "KL(pi || ref)) or k3 (that of KL(ref || pi))")

    @classmethod
    def for_algorithm(cls, algorithm: str | Algorithm = Algorithm.GRPO,
                      **overrides: Any) -> AlgorithmConfig:
        """The algorithm's defaults with ``overrides`` applied (a ``None`` keeps the default)."""
        try:
            algo = Algorithm(algorithm)
        except ValueError:
            raise AlgorithmConfigError(
                "algorithm", f"{algorithm!r} is not one of {[a.value for a in Algorithm]}"
            ) from None
        known = {f.name for f in fields(cls)} - {"algorithm"}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise AlgorithmConfigError(unknown[0], "is not an algorithm knob")
        values = dict(DEFAULTS[algo])
        values.update({k: v for k, v in overrides.items() if v is not None})
        for name, kind in (("loss_agg", LossAgg), ("kl_estimator", KlEstimator),
                           ("off_policy", OffPolicy)):
            try:
                values[name] = kind(values[name])
            except ValueError:
                raise AlgorithmConfigError(
                    name, f"{values[name]!r} is not one of {[k.value for k in kind]}"
                ) from None
        if not isinstance(values["dynamic_sampling"], bool):
            raise AlgorithmConfigError("dynamic_sampling", "must be true or false")
        if values["off_policy_cap"] is None:
            values["off_policy_cap"] = OFF_POLICY_CAP[values["off_policy"]]
        for name in ("clip_ratio_low", "clip_ratio_high", "kl_coef", "entropy_coef",
                     "overlong_penalty_factor", "off_policy_cap"):
            value = values[name]
            if value is None and name == "off_policy_cap":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise AlgorithmConfigError(name, f"{value!r} is not a number")
            values[name] = float(value)
        return cls(algorithm=algo, **values)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> AlgorithmConfig:
        """From a run spec's flat fields; fields that are not algorithm knobs are ignored."""
        knobs = {f.name for f in fields(cls)} - {"algorithm"}
        return cls.for_algorithm(spec.get("algorithm") or Algorithm.GRPO,
                                 **{k: v for k, v in spec.items() if k in knobs})

    def with_(self, **changes: Any) -> AlgorithmConfig:
        """A copy with ``changes`` applied and validated."""
        return replace(self, **changes)

    @property
    def estimator(self) -> Estimator:
        return ESTIMATOR[self.algorithm]

    @property
    def scope(self) -> Scope:
        """``group``: advantages are final per group; ``batch``: only after the barrier."""
        return SCOPE[self.estimator]

    @property
    def policy_loss(self) -> PolicyLoss:
        if self.algorithm is Algorithm.GSPO:
            return PolicyLoss.SEQUENCE_CLIP
        return PolicyLoss.TOKEN_CLIP

    @property
    def needs_reference(self) -> bool:
        """Whether a frozen reference policy must be loaded (only for a KL term)."""
        return self.kl_coef > 0.0

    @classmethod
    def for_run(cls, spec: Mapping[str, Any], *, max_new_tokens: int, groups_per_step: int,
                samples_per_prompt: int | None = None) -> AlgorithmConfig:
        """:meth:`from_spec` with the size defaults scaled to the run (module doc), checked."""
        base = cls.from_spec(spec)
        scaled: dict[str, Any] = {}
        if spec.get("overlong_buffer") is None and base.overlong_buffer:
            scaled["overlong_buffer"] = (max_new_tokens * base.overlong_buffer
                                         // DAPO_MAX_LENGTH)
        if spec.get("minibatches") is None:
            scaled["minibatches"] = min(base.minibatches, groups_per_step)
        cfg = base.with_(**scaled) if scaled else base
        cfg.check_run(max_new_tokens=max_new_tokens, groups_per_step=groups_per_step,
                      samples_per_prompt=samples_per_prompt)
        return cfg

    def check_run(self, *, max_new_tokens: int, groups_per_step: int,
                  samples_per_prompt: int | None = None) -> None:
        """Raise if a knob cannot work with the run's generation budget, batch or group size
        (``samples_per_prompt`` None: not checked)."""
        if samples_per_prompt == 1 and self.estimator in GROUP_RELATIVE:
            raise AlgorithmConfigError(
                "samples_per_prompt",
                f"{self.algorithm.value} compares each response with the others of its group, "
                "so a group of 1 gets all-zero advantages and trains nothing; use at least 2 "
                "(or algorithm reinforce_pp, whose baseline is the whole batch)",
            )
        if self.overlong_buffer and self.overlong_buffer >= max_new_tokens:
            # DAPO's buffer is the last 4096 of 20480 tokens; with a budget below that the
            # penalty would reach responses of every length, which is a different objective.
            raise AlgorithmConfigError(
                "overlong_buffer",
                f"{self.overlong_buffer} tokens must be below max_new_tokens ({max_new_tokens}); "
                "DAPO penalises the last 4096 of 20480 (a fifth), or set 0 to turn it off",
            )
        if self.minibatches > groups_per_step:
            raise AlgorithmConfigError(
                "minibatches",
                f"{self.minibatches} mini-batches cannot split {groups_per_step} prompts "
                "(a mini-batch holds whole groups)",
            )
