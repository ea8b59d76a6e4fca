"""Turns of agentic responses against a real redis-server: a model turn's final ``stop`` ends
the lease, not the response; the environment's answer is committed exactly once, appended as
an observation turn (the response pending again), or ends the response (done, the last turn
allowed, the budget); a copy of either, delivered again, changes nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import redis.asyncio as aioredis

from manager_svc.accounting import Ledger
from manager_svc.archive import Archive
from manager_svc.runs import RunStore
from manager_svc.turns import Turns
from rlboost.stack import Stack
from shared import names
from shared.bus import connect_redis
from shared.digest import sample_digest
from shared.names import Keys, request_id
from shared.protocol import FrameEntry, TokenFrame, ToolClaim, ToolResult
from shared.spec import RunSpec
from shared.turns import Turn, response_turns

BUDGET = 12  # max_new_tokens: observations count in it


@dataclass
class Parts:
    redis: aioredis.Redis
    ledger: Ledger
    turns: Turns
    run_id: str

    def rid(self, sample: int) -> str:
        return request_id(self.run_id, 0, 0, sample)


@pytest.fixture
async def parts(brokers: Stack, tmp_path: Path) -> AsyncIterator[Parts]:
    """A running run at step 0 of one prompt of three samples, up to 3 model turns each."""
    redis = await connect_redis(brokers.redis.url)
    await redis.flushdb()
    runs = RunStore(redis, Archive(tmp_path))
    run_id = (await runs.create(RunSpec(model="emu", samples_per_prompt=3,
                                        prompts_per_step=1)))["id"]
    ledger = Ledger(redis, lease_ttl_s=60.0)
    await ledger.create_step(run_id, 0, 0, [[1, 2]], 3, BUDGET, extra={"max_turns": 3})
    yield Parts(redis, ledger, Turns(redis), run_id)
    await redis.aclose()


async def model_turn(p: Parts, sample: int, offset: int, ids: list[int],
                     finish: str = "stop") -> list[str]:
    """Lease the response to i0 and commit ``ids`` at ``offset`` as its turn's last entry;
    the commit statuses of that frame, then of the same frame delivered again."""
    rid = p.rid(sample)
    lease = await p.ledger.assign(rid, "i0", 1.0, 0, 2)
    assert lease is not None
    frame = TokenFrame(instance_id="i0", entries=[FrameEntry.of(
        request_id=rid, epoch=lease.epoch, weight_version=0, offset=offset, token_ids=ids,
        final=True, finish_reason=finish)])  # type: ignore[arg-type]
    return [r.status for r in await p.ledger.commit(frame) + await p.ledger.commit(frame)]


def answer(rid: str, turn: int, ids: list[int], done: bool = False,
           reward: float | None = None) -> ToolResult:
    return ToolResult(request_id=rid, turn=turn, call_id=names.call_id(rid, turn),
                      observation_token_ids=ids, observation=f"obs {turn}", done=done,
                      reward=reward)


async def test_a_turn_waits_for_its_answer_which_is_committed_once(parts: Parts) -> None:
    p, rid = parts, parts.rid(0)
    step = Keys.step(p.run_id, 0)
    assert await model_turn(p, 0, 0, [5, 6, 7]) == ["tool", "duplicate"]
    # Leased to nobody, pending for nobody: it waits for the environment.
    assert await p.turns.awaiting(p.run_id, 0) == [rid]
    assert not await p.redis.sismember(Keys.pending(p.run_id, 0), rid)
    assert not await p.redis.sismember(Keys.leased(p.run_id, 0), rid)
    assert not await p.redis.exists(Keys.lease(rid))
    call = await p.turns.call(rid)
    assert call is not None
    assert (call.turn, call.call_id, call.response_token_ids, call.action_start) == (
        0, f"{rid}:0", [5, 6, 7], 0)
    first = await p.turns.answer(answer(rid, 0, [100, 101]))
    again = await p.turns.answer(answer(rid, 0, [100, 101]))  # a call run twice
    assert (first.status, first.n, again.status) == ("ok", 5, "duplicate")
    assert await p.redis.get(Keys.tokens(rid)) == "5,6,7,100,101"
    assert await p.redis.sismember(Keys.pending(p.run_id, 0), rid)
    assert await p.turns.call(rid) is None  # answered: nothing to ask
    stored = await p.redis.hget(Keys.request(rid), "obs")
    assert response_turns(stored, "5,6,7,100,101") == [
        Turn(role="model", start=0, end=3),
        Turn(role="observation", start=3, end=5, call_id=f"{rid}:0", observation="obs 0")]
    # The next model turn continues from the observation; the environment ends it.
    assert await model_turn(p, 0, 5, [8, 9]) == ["tool", "duplicate"]
    call = await p.turns.call(rid)
    assert call is not None and (call.turn, call.action_start) == (1, 5)
    done = await p.turns.answer(answer(rid, 1, [], done=True, reward=0.5))
    assert (done.status, done.n) == ("final", 7)
    assert (await p.turns.answer(answer(rid, 1, [], done=True))).status == "duplicate"
    req = await p.redis.hgetall(Keys.request(rid))
    assert (req["done"], req["finish"], req["env_reward"]) == ("1", "stop", "0.5")
    assert await p.redis.sismember(Keys.done(p.run_id, 0), rid)
    # The sample: its turns (the loss mask's source), the environment's reward, and the
    # barrier's digest of the stored text equal to the trainer's of the samples it gets.
    [sample] = await p.ledger.samples([rid])
    assert sample.response_token_ids == [5, 6, 7, 100, 101, 8, 9]
    assert [(t.role, t.start, t.end) for t in sample.turns] == [
        ("model", 0, 3), ("observation", 3, 5), ("model", 5, 7)]
    assert sample.env_reward == 0.5
    assert await p.ledger.done_digest(p.run_id, 0) == sample_digest(
        await p.ledger.done_samples(p.run_id, 0))
    single = sample_digest([msgspec.structs.replace(sample, turns=[])])
    assert single != sample_digest([sample])  # the turns are in it
    counted = await p.redis.hmget(step, "tool_calls_committed", "tokens_observed", "tokens",
                                  "duplicate_chunks_dropped", "stale_chunks_rejected")
    assert counted == ["2", "2", "5", "2", "0"]


async def test_the_last_turn_allowed_and_the_budget_end_a_response(parts: Parts) -> None:
    p = parts
    # Sample 1: three model turns, each answered; the third's answer ends it ("turns").
    rid, offset = p.rid(1), 0
    for turn in (0, 1, 2):
        assert (await model_turn(p, 1, offset, [5]))[0] == "tool"
        got = await p.turns.answer(answer(rid, turn, [100]))
        offset += 1 if turn == 2 else 2
        assert (got.status, got.n) == (("final", 5) if turn == 2 else ("ok", offset))
    assert await p.redis.hget(Keys.request(rid), "finish") == "turns"
    # Sample 2: an answer past the budget is cut to what fits, and the budget ends it.
    rid = p.rid(2)
    assert (await model_turn(p, 2, 0, [5] * 9))[0] == "tool"
    got = await p.turns.answer(answer(rid, 0, [100, 101, 102, 103, 104]))
    assert (got.status, got.n) == ("final", BUDGET)
    assert await p.redis.get(Keys.tokens(rid)) == "5,5,5,5,5,5,5,5,5,100,101,102"
    stored = await p.redis.hget(Keys.request(rid), "obs")
    assert response_turns(stored, await p.redis.get(Keys.tokens(rid))) == [
        Turn(role="model", start=0, end=9),
        Turn(role="observation", start=9, end=12, call_id=names.call_id(rid, 0),
             observation="obs 0")]
    assert await p.redis.hget(Keys.request(rid), "finish") == "length"
    # A model turn that ends at the budget ends the response; no environment is asked.
    assert await model_turn(p, 0, 0, [5] * BUDGET, finish="length") == ["step", "duplicate"]
    assert await p.turns.awaiting(p.run_id, 0) == []


async def test_a_single_turn_run_is_untouched(brokers: Stack, tmp_path: Path) -> None:
    """Without ``max_turns`` a final ``stop`` ends the response, as it always did."""
    redis = await connect_redis(brokers.redis.url)
    await redis.flushdb()
    try:
        runs = RunStore(redis, Archive(tmp_path))
        # (reinforce_pp: a group estimator refuses groups of one)
        run_id = (await runs.create(RunSpec(model="emu", algorithm="reinforce_pp",
                                            samples_per_prompt=1,
                                            prompts_per_step=1)))["id"]
        ledger = Ledger(redis, lease_ttl_s=60.0)
        await ledger.create_step(run_id, 0, 0, [[1, 2]], 1, BUDGET)
        p = Parts(redis, ledger, Turns(redis), run_id)
        assert await model_turn(p, 0, 0, [5, 6]) == ["step", "duplicate"]
        assert await redis.hget(Keys.request(p.rid(0)), "turn") is None
    finally:
        await redis.aclose()


async def test_calls_are_handed_out_once_per_claim_and_again_when_it_lapses(
        parts: Parts) -> None:
    """The tool pool's side: a claimed call is not handed out again while its claim lasts (a
    second worker gets the others), is handed out again once it lapses unanswered (its worker
    died: the same call id runs again), and never once answered."""
    p = parts
    for sample in (0, 1):
        assert (await model_turn(p, sample, 0, [5, 6]))[0] == "tool"
    first = await p.turns.on_claim(ToolClaim(run_id=p.run_id, step=0, limit=1, claim_s=0.3))
    second = await p.turns.on_claim(ToolClaim(run_id=p.run_id, step=0, limit=8, claim_s=0.3))
    assert len(first.calls) == len(second.calls) == 1
    assert {first.calls[0].request_id, second.calls[0].request_id} == {p.rid(0), p.rid(1)}
    assert not (await p.turns.on_claim(ToolClaim(run_id=p.run_id, step=0))).calls
    lost = first.calls[0]
    wrong = await p.turns.on_answer(ToolResult(
        request_id=lost.request_id, turn=lost.turn, call_id=names.call_id(p.rid(2), 0)))
    assert not wrong.ok and "call_id" in wrong.detail
    answered = await p.turns.on_answer(answer(second.calls[0].request_id, 0, [100]))
    assert (answered.ok, answered.detail) == (True, "ok")
    await asyncio.sleep(0.35)
    again = await p.turns.on_claim(ToolClaim(run_id=p.run_id, step=0))
    assert [(c.request_id, c.call_id) for c in again.calls] == [(lost.request_id, lost.call_id)]
    late = await p.turns.on_answer(answer(second.calls[0].request_id, 0, [100]))
    assert (late.ok, late.detail) == (True, "duplicate")
    never = await p.turns.on_answer(answer(p.rid(2), 0, [100]))  # no turn of it ended
    assert not never.ok and p.rid(2) in never.detail
