"""What an agentic run adds to the trainer: its environment's pool, and answering each step's calls.

Contract: :func:`open_tools` gives the run's :class:`Tools` (its env pool started, the codec
that turns ids into an action's text and an observation into ids: the run's chat format, or
:class:`EmuTurns` for the emulated model), or None for a run with one model turn. A spec naming an
environment that does not load fails the run at setup, naming why. :meth:`Tools.answering`
runs a step's :class:`~trainer_svc.tool_loop.ToolLoop` for as long as its block lasts (the
step's rollout, up to its barrier), then ends the episodes still open.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from shared.config import TrainerConfig
from shared.process import cancel_and_wait
from shared.spec import RunSpec
from shared.turns import EMU_FIRST_TOKEN, EMU_TURN_MARK
from trainer_svc.errors import RunAborted
from trainer_svc.inputs.chat import ChatFormat
from trainer_svc.inputs.tool_pool import EnvPool, Fit, byte_fit, tokenizer_fit
from trainer_svc.inputs.user_code import UserCodeError
from trainer_svc.learn.policies.emu import EMU_VOCAB_SIZE
from trainer_svc.manager_client import ManagerClient
from trainer_svc.tool_loop import ToolLoop, TurnCodec
from trainer_svc.workload import StepPrompt, Workload


class EmuTurns:
    """EMULATION: the emu model's stand-in for a chat format. An action's text is its ids; an
    observation is up to OBSERVATION_IDS ids drawn from its text's hash (content ids, as the
    emu engine samples them), then :data:`~shared.turns.EMU_TURN_MARK`, where its next model turn
    starts: a pure function of the environment's answer."""

    OBSERVATION_IDS = 8

    def __init__(self, vocab_size: int = EMU_VOCAB_SIZE) -> None:
        self.vocab_size = vocab_size

    def decode(self, token_ids: Sequence[int]) -> str:
        return " ".join(str(t) for t in token_ids)

    def observation(self, text: str, turn_end: int) -> list[int]:
        del turn_end  # the emu model has no template between turns
        digest = hashlib.sha256(text.encode()).digest()
        span = self.vocab_size - EMU_FIRST_TOKEN
        ids = [int.from_bytes(digest[i:i + 4], "little") % span + EMU_FIRST_TOKEN
               for i in range(0, 4 * self.OBSERVATION_IDS, 4)]
        return [*ids[:max(1, len(text) // 4)], EMU_TURN_MARK]


@dataclass
class Tools:
    pool: EnvPool
    chat: TurnCodec
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
    fit: Fit = byte_fit
    if isinstance(chat, ChatFormat):
        fit = tokenizer_fit(chat.tokenizer)
    elif spec.model == "emu":
        chat = EmuTurns()
    else:  # the spec needs a dataset with an env, but for the emulated model: never here
        raise RunAborted(f"env {spec.env!r} needs a dataset's tokenizer and chat format")
    pool = EnvPool(spec.env, dirs=cfg.reward_dirs, tool_s=spec.max_tool_s,
                   workers=cfg.tool_workers, max_turns=spec.max_turns,
                   max_observation_tokens=spec.max_observation_tokens, fit=fit,
                   registry=registry, pass_env=cfg.reward_env_names)
    try:
        await pool.start()
    except UserCodeError as exc:
        await pool.close()
        raise RunAborted(f"env {spec.env!r}: {exc}") from exc
    return Tools(pool, chat, spec)
