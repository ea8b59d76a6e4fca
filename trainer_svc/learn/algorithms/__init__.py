"""The math of the RL objectives rlboost trains with: pure torch functions and one config.

Contract: nothing here knows the wire, the manager or the step loop. A trainer uses it so:

1. per group, as it completes: task rewards -> :func:`advantages.is_informative` (dynamic
   sampling) -> :func:`advantages.shaped` (overlong penalty) -> :func:`advantages.raw_advantages`;
2. if ``cfg.scope`` is ``group`` the raw advantages are final: score the group with
   :func:`logprobs.response_scores` under :func:`logprobs.dropout_off`, build its
   :func:`losses.objective`, backpropagate ``objective.partial`` and keep its ``counts``;
   if ``batch``, keep the raw advantages (and optionally backpropagate
   :func:`losses.first_pass_parts`) until the barrier gives :func:`advantages.batch_whitening`;
3. at the barrier divide the accumulated gradient by
   :func:`losses.denominator` of the summed counts, then take the optimizer step;
   further passes (``updates_per_step``, ``minibatches``) run after it on stored old log-probs.

Streaming equals batch exactly for every algorithm and ``loss_agg`` mode (tests, float64).
"""

from shared.algorithm import (
    DEFAULTS,
    Algorithm,
    AlgorithmConfig,
    AlgorithmConfigError,
    Estimator,
    KlEstimator,
    LossAgg,
    PolicyLoss,
    Scope,
)
from trainer_svc.learn.algorithms.losses import AggCounts, aggregate, denominator, partial_sum
from trainer_svc.learn.algorithms.stats import TrainStats, response_stats

__all__ = [
    "DEFAULTS",
    "AggCounts",
    "Algorithm",
    "AlgorithmConfig",
    "AlgorithmConfigError",
    "Estimator",
    "KlEstimator",
    "LossAgg",
    "PolicyLoss",
    "Scope",
    "TrainStats",
    "aggregate",
    "denominator",
    "partial_sum",
    "response_stats",
]
