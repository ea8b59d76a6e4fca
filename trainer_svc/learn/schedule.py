"""The learning-rate schedule of every RL step: a linear warm-up, then the run's rate.

Contract: :func:`learning_rate_at` is a pure function of the step, so a restarted trainer
needs no scheduler state to resume it. The policies (:mod:`trainer_svc.learn.policies`) take
each optimizer step at it with the run's ``learning_rate``; the self-checks
(:mod:`trainer_svc.selfcheck`) use it too, so they measure the schedule a run trains with.
"""

from __future__ import annotations

DEFAULT_LR_WARMUP_STEPS = 5


def learning_rate_at(step: int, base_lr: float,
                     warmup_steps: int = DEFAULT_LR_WARMUP_STEPS) -> float:
    """Learning rate for RL step ``step`` (0-based): linear warm-up, then constant.

    Adam's first updates are ``lr * sign(grad)`` for every parameter, whatever the gradient's
    size; with one noisy group-level estimate per step that is a large step in a mostly
    random direction, and it visibly undoes the warm-up. Ramping the rate lets the moment
    estimates average a few steps first.
    """
    if warmup_steps <= 0:
        return base_lr
    return base_lr * min(1.0, (step + 1) / warmup_steps)
