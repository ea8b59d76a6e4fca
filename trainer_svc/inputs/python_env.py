"""The ``python`` environment: the model runs code in the sandbox and reads what it printed.

Contract (one episode per sample; env ``"python"``):

- A turn that holds a fenced code block (```` ```python ````, ```` ```py ```` or a bare
  ```` ``` ````, closed by ```` ``` ````) runs its last block in the sandbox
  (:func:`trainer_svc.inputs.sandbox.run_python`, no network, CPU, memory, wall-time and
  output limits); the observation is its stdout, then stderr, then a line saying how it
  ended when the sandbox stopped it. The episode goes on.
- A turn without a code block ends the episode with no reward of its own: the run's reward
  function scores the response (``reward`` None).
- The limits are :class:`~trainer_svc.inputs.sandbox.SandboxLimits`; resolution sets the
  wall and CPU limits to a share of the run's ``max_tool_s`` (trainer_svc.inputs.envs).
"""

from __future__ import annotations

from typing import Any

from trainer_svc.inputs.sandbox import SandboxLimits, code_block, run_python


class PythonEnv:
    """One episode of the python environment (see the module doc)."""

    def __init__(self, prompt: str, answer: str | None, seed: int, *,
                 limits: SandboxLimits = SandboxLimits()) -> None:
        self.limits = limits

    def step(self, action: str, call_id: str) -> dict[str, Any]:
        code = code_block(action)
        if code is None:
            return {"observation": None, "reward": None, "done": True}
        return {"observation": run_python(code, self.limits).text(), "reward": None,
                "done": False}
