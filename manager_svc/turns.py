"""Turns of agentic responses: a model turn's end, the environment's answer, exactly once.

Contract (docs/agentic.md): in a run whose step has ``max_turns`` > 1, the commit script ends a
model turn, not the response, at a final entry whose finish is ``stop``: the lease ends with
the turn and the response moves to the step's tool set (``Keys.tooling``), leased to nobody,
its status ``tool``. :meth:`Turns.call` makes the :class:`~shared.protocol.ToolCall` that asks
the tool pool for the answer; :meth:`Turns.answer` commits the pool's
:class:`~shared.protocol.ToolResult` with one script (``lua/turn.lua``): the observation's ids
are appended to the response and it is pending again (whoever is leased it next continues
from them), or the response ends (the environment said done: ``stop``; the last model turn
allowed: ``turns``; the budget: ``length``) and counts toward its group and the barrier as a
final commit does. A second answer to a turn (a call run again after its worker died, a
result delivered twice) changes nothing: ``duplicate``. So a call may run more than once
(at-least-once, deduplicated by its ``call_id``) and is committed once; the step counts
``tool_calls_committed`` and ``tokens_observed``.

The tool pool (trainer side, trusted) pulls: ``rlb.trainer.tools`` claims a step's awaited
calls (:meth:`Turns.on_claim`, ``lua/claim_calls.lua``: each held ``claim_s``, then handed out
again if no answer came), ``rlb.trainer.answer`` commits one answer (:meth:`Turns.on_answer`)
and announces what it completed, as ingest does for tokens. The state is Redis's alone; no
new stream or permission: the trainer's credential already speaks ``rlb.trainer.*``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from manager_svc.announce import Announcer, Tally
from manager_svc.scripts import register
from manager_svc.soft_state import SoftState
from shared import names
from shared.digest import token_csv
from shared.names import Keys
from shared.protocol import Ack, ToolCall, ToolCalls, ToolClaim, ToolResult
from shared.turns import response_turns

log = logging.getLogger("manager")

# Text of an observation kept with its turn (the ids are what trains; the text is for people
# and for a tool that dedupes by looking): longer is cut here, not refused.
OBSERVATION_TEXT_MAX = 4096


@dataclass(frozen=True, slots=True)
class Answered:
    status: str  # ok | final | group | step | duplicate | unknown
    n: int  # the response's committed length after it


class Turns:
    def __init__(self, redis: aioredis.Redis, announcer: Announcer | None = None,
                 soft: SoftState | None = None) -> None:
        self.r = redis
        self.announcer = announcer  # tells the trainer of the groups and steps answers end
        self.soft = soft  # woken when a response is pending again
        self._answer = register(redis, "turn.lua")
        self._claim = register(redis, "claim_calls.lua")
        base = Keys.step("r", 0)
        self._suffixes = [k.removeprefix(base) for k in (
            Keys.tooling("r", 0), Keys.pending("r", 0), Keys.done("r", 0))]

    async def awaiting(self, run_id: str, step: int) -> list[str]:
        """The step's responses whose environment's answer is awaited."""
        return sorted(await self.r.smembers(Keys.tooling(run_id, step)))

    async def call(self, request_id: str) -> ToolCall | None:
        """The call that asks for the answer to ``request_id``'s last model turn; None if it
        awaits none (answered meanwhile, or its step is gone)."""
        return (await self.calls([request_id]))[0]

    async def calls(self, request_ids: list[str]) -> list[ToolCall | None]:
        """:meth:`call` of each of ``request_ids``, in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for rid in request_ids:
            run_id, step, _, _ = names.parse_request_id(rid)
            pipe.sismember(Keys.tooling(run_id, step), rid)
            pipe.hmget(Keys.request(rid), "turn", "obs")
            pipe.get(Keys.tokens(rid))
        got = await pipe.execute() if request_ids else []
        out: list[ToolCall | None] = []
        for i, rid in enumerate(request_ids):
            waiting, (turn, stored), tokens = got[3 * i:3 * i + 3]
            if not waiting or turn is None:
                out.append(None)
                continue
            turns = response_turns(stored, tokens or "")
            observed = [t for t in turns if t.role == "observation"]
            start = observed[-1].end if observed else 0
            # The scripts count ended model turns (1 after the first); a call names its turn
            # 0-based, as the environment's call ids do.
            out.append(ToolCall(
                request_id=rid, turn=int(turn) - 1, call_id=names.call_id(rid, int(turn) - 1),
                response_token_ids=[int(t) for t in str(tokens or "").split(",") if t],
                action_start=start, history=[t for t in turns if t.end <= start]))
        return out

    async def answer(self, result: ToolResult) -> Answered:
        """Commit ``result`` once (``lua/turn.lua``)."""
        run_id, step, _, _ = names.parse_request_id(result.request_id)
        reward = "" if result.reward is None else repr(float(result.reward))
        got = await self._answer(keys=[Keys.run(run_id)], args=[
            time.time(), Keys.step(run_id, step), *self._suffixes, result.request_id,
            result.turn + 1, token_csv(result.observation_token_ids),
            len(result.observation_token_ids), result.call_id,
            result.observation[:OBSERVATION_TEXT_MAX], "1" if result.done else "0", reward])
        status, n = str(got).split(" ")
        return Answered(status, int(n))

    async def on_claim(self, claim: ToolClaim) -> ToolCalls:
        """Up to ``claim.limit`` of the step's awaited calls no worker holds, each now held
        ``claim.claim_s``."""
        rids = await self._claim(keys=[Keys.run(claim.run_id)], args=[
            int(time.time() * 1000), Keys.tooling(claim.run_id, claim.step),
            int(claim.claim_s * 1000), claim.limit])
        calls = await self.calls([str(rid) for rid in rids])
        return ToolCalls(calls=[c for c in calls if c is not None])

    async def on_answer(self, result: ToolResult) -> Ack:
        """Commit one answer; the reply's detail is its status (``duplicate``: answered
        before, nothing changed)."""
        if result.call_id != names.call_id(result.request_id, result.turn):
            return Ack(ok=False, detail="call_id does not name this request's turn")
        got = await self.answer(result)
        if got.status == "unknown":
            return Ack(ok=False, detail=f"no response {result.request_id} awaits an answer")
        run_id, step, prompt, _ = names.parse_request_id(result.request_id)
        if got.status == "ok" and self.soft is not None:
            self.soft.wake.set()  # pending again: dispatch leases it
        if got.status in ("final", "group", "step") and self.announcer is not None:
            t = Tally()
            if got.status == "final":
                t.finished.append(result.request_id)
            else:
                t.ended.append((run_id, step, prompt))
                if got.status == "step":
                    t.steps.append((run_id, step))
            await self.announcer.announce(t)
        return Ack(detail=got.status)
