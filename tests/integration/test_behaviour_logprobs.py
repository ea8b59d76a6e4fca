"""Behaviour log-probs against a real redis-server: committed with their tokens exactly once
(a redelivered or fenced entry adds none, a migrated response continues them), unknown where
any entry carried none, zero under an agentic response's observation tokens; an entry whose
log-probs break the contract is dropped alone, and its MAC covers them."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import msgspec
import pytest

from manager_svc.accounting import Ledger
from manager_svc.archive import Archive
from manager_svc.chunk_auth import invalid, label
from manager_svc.runs import RunStore
from manager_svc.turns import Turns
from rlboost.stack import Stack
from shared import names
from shared.bus import connect_redis
from shared.mac import entry_mac
from shared.names import Keys, request_id
from shared.protocol import FrameEntry, TokenFrame, ToolResult, pack_logprobs, unpack_logprobs
from shared.spec import RunSpec


def f32(values: Sequence[float]) -> list[float]:
    """``values`` as float32 rounds them (what travels and is stored)."""
    return unpack_logprobs(pack_logprobs(values))


def frame(rid: str, inst: str, epoch: int, offset: int, tokens: list[int],
          logprobs: Sequence[float] = (), final: bool = False) -> TokenFrame:
    return TokenFrame(instance_id=inst, entries=[FrameEntry.of(
        request_id=rid, epoch=epoch, weight_version=0, offset=offset, token_ids=tokens,
        final=final, finish_reason="stop" if final else None, logprobs=logprobs)])


async def status(ledger: Ledger, f: TokenFrame) -> str:
    [got] = await ledger.commit(f)
    return got.status


@pytest.fixture
async def ledger(brokers: Stack, tmp_path: Path) -> AsyncIterator[tuple[Ledger, str]]:
    redis = await connect_redis(brokers.redis.url)
    await redis.flushdb()
    run_id = (await RunStore(redis, Archive(tmp_path)).create(
        RunSpec(model="emu", samples_per_prompt=2, prompts_per_step=1)))["id"]
    led = Ledger(redis, lease_ttl_s=60.0)
    await led.create_step(run_id, 0, 0, [[1, 2]], 2, 12)
    await led.create_step(run_id, 1, 0, [[1, 2]], 1, 12, extra={"max_turns": 3})
    yield led, run_id
    await redis.aclose()


async def test_logprobs_commit_once_with_their_tokens_across_a_migration(
        ledger: tuple[Ledger, str]) -> None:
    led, run_id = ledger
    rid = request_id(run_id, 0, 0, 0)
    first = await led.assign(rid, "i1", 1.0, 0, 2)
    assert first is not None
    assert await status(led, frame(rid, "i1", first.epoch, 0, [5, 6], [-0.5, -1.25])) == "ok"
    # Delivered again: nothing is appended twice.
    assert await status(led, frame(rid, "i1", first.epoch, 0, [5, 6], [-0.5, -1.25])) == (
        "duplicate")
    assert await led.revoke(rid)
    second = await led.assign(rid, "i2", 1.0, 0, 2)
    assert second is not None
    # The old owner's late entry is fenced, its log-probs with it.
    assert await status(led, frame(rid, "i1", first.epoch, 2, [9], [-7.0])) == "stale"
    assert await status(led, frame(rid, "i2", second.epoch, 2, [7, 3], [-0.1, -2.0e-7],
                                   final=True)) == "final"
    [sample] = await led.samples([rid])
    assert sample.response_token_ids == [5, 6, 7, 3]
    assert sample.behaviour_logprobs == f32([-0.5, -1.25, -0.1, -2.0e-7])


async def test_one_entry_without_logprobs_makes_the_response_unknown(
        ledger: tuple[Ledger, str]) -> None:
    led, run_id = ledger
    rid = request_id(run_id, 0, 0, 1)
    lease = await led.assign(rid, "i1", 1.0, 0, 2)
    assert lease is not None
    assert await status(led, frame(rid, "i1", lease.epoch, 0, [5], [-0.5])) == "ok"
    assert await status(led, frame(rid, "i1", lease.epoch, 1, [6])) == "ok"  # an engine gave none
    assert await status(led, frame(rid, "i1", lease.epoch, 2, [7], [-0.5], final=True)) == (
        "final")
    [sample] = await led.samples([rid])
    assert sample.response_token_ids == [5, 6, 7] and sample.behaviour_logprobs == []


async def test_observation_tokens_get_zero_logprobs(ledger: tuple[Ledger, str]) -> None:
    led, run_id = ledger
    rid = request_id(run_id, 1, 0, 0)  # step 1 is agentic
    turns = Turns(led.r)
    lease = await led.assign(rid, "i1", 1.0, 0, 2)
    assert lease is not None
    assert await status(led, frame(rid, "i1", lease.epoch, 0, [5, 6], [-0.5, -0.25],
                                   final=True)) == "tool"
    got = await turns.answer(ToolResult(request_id=rid, turn=0, call_id=names.call_id(rid, 0),
                                        observation_token_ids=[8, 9, 10], observation="obs"))
    assert got.status == "ok"
    lease = await led.assign(rid, "i2", 1.0, 0, 2)
    assert lease is not None
    assert await status(led, frame(rid, "i2", lease.epoch, 5, [4], [-3.0], final=True)) == (
        "tool")
    done = await turns.answer(ToolResult(request_id=rid, turn=1, call_id=names.call_id(rid, 1),
                                         done=True, reward=1.0))
    assert done.status == "step"  # its step's only response
    [sample] = await led.samples([rid])
    assert sample.response_token_ids == [5, 6, 8, 9, 10, 4]
    assert sample.behaviour_logprobs == f32([-0.5, -0.25, 0.0, 0.0, 0.0, -3.0])
    assert sample.loss_mask == [1, 1, 0, 0, 0, 1]
    # Dropping the response drops its log-probs too.
    assert Keys.logprobs(rid) in Keys.response(rid)


def test_logprobs_outside_the_contract_are_invalid() -> None:
    def entry(logprobs: bytes, tokens: Sequence[int] = (5, 6)) -> FrameEntry:
        e = FrameEntry.of(request_id="r:0:0:0", epoch=1, weight_version=0, offset=0,
                          token_ids=tokens)
        return msgspec.structs.replace(e, logprobs=logprobs)

    assert invalid(entry(pack_logprobs([-1.0, -0.5])), 100, [5, 6]) is None
    assert invalid(entry(b""), 100, [5, 6]) is None
    bad = {
        "short": pack_logprobs([-1.0]),
        "not whole": pack_logprobs([-1.0, -0.5])[:7],
        "nan": pack_logprobs([math.nan, -0.5]),
        "inf": pack_logprobs([-math.inf, -0.5]),
        "positive": pack_logprobs([0.5, -0.5]),
        "below the floor": pack_logprobs([-2e4, -0.5]),
    }
    for what, data in bad.items():
        why = invalid(entry(data), 100, [5, 6])
        assert why is not None and label(why) == "logprobs", what


def test_the_mac_covers_the_logprobs() -> None:
    key = "ab" * 32
    with_lp = FrameEntry.of(request_id="r:0:0:0", epoch=1, weight_version=0, offset=0,
                            token_ids=[5, 6], logprobs=[-1.0, -0.5])
    mac = entry_mac(key, "i1", with_lp)
    changed = msgspec.structs.replace(with_lp, logprobs=pack_logprobs([-1.0, -0.25]))
    assert entry_mac(key, "i1", changed) != mac
    # The same bytes split differently (ids then none, or half ids half log-probs) differ too.
    joined = msgspec.structs.replace(with_lp, tokens=with_lp.tokens + with_lp.logprobs,
                                     logprobs=b"")
    assert entry_mac(key, "i1", joined) != mac
