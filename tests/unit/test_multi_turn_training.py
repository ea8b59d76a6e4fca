"""Multi-turn samples through the trainer's step code, on the tiny CPU model.

The service turns a scored group's samples into what the policy trains with
(:func:`trainer_svc.service.training_group`), and the run's policy (``make_policy`` of a spec on
the tiny model: float32, AdamW, the run's algorithm) takes the step. A trailing observation
turn is never context for a trained token, so under a correct mask a step on samples that end
with one must equal, bit for bit, the step on the same samples with it cut off: any share of
it in a loss term, a count, a denominator or a whitening would move the weights elsewhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shared.protocol import Sample
from shared.spec import RunSpec
from shared.turns import Turn, TurnsError
from trainer_svc.embedded import task
from trainer_svc.learn.policies import TorchPolicy, make_policy
from trainer_svc.service import training_group

D = task.DIGIT_IDS
PROMPT = task.make_prompt(3, 2)
# Per sample: model tokens, then a trailing observation (empty: none), and the reward.
ROWS: list[tuple[list[int], list[int], float]] = [
    ([D[1], D[2], D[3], D[4], D[5], D[6], D[7], task.EOS_ID], [], 1.0),  # the longest row
    ([D[5], D[7]], [D[0], D[9], D[9]], 0.0),
    ([D[4], D[2], D[8]], [D[3]], 0.5),
    ([D[6]], [D[1], D[1]], 0.25),
]


def _sample(s: int, model: list[int], observation: list[int], reward: float,
            with_observation: bool) -> Sample:
    response = model + observation if with_observation else list(model)
    turns = [Turn(role="model", start=0, end=len(model)),
             Turn(role="observation", start=len(model), end=len(response),
                  call_id=f"run:0:0:{s}:1", observation="99")] \
        if with_observation and observation else []
    return Sample(request_id=f"run:0:0:{s}", prompt_index=0, sample_index=s, weight_version=0,
                  prompt_token_ids=PROMPT, response_token_ids=response, finish_reason="length",
                  instances=["i1"], reward=reward, turns=turns)


def _group(with_observation: bool) -> list[Sample]:
    return [_sample(s, m, o, r, with_observation) for s, (m, o, r) in enumerate(ROWS)]


def _step(tmp_path: Path, algorithm: str, samples: list[Sample]
          ) -> tuple[list[torch.Tensor], dict[str, Any]]:
    # One group per step, so the step's groups are known; the budget covers the longest row.
    spec = RunSpec(model="tiny", algorithm=algorithm, prompts_per_step=1, max_new_tokens=8,
                   learning_rate=1e-2)
    policy = make_policy(spec, tmp_path / "data", tmp_path / f"run-{len(list(tmp_path.iterdir()))}",
                         0.0)
    assert isinstance(policy, TorchPolicy)
    policy.add_group(training_group(samples))
    stats = policy.step(0)
    return [p.detach().clone() for p in policy.model.parameters()], stats


def test_samples_without_turns_train_without_a_mask() -> None:
    group = training_group(_group(with_observation=False))
    assert group.loss_masks is None
    assert group.responses == [m for m, _, _ in ROWS] and group.rewards == [1.0, 0.0, 0.5, 0.25]
    masked = training_group(_group(with_observation=True))
    assert masked.loss_masks == [[1] * len(m) + [0] * len(o) for m, o, _ in ROWS]


def test_bad_turns_fail_naming_the_sample() -> None:
    samples = _group(with_observation=True)
    samples[2].turns[1].end += 1  # past the response
    with pytest.raises(TurnsError, match=r"sample run:0:0:2: turn 1: ends at 5, past the "):
        training_group(samples)
    samples = _group(with_observation=True)
    samples[1].loss_mask = [1] * len(samples[1].response_token_ids)
    with pytest.raises(TurnsError, match="sample run:0:0:1: loss_mask 11111 differs"):
        training_group(samples)


@pytest.mark.parametrize("algorithm", ["grpo", "gspo", "reinforce_pp"])
def test_a_trailing_observation_changes_nothing(tmp_path: Path, algorithm: str) -> None:
    cut, cut_stats = _step(tmp_path, algorithm, _group(with_observation=False))
    full, full_stats = _step(tmp_path, algorithm, _group(with_observation=True))
    for a, b in zip(cut, full, strict=True):
        assert torch.equal(a, b)
    observation_tokens = sum(len(o) for _, o, _ in ROWS)
    assert full_stats["trained_tokens"] == cut_stats["trained_tokens"] == cut_stats["tokens"]
    assert full_stats["tokens"] == cut_stats["tokens"] + observation_tokens
    assert full_stats["loss"] == cut_stats["loss"]
    assert full_stats["grad_norm"] == cut_stats["grad_norm"] > 0  # the step trained
