"""The trainer's side of agentic rollouts: answer a step's environment calls while it rolls out.

Contract (docs/agentic.md): while a step of a run with ``max_turns`` > 1 rolls out,
:meth:`ToolLoop.run` claims the step's awaited calls from the manager (``rlb.trainer.tools``;
each claimed for twice ``max_tool_s`` plus a margin, then handed out again if no answer came),
and for each: opens the response's episode on the :class:`~trainer_svc.inputs.tool_pool.EnvPool`
unless the pool holds it (a restarted trainer, or a worker killed for another call, reopens
it and hands the environment's ``restore`` the committed turns; the built-ins keep no state
between calls and have none), decodes the action from the turn's own ids (never re-tokenized), runs
the step, renders the observation between the turns (:meth:`ChatFormat.observation`, tokenized
once) and sends the answer (``rlb.trainer.answer``). The manager commits one answer per turn;
an answer it had already (``duplicate``: the call ran twice) counts as executed, not
committed. A failed call (the pool's outcome with an ``error``) ends the response, counted by
the pool. The loop ends when cancelled (the step's barrier came).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Protocol

from shared import names
from shared.errors import RlboostError
from shared.protocol import ToolCall, ToolClaim, ToolResult
from trainer_svc.inputs.tool_pool import EnvPool, Outcome
from trainer_svc.manager_client import ManagerClient
from trainer_svc.workload import StepPrompt

log = logging.getLogger("trainer")
CLAIM_MARGIN_S = 5.0  # past twice max_tool_s: a claim outlives a call that runs to its limit


class TurnCodec(Protocol):
    """Ids to an action's text, an observation's text to ids (ChatFormat, or the emu model's
    stand-in)."""

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def observation(self, text: str, turn_end: int) -> list[int]: ...


class ToolLoop:
    def __init__(self, manager: ManagerClient, pool: EnvPool, chat: TurnCodec, run_id: str,
                 step: int, prompts: Sequence[StepPrompt], seed: int, poll_s: float) -> None:
        self.manager = manager
        self.pool = pool
        self.chat = chat
        self.run_id, self.step = run_id, step
        self.prompts = prompts
        self.seed = seed
        self.poll_s = poll_s
        self.claim = ToolClaim(run_id=run_id, step=step, limit=max(1, 2 * pool.workers),
                               claim_s=2 * pool.tool_s + CLAIM_MARGIN_S)
        self._open: set[str] = set()  # episodes this process opened and has not ended
        self.answered = 0  # answers the manager committed
        self.repeated = 0  # answers it had already (the call ran again)

    async def run(self) -> None:
        while True:
            try:
                calls = await self.manager.claim_tools(self.claim)
            except RlboostError as exc:  # the manager restarts, a link is cut: ask again
                log.debug("claiming tool calls: %s", exc)
                calls = []
            if not calls:
                await asyncio.sleep(self.poll_s)
                continue
            await asyncio.gather(*(self._serve(call) for call in calls))

    async def _serve(self, call: ToolCall) -> None:
        rid = call.request_id
        out = await self._run(call)
        ids: list[int] = []
        if not out.done and out.observation is not None:
            ids = self.chat.observation(out.observation, call.response_token_ids[-1])
        result = ToolResult(request_id=rid, turn=call.turn, call_id=call.call_id,
                            observation_token_ids=ids, observation=out.observation or "",
                            done=out.done, reward=out.reward)
        try:
            ack = await self.manager.answer(result)
        except RlboostError as exc:  # its claim lapses and the call is handed out again
            log.info("answer to %s not acknowledged (%s): it will be asked again",
                     call.call_id, exc)
            return
        if not ack.ok:
            log.warning("answer to %s refused: %s", call.call_id, ack.detail)
        elif ack.detail == "duplicate":
            self.repeated += 1
        else:
            self.answered += 1
            self.pool.committed()
        if out.done:
            self._open.discard(rid)
            with contextlib.suppress(RlboostError):
                await self.pool.end(rid)

    async def _run(self, call: ToolCall) -> Outcome:
        rid = call.request_id
        if not self.pool.holds(rid):
            _, _, prompt_index, _ = names.parse_request_id(rid)
            prompt = self.prompts[prompt_index]
            failed = await self.pool.open(rid, prompt.prompt, prompt.answer, self.seed)
            if failed is None and call.history:  # reopened mid-episode: its state is rebuilt
                failed = await self.pool.restore(rid, call.turn, self.history(call))
            if failed is not None:
                return failed
            self._open.add(rid)
        action = self.chat.decode(call.response_token_ids[call.action_start:])
        return await self.pool.step(rid, call.turn, action)

    def history(self, call: ToolCall) -> list[dict[str, str]]:
        """The committed turns before ``call``'s, as an environment's ``restore`` takes them:
        each model turn's action (decoded from its ids, as its call saw it) and the
        observation that answered it."""
        out: list[dict[str, str]] = []
        action = ""
        for t in call.history:
            if t.role == "model":
                action = self.chat.decode(call.response_token_ids[t.start:t.end])
            else:
                out.append({"call_id": t.call_id, "action": action,
                            "observation": t.observation})
        return out

    async def close(self) -> None:
        """End every episode still open (the step is over)."""
        for rid in sorted(self._open):
            with contextlib.suppress(RlboostError):
                await self.pool.end(rid)
        self._open.clear()
