"""A code-execution reward: a candidate program passes its tests in the sandbox, or not.

Contract: ``reward: "python:trainer_svc.inputs.code_reward:passes_tests"`` with a dataset whose
answer column holds test code (``assert`` statements, or anything that exits non-zero on a
failure). The response's last fenced code block (the whole response when it has none) runs
in the sandbox (:func:`trainer_svc.inputs.sandbox.run_python`, default limits: no network,
5 s of CPU and wall time, 512 MiB), followed by the tests in the same program: 1.0 when it
exits 0 within the limits, else 0.0. The reward worker's own timeout
(RLBOOST_REWARD_TIMEOUT_S) must be above the sandbox's wall limit, or a slow candidate
counts as a reward error rather than scoring 0; the reward workers (their count) bound how
many sandboxes run at once.
"""

from __future__ import annotations

from trainer_svc.inputs.sandbox import SandboxLimits, code_block, run_python

LIMITS = SandboxLimits()


def passes_tests(prompt: str, response: str, answer: str | None) -> float:
    if answer is None:
        raise ValueError("the passes_tests reward needs tests in the answer column")
    candidate = code_block(response)
    program = f"{response if candidate is None else candidate}\n\n{answer}\n"
    return 1.0 if run_python(program, LIMITS).ok else 0.0
