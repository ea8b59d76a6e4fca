"""The tiny-chat GRPO self-check runs end to end (a quick build, two steps): it cannot rot.

Whether it lifts the reward is its own question, answered by running it
(``python -m trainer_svc.selfcheck.chat``), not here: a full build takes a minute or more.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer_svc.embedded import tiny_chat as tc
from trainer_svc.selfcheck import chat as selfcheck_chat


async def test_two_steps_with_a_quick_build(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tc, "WARMUP_STEPS", 2)
    res = await selfcheck_chat.check_seed(
        tmp_path, seed=0, steps=2, prompts_per_step=2, samples_per_prompt=2,
        max_new_tokens=4, eval_every=1, window=1,
    )
    assert len(res.step_rewards) == 2
    assert [s for s, _ in res.evals] == [0, 1, 2]
    assert all(0.0 <= r <= 1.0 for r in res.step_rewards)
    assert res.reward_errors == 0
    assert res.build_s > 0 and res.rl_s > 0
