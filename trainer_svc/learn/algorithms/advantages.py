"""From a group's rewards to advantages: DAPO's shaping and filter, then the estimators.

Contract: pure functions; the reward functions take plain numbers, the estimators 1-D tensors
(one outcome reward per response) and return per-token tensors. Every estimator works in two
stages so that a trainer can stream what it can.

1. :func:`raw_advantages` takes one *group* (the responses to one prompt: their rewards and
   lengths) and returns one 1-D tensor per response, one value per response token. It needs
   nothing outside the group.
2. :func:`batch_whitening` takes the raw advantages of every group of the step and returns the
   :class:`Whitening` to apply to each raw tensor. For ``group``-scope estimators (grpo,
   dr_grpo, rloo) it is the identity, so stage 1 is already final and a group can be trained the
   moment it completes. For ``batch``-scope estimators (reinforce_pp, reinforce_pp_baseline) it
   is the whole step's mean and standard deviation, known only after the barrier.

:func:`step_advantages` does both for a whole step (the batch reference the streaming path must
equal). Every function here is pure and runs under ``no_grad`` semantics: advantages are
constants of the loss.

The estimators (``r_i`` is response i's reward, G the group size):

- **grpo** (DeepSeekMath §4.1.2; DAPO eq. 9): ``(r_i - mean(r)) / (std(r) + 1e-6)`` with the
  unbiased (n - 1) std and veRL's epsilon. A group of one, or one whose rewards are all equal,
  gets zeros. veRL differs for a group of one: it leaves ``r_i / (1 + 1e-6)``.
- **dr_grpo** (Liu et al. 2025 §3.1): ``r_i - mean(r)``; a group of one gets zero.
- **rloo** (Ahmadian et al. 2024 §3): ``r_i - mean_{j != i} r_j`` = ``G / (G - 1) (r_i -
  mean(r))``; a group of one has no other sample to compare with and gets zero (veRL leaves
  ``r_i``).
- **reinforce_pp** (Hu 2025, REINFORCE++): the paper's token-level advantage is the discounted
  return of a reward that is ``r`` at the last token minus ``beta * KL`` at every token, i.e.
  ``A_t = r gamma^(L-1-t) - beta sum_{s>=t} gamma^(s-t) KL_s`` (:func:`token_returns`), then
  normalised with the mean and std over *every token of the batch*. rlboost keeps gamma = 1 and
  KL out of the reward (it is a loss term, ``kl_coef``), so ``A_t = r_i`` at every token of
  response i and the normalisation is ``(r_i - mu) / sqrt(var + 1e-8)`` with mu and the unbiased
  var taken over tokens: a response weighs by its length. This is veRL's
  ``compute_reinforce_plus_plus_outcome_advantage`` with ``gamma = 1``.
- **reinforce_pp_baseline** (Hu 2025, REINFORCE++ w/ baseline): ``r_i - mean(r)`` within the
  group (a group of one: 0), then the same token-level batch normalisation. Note that after it a
  group whose rewards were all equal no longer has zero advantages: the batch mean is
  token-weighted, so it is not zero, and the shift reaches every token.

Whitening guards: if every raw value of the batch is equal (including a batch of one token)
the result is exactly zero rather than rounding noise divided by ``sqrt(1e-8)``.

DAPO (Yu et al. 2025, arXiv 2503.14476) before the estimators:

- :func:`overlong_penalty` is DAPO's soft overlong punishment (§3.4, eq. 13) scaled by a
  penalty factor as veRL's DAPO reward manager does. With ``L_max`` the generation budget
  (``max_new_tokens``) and ``L_cache`` the buffer it is 0 up to ``L_max - L_cache`` tokens,
  ``factor * ((L_max - L_cache) - |y|) / L_cache`` up to ``L_max``, and ``-factor`` beyond:
  a linear ramp from 0 to ``-factor`` over the last ``L_cache`` tokens of the budget. It is
  added to the task reward before the estimator (:func:`shaped`), so it stays group-local.
- :func:`is_informative` is DAPO's dynamic-sampling constraint (§3.2, eq. 11:
  ``0 < |{o_i correct}| < G``) generalised to any reward: a group carries signal for a
  group-relative estimator unless every reward is equal. It is meant for the *task* rewards,
  before overlong shaping, as DAPO filters on accuracy (veRL: ``filter_groups.metric: acc``).
- :func:`is_truncated` says whether a response ended by running out of budget rather than by
  an end-of-sequence token.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from shared.algorithm import SCOPE, Estimator, Scope

GRPO_EPS = 1e-6  # veRL's compute_grpo_outcome_advantage epsilon, added to the std
WHITEN_EPS = 1e-8  # veRL's masked_whiten: (x - mean) * rsqrt(var + 1e-8)


# --- DAPO: shaping and filtering --------------------------------------------------------


def overlong_penalty(length: int, max_length: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO eq. 13 times ``factor`` for a response of ``length`` tokens; 0 when ``buffer`` is 0."""
    if length < 0 or max_length < 1:
        raise ValueError(f"length {length} and max_length {max_length} must be >= 0 and >= 1")
    if not 0 <= buffer <= max_length:
        raise ValueError(f"buffer {buffer} must be within [0, max_length {max_length}]")
    if buffer == 0:
        return 0.0
    expected = max_length - buffer
    if length <= expected:
        return 0.0
    if length <= max_length:
        return factor * (expected - length) / buffer
    return -factor


def shaped(rewards: Sequence[float], lengths: Sequence[int], max_length: int, buffer: int,
           factor: float = 1.0) -> list[float]:
    """Each reward plus its response's overlong penalty."""
    if len(rewards) != len(lengths):
        raise ValueError(f"{len(rewards)} rewards but {len(lengths)} lengths")
    return [float(r) + overlong_penalty(n, max_length, buffer, factor)
            for r, n in zip(rewards, lengths, strict=True)]


