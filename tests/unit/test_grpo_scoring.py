"""The policy gradient is taken at the sampling temperature with dropout off.

Engines sample from ``softmax(logits / T)``; the policy gradient must be that distribution's.
The reference here is independent of the trainer's scoring code: one unpadded, unbatched
forward per response of a copy of the model in eval mode, ``log_softmax(logits / T)`` picked at
each response token, weighted by advantages computed by hand, ``-sum A_i sum_t log p(y_t)``
backpropagated. At T in {0.7, 1.0, 1.3}, on a model whose attention dropout is 0.5 and left in
training mode (as the trainer leaves it; issue 12 part 6), it must equal:

the direction of the first update the trainer's :class:`StepTrainer` (the self-checks' too)
takes for the group (GRPO, ratio 1 on the first pass; token-mean scaling and gradient clipping
change the length only).

Ignoring T, or scoring with dropout on, moves either far outside the tolerance.
"""

from __future__ import annotations

import copy
import statistics
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shared.algorithm import AlgorithmConfig
from shared.spec import RunSpec
from tests.unit.test_algorithms_logprobs import _batch, _model
from trainer_svc.embedded import task
from trainer_svc.learn.policies import TorchPolicy, make_policy
from trainer_svc.learn.step_trainer import Group, RunShape, StepTrainer

REWARDS = [1.0, 0.0, 0.5, 0.25, 1.0]


def reference_grads(model: torch.nn.Module, prompts: list[list[int]],
                    responses: list[list[int]], temperature: float) -> dict[str, torch.Tensor]:
    # (r - mean) / (std + eps), unbiased std, eps 1e-6: the GRPO advantage as veRL writes it.
    mean, std = statistics.mean(REWARDS), statistics.stdev(REWARDS) + 1e-6
    model.eval()
    model.zero_grad()
    loss = torch.zeros((), dtype=torch.float64)
    for prompt, response, reward in zip(prompts, responses, REWARDS, strict=True):
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0]
        rows = logits[len(prompt) - 1:len(prompt) - 1 + len(response)] / temperature
        picked = F.log_softmax(rows, dim=-1)[torch.arange(len(response)), response]
        loss = loss - (reward - mean) / std * picked.sum()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([tensors[n].flatten() for n in sorted(tensors)])


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
def test_the_trainer_steps_along_the_gradient_at_the_temperature(temperature: float) -> None:
    model = _model(attention_dropout=0.5)
    reference = reference_grads(copy.deepcopy(model), *_batch(3), temperature)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.train()  # as the trainer keeps it: scoring must turn dropout off by itself
    trainer = StepTrainer(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                          AlgorithmConfig.for_algorithm(), RunShape(8, temperature, 1),
                          task.PAD_ID)
    prompts, responses = _batch(3)
    trainer.add_group(Group(prompt_index=0, prompts=prompts, responses=responses,
                            rewards=REWARDS, truncated=[False] * len(responses)))
    trainer.step()
    assert model.training and all(m.training for m in model.modules())  # modes restored
    moved = {n: before[n] - p.detach() for n, p in model.named_parameters() if n in reference}
    step, grad = flat(moved), flat(reference)
    torch.testing.assert_close(step / step.norm(), grad / grad.norm(), rtol=0, atol=1e-9)


def test_ignoring_the_temperature_would_be_caught() -> None:
    """The reference tells the temperatures apart: the test above can fail."""
    model = _model()
    cold = reference_grads(copy.deepcopy(model), *_batch(3), 0.7)
    warm = reference_grads(copy.deepcopy(model), *_batch(3), 1.0)
    name = "model.embed_tokens.weight"  # tied to the output layer
    assert (cold[name] - warm[name]).abs().max() > 1e-3 * warm[name].abs().max()


def test_the_policy_scores_at_the_run_temperature(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    _model().float().save_pretrained(model_dir)
    spec = RunSpec(model=str(model_dir), temperature=1.3)
    policy = make_policy(spec, tmp_path, tmp_path / "run", 0.0)
    assert isinstance(policy, TorchPolicy)
    assert policy.trainer.shape.temperature == 1.3
