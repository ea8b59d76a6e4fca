"""The embedded task: prompt format, reward rules, and prompt determinism."""

from __future__ import annotations

import random

import pytest

from trainer_svc.embedded import task
from trainer_svc.embedded.task import EOS_ID, RESPONSE_LEN, digit_id


def _prompt(a: int, d: int) -> list[int]:
    return task.make_prompt(a, d)


def test_vocab_and_ids_are_the_documented_contract() -> None:
    assert (task.PAD_ID, task.BOS_ID, task.EOS_ID, task.SEP_ID) == (0, 1, 2, 3)
    assert task.VOCAB[4:] == [str(d) for d in range(10)]
    assert len(task.VOCAB) == 14
    assert task.DEFAULT_MAX_NEW_TOKENS >= RESPONSE_LEN + 1


def test_reference_response_wraps_mod_10() -> None:
    # 7, step 3: 10, 13, 16, 19, 22 -> 0 3 6 9 2
    assert task.reference_response(_prompt(7, 3)) == [digit_id(x) for x in (0, 3, 6, 9, 2)] + [
        EOS_ID
    ]


def test_perfect_answer_scores_one() -> None:
    for p in task.all_prompts():
        assert task.reward(p, task.reference_response(p)) == 1.0


def test_garbage_scores_zero() -> None:
    p = _prompt(2, 1)  # answer 3 4 5 6 7
    wrong = [digit_id(0)] * RESPONSE_LEN + [EOS_ID]
    assert task.reward(p, wrong) == 0.0
    assert task.reward(p, []) == 0.0
    assert task.reward(p, [EOS_ID]) == 0.0
    assert task.reward(p, [task.PAD_ID] * 8) == 0.0


def test_partial_credit_counts_positions() -> None:
    p = _prompt(2, 1)
    ref = task.reference_response(p)
    two_wrong = list(ref)
    two_wrong[0] = digit_id(9)
    two_wrong[3] = digit_id(9)
    assert task.reward(p, two_wrong) == pytest.approx(3 / 5)


def test_malformed_responses_lose_a_fifth() -> None:
    p = _prompt(0, 2)
    ref = task.reference_response(p)
    assert task.reward(p, ref[:-1]) == pytest.approx(0.8)  # no EOS (truncated)
    assert task.reward(p, [*ref[:-1], digit_id(1), EOS_ID]) == pytest.approx(0.8)  # extra digit
    assert task.reward(p, [*ref, digit_id(1)]) == pytest.approx(0.8)  # junk after EOS
    # Early EOS: the missing positions earn nothing, and the format costs its fifth.
    assert task.reward(p, [*ref[:3], EOS_ID]) == pytest.approx(3 / 5 * 0.8)


def test_shifted_answer_gets_no_credit_for_misaligned_digits() -> None:
    p = _prompt(0, 1)  # 1 2 3 4 5
    shifted = [digit_id(x) for x in (0, 1, 2, 3, 4)] + [EOS_ID]
    assert task.reward(p, shifted) == 0.0


def test_reward_is_always_in_unit_interval() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        p = task.make_prompt(rng.randrange(10), rng.randint(1, 3))
        resp = [rng.randrange(len(task.VOCAB)) for _ in range(rng.randrange(10))]
        r = task.reward(p, resp)
        assert 0.0 <= r <= 1.0


def test_reward_rejects_foreign_prompts() -> None:
    with pytest.raises(ValueError):
        task.reward([task.BOS_ID, digit_id(1)], [EOS_ID])
    with pytest.raises(ValueError):
        task.reward([task.BOS_ID, digit_id(1), digit_id(7), task.SEP_ID], [EOS_ID])


def test_prompts_deterministic_per_seed_and_step() -> None:
    a = task.make_prompts(seed=5, step=3, n=16)
    assert a == task.make_prompts(seed=5, step=3, n=16)
    assert len(a) == 16
    assert all(p in task.all_prompts() for p in a)
    # The first prompts do not depend on how many are asked for.
    assert task.make_prompts(5, 3, 4) == a[:4]


def test_prompts_differ_across_steps_and_seeds() -> None:
    base = task.make_prompts(0, 0, 16)
    assert task.make_prompts(0, 1, 16) != base
    assert task.make_prompts(1, 0, 16) != base


def test_prompts_ignore_global_rng() -> None:
    random.seed(1)
    a = task.make_prompts(7, 2, 8)
    random.seed(2)
    random.random()
    assert task.make_prompts(7, 2, 8) == a


def test_prompts_cover_the_task() -> None:
    seen = {tuple(p) for step in range(50) for p in task.make_prompts(0, step, 8)}
    assert len(seen) == 30
