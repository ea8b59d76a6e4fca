"""What an agentic run adds to the trainer: its environment's pool, and answering each step's calls.

Contract: :func:`open_tools` gives the run's :class:`Tools` (its env pool started, the chat
format that renders observations), or None for a run with one model turn. A spec naming an
environment that does not load fails the run at setup, naming why. :meth:`Tools.answering`
runs a step's :class:`~trainer_svc.tool_loop.ToolLoop` for as long as its block lasts (the
step's rollout, up to its barrier), then ends the episodes still open.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from shared.config import TrainerConfig
from shared.process import cancel_and_wait
from shared.spec import RunSpec
from trainer_svc.errors import RunAborted
from trainer_svc.inputs.chat import ChatFormat
from trainer_svc.inputs.tool_pool import EnvPool, tokenizer_fit
from trainer_svc.inputs.user_code import UserCodeError
from trainer_svc.manager_client import ManagerClient
from trainer_svc.tool_loop import ToolLoop
from trainer_svc.workload import StepPrompt, Workload


@dataclass
class Tools:
    pool: EnvPool
    chat: ChatFormat
    spec: RunSpec

    @contextlib.asynccontextmanager
    async def answering(self, manager: ManagerClient, run_id: str, step: int,
                        prompts: Sequence[StepPrompt], poll_s: float) -> AsyncIterator[ToolLoop]:
        loop = ToolLoop(manager, self.pool, self.chat, run_id, step, prompts, self.spec.seed,
                        poll_s)
        task = asyncio.create_task(loop.run())
        try:
            yield loop
        finally:
            await cancel_and_wait(task)
            await loop.close()

    async def close(self) -> None:
        await self.pool.close()


async def open_tools(spec: RunSpec, workload: Workload, cfg: TrainerConfig,
                     registry: CollectorRegistry) -> Tools | None:
    if not spec.env or spec.max_turns <= 1:
        return None
    chat: Any = getattr(workload, "chat", None)
    if not isinstance(chat, ChatFormat):  # the spec needs a dataset with an env: never here
        raise RunAborted(f"env {spec.env!r} needs a dataset's tokenizer and chat format")
    pool = EnvPool(spec.env, dirs=cfg.reward_dirs, tool_s=spec.max_tool_s,
                   workers=cfg.tool_workers, max_turns=spec.max_turns,
                   max_observation_tokens=spec.max_observation_tokens,
                   fit=tokenizer_fit(chat.tokenizer), registry=registry,
                   pass_env=cfg.reward_env_names)
    try:
        await pool.start()
    except UserCodeError as exc:
        await pool.close()
        raise RunAborted(f"env {spec.env!r}: {exc}") from exc
    return Tools(pool, chat, spec)
