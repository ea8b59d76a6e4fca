"""Dynamic sampling's step changes against a real redis-server: extend, close, exactly once.

A dynamic step is not complete when every response it has is (its hold keeps ``remaining`` above
zero); an extension adds responses once however often it is sent; a close keeps exactly the
named groups, aborts what is in flight (fencing its owner's later chunks, which count as
discarded), counts tokens, and is applied once. A manager killed between the scripts' calls is
the same as a lost reply: the retry finds the change applied or not, never half.
"""

from __future__ import annotations

import pytest

from manager_svc.accounting import Ledger, StepRefused
from rlboost.stack import Stack
from shared.bus import connect_redis
from shared.digest import sample_digest
from shared.names import Keys
from tests.integration.test_accounting import chunk, outcome

RUN = "run-dyn"
SAMPLES = 2


@pytest.fixture
async def ledger(brokers: Stack):
    redis = await connect_redis(brokers.redis.url)
    await redis.flushdb()
    led = Ledger(redis, lease_ttl_s=5.0)
    await led.create_step(RUN, 0, 0, [[1, 2], [3, 4]], samples=SAMPLES, max_new_tokens=6,
                          extra={"dynamic": 1})
    yield led
    await redis.aclose()


async def complete(ledger: Ledger, rid: str, tokens: list[int], inst: str = "i1") -> str:
    a = await ledger.assign(rid, inst, 1.0, 0, 2)
    assert a is not None
    return await outcome(ledger, chunk(rid, inst, a.epoch, 0, tokens, final=True))


async def test_a_complete_dynamic_step_waits_for_its_close(ledger: Ledger) -> None:
    statuses = [await complete(ledger, f"{RUN}:0:{p}:{s}", [5, 2])
                for p in range(2) for s in range(SAMPLES)]
    # Groups complete as usual; the step does not: the trainer has not decided yet.
    assert statuses == ["final", "group", "final", "group"]
    info = await ledger.r.hgetall(Keys.step(RUN, 0))
    assert int(info["remaining"]) == 1 and int(info["prompts"]) == 2


async def test_extend_adds_responses_once(ledger: Ledger) -> None:
    assert await ledger.extend_step(RUN, 0, 2, [[7, 8], [9]], SAMPLES, 6, max_prompts=8) == 4
    # A retry after a lost reply: applied already, nothing changes.
    assert await ledger.extend_step(RUN, 0, 2, [[7, 8], [9]], SAMPLES, 6, max_prompts=8) == 4
    assert await ledger.r.scard(Keys.pending(RUN, 0)) == 8
    info = await ledger.r.hgetall(Keys.step(RUN, 0))
    assert (int(info["total"]), int(info["remaining"]), info["g:3"]) == (8, 9, str(SAMPLES))
    a = await ledger.assign(f"{RUN}:0:3:1", "i1", 1.0, 0, 2)
    assert a is not None and a.prompt_token_ids == [9] and a.max_new_tokens == 6
    with pytest.raises(StepRefused):  # a first index past the step's prompt count
        await ledger.extend_step(RUN, 0, 5, [[1]], SAMPLES, 6, max_prompts=8)
    with pytest.raises(StepRefused):  # past max_gen_batches
        await ledger.extend_step(RUN, 0, 4, [[1]] * 5, SAMPLES, 6, max_prompts=8)
    assert await ledger.r.scard(Keys.pending(RUN, 0)) == 7  # and the one leased above


async def test_close_keeps_the_named_groups_and_aborts_the_rest(ledger: Ledger) -> None:
    await ledger.extend_step(RUN, 0, 2, [[7, 8], [9]], SAMPLES, 6, max_prompts=8)
    for s in range(SAMPLES):  # group 0 informative, group 1 all equal, group 2 surplus
        await complete(ledger, f"{RUN}:0:0:{s}", [5 + s, 2])
        await complete(ledger, f"{RUN}:0:1:{s}", [6, 6, 2])
        await complete(ledger, f"{RUN}:0:2:{s}", [7, 2])
    # Group 3: one response in flight with 3 tokens committed, one never leased.
    flight = f"{RUN}:0:3:0"
    a = await ledger.assign(flight, "i2", 1.0, 0, 2)
    assert a is not None
    assert await outcome(ledger, chunk(flight, "i2", a.epoch, 0, [1, 1, 1])) == "ok"
    with pytest.raises(StepRefused):  # a kept group must be complete
        await ledger.close_step(RUN, 0, keep=[0, 3], filtered=[1], capped=False)
    discarded, aborted = await ledger.close_step(RUN, 0, keep=[0], filtered=[1], capped=False)
    assert aborted == [("i2", flight)]
    # Surplus group 2 (2 x 2 tokens) and the 3 committed tokens in flight are discarded; the
    # all-equal group's 2 x 3 tokens are filtered.
    assert discarded == 2 * 2 + 3
    info = await ledger.r.hgetall(Keys.step(RUN, 0))
    assert int(info["tokens_discarded"]) == 7 and int(info["tokens_filtered"]) == 6
    assert (info["groups_kept"], info["groups_filtered"], info["groups_discarded"]) == \
        ("1", "1", "2")
    assert int(info["remaining"]) == 0 and info["responses_aborted"] == "2"
    done = await ledger.done_samples(RUN, 0)
    assert {(s.prompt_index, s.sample_index) for s in done} == {(0, 0), (0, 1)}
    assert sample_digest(done).tokens == 4
    # The aborted owner's late chunk is fenced, and counted as discarded, not committed.
    [late] = await ledger.commit(chunk(flight, "i2", a.epoch, 3, [4, 2], final=True))
    assert late.status == "aborted"
    assert int(await ledger.r.hget(Keys.step(RUN, 0), "tokens_discarded")) == 9
    assert await ledger.assign(f"{RUN}:0:3:1", "i1", 1.0, 0, 2) is None
    assert not await ledger.r.smembers(Keys.held(RUN, "i2"))
    # A retry of the close (lost reply, restarted manager) changes nothing.
    assert await ledger.close_step(RUN, 0, keep=[0], filtered=[1], capped=False) == (0, [])
    assert await ledger.r.scard(Keys.dropped(RUN, 0)) == 6
    with pytest.raises(StepRefused):  # nothing extends a closed step
        await ledger.extend_step(RUN, 0, 4, [[1]], SAMPLES, 6, max_prompts=8)


async def test_a_step_without_dynamic_sampling_refuses_both(ledger: Ledger) -> None:
    await ledger.create_step(RUN, 1, 1, [[1]], samples=1, max_new_tokens=2)
    with pytest.raises(StepRefused):
        await ledger.extend_step(RUN, 1, 1, [[2]], 1, 2, max_prompts=4)
    with pytest.raises(StepRefused):
        await ledger.close_step(RUN, 1, keep=[], filtered=[], capped=False)
    assert int(await ledger.r.hget(Keys.step(RUN, 1), "remaining")) == 1