def is_informative(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards differ (DAPO's dynamic-sampling filter keeps only these)."""
    return len(rewards) > 1 and any(r != rewards[0] for r in rewards)


def is_truncated(response: Sequence[int], max_new_tokens: int, eos_ids: Collection[int]) -> bool:
    """Whether the response used its whole budget without ending on an end-of-sequence id."""
    return len(response) >= max_new_tokens and not (response and response[-1] in eos_ids)


# --- estimators ----------------------------------------------------------------------------


def _check_rewards(rewards: torch.Tensor) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")


def _all_equal(values: torch.Tensor) -> bool:
    return values.numel() < 2 or bool(torch.all(values == values.reshape(-1)[0]))


def grpo(rewards: torch.Tensor, eps: float = GRPO_EPS) -> torch.Tensor:
    """Group-normalised advantage per response: ``(r - mean) / (std + eps)``, unbiased std."""
    _check_rewards(rewards)
    if _all_equal(rewards):
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) / (rewards.std(unbiased=True) + eps)


def dr_grpo(rewards: torch.Tensor) -> torch.Tensor:
    """Group-centred advantage per response: ``r - mean`` (Dr. GRPO drops the std)."""
    _check_rewards(rewards)
    if _all_equal(rewards):
        return torch.zeros_like(rewards)
    return rewards - rewards.mean()


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """Leave-one-out advantage per response: ``r_i - mean of the other rewards``."""
    _check_rewards(rewards)
    n = rewards.numel()
    if _all_equal(rewards):
        return torch.zeros_like(rewards)
    # (n r_i - sum r) / (n - 1): the same number as r_i - (sum r - r_i) / (n - 1).
    return (n * rewards - rewards.sum()) / (n - 1)


def token_returns(reward: float, length: int, gamma: float = 1.0,
                  token_kl: torch.Tensor | None = None, kl_coef: float = 0.0) -> torch.Tensor:
    """REINFORCE++'s per-token return for one response, in float64.

    The reward ``r`` arrives at the last token and ``-kl_coef * token_kl[t]`` at every token t;
    the return at t discounts what follows by ``gamma``. With ``gamma = 1`` and no KL in the
    reward every token's return is ``r``, which is what rlboost trains with.
    """
    if length < 0:
        raise ValueError(f"negative length {length}")
    step = torch.zeros(length, dtype=torch.float64)
    if token_kl is not None:
        if token_kl.shape != (length,):
            raise ValueError(f"token_kl has shape {tuple(token_kl.shape)}, want ({length},)")
        step -= kl_coef * token_kl.detach().to(torch.float64)
    if length:
        step[-1] += reward
    out = torch.empty_like(step)
    running = 0.0
    for t in range(length - 1, -1, -1):
        running = float(step[t]) + gamma * running
        out[t] = running
    return out


def raw_advantages(estimator: Estimator, rewards: torch.Tensor,
                   lengths: Sequence[int]) -> list[torch.Tensor]:
    """Stage 1 for one group: per-token advantages, final for ``group`` scope (module doc)."""
    _check_rewards(rewards)
    if rewards.numel() != len(lengths):
        raise ValueError(f"{rewards.numel()} rewards but {len(lengths)} lengths")
    match estimator:
        case Estimator.GRPO:
            per_response = grpo(rewards)
        case Estimator.DR_GRPO:
            per_response = dr_grpo(rewards)
        case Estimator.RLOO:
            per_response = rloo(rewards)
        case Estimator.REINFORCE_PP:
            per_response = rewards
        case Estimator.REINFORCE_PP_BASELINE:
            per_response = dr_grpo(rewards)
    return [per_response[i].expand(n).clone() for i, n in enumerate(lengths)]


@dataclass(frozen=True, slots=True)
class Whitening:
    """The affine map ``(x - mean) * scale`` that turns raw advantages into final ones."""

    mean: float
    scale: float

    def apply(self, raw: torch.Tensor) -> torch.Tensor:
        return (raw - self.mean) * self.scale


IDENTITY = Whitening(0.0, 1.0)


def whitening(values: Sequence[torch.Tensor], eps: float = WHITEN_EPS) -> Whitening:
    """Mean and ``1 / sqrt(unbiased var + eps)`` over every token of ``values``, in float64."""
    flat = torch.cat([v.detach().reshape(-1).to(torch.float64) for v in values]) if values \
        else torch.zeros(0, dtype=torch.float64)
    if _all_equal(flat):
        # Every value equal (or fewer than two): map each to exactly zero.
        return Whitening(float(flat[0]) if flat.numel() else 0.0, 1.0)
    mean = float(flat.mean())
    var = float(flat.var(unbiased=True))
    return Whitening(mean, 1.0 / (var + eps) ** 0.5)


def batch_whitening(estimator: Estimator,
                    raw_groups: Sequence[Sequence[torch.Tensor]]) -> Whitening:
    """Stage 2: identity for ``group`` scope, the step's whitening for ``batch`` scope."""
    if SCOPE[estimator] is Scope.GROUP:
        return IDENTITY
    return whitening([t for group in raw_groups for t in group])


def step_advantages(
    estimator: Estimator, groups: Sequence[tuple[torch.Tensor, Sequence[int]]],
) -> list[list[torch.Tensor]]:
    """Final per-token advantages of a whole step: ``groups`` holds (rewards, lengths) pairs."""
    raw = [raw_advantages(estimator, rewards, lengths) for rewards, lengths in groups]
    w = batch_whitening(estimator, raw)
    return [[w.apply(t) for t in group] for group in raw]
