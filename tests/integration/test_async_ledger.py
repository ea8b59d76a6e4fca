"""An asynchronous run's leases against a real redis-server: each lease is of its instance's
weight version, the commit accepts that version alone, and a response records which version
made which of its tokens (a partial rollout across versions), leases that committed nothing
left out. A synchronous run's leases are unchanged: the step's version, no runs recorded."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import pytest

from manager_svc.accounting import Ledger
from manager_svc.dispatcher import ActiveStep
from rlboost.stack import Stack
from shared.bus import connect_redis
from shared.digest import sample_digest
from shared.protocol import Assignment, FrameEntry, TokenFrame

RUN = "run-async"


@pytest.fixture
async def ledger(brokers: Stack) -> AsyncIterator[Ledger]:
    redis = await connect_redis(brokers.redis.url)
    await redis.flushdb()
    led = Ledger(redis, lease_ttl_s=60.0)
    # Step 0 synchronous; step 3 of a staleness-2 run: tokens of versions 1..3 may train.
    await led.create_step(RUN, 0, 0, [[1, 2]], 1, 12)
    await led.create_step(RUN, 3, 1, [[1, 2]], 1, 12, extra={"staleness": 2})
    yield led
    await redis.aclose()


async def lease(led: Ledger, rid: str, instance: str, version: int | None) -> Assignment:
    [got] = await led.assign_plan([(instance, [rid])], 1.0, 0, 2,
                                  None if version is None else {instance: version})
    assert len(got) == 1
    return got[0]


async def commit(led: Ledger, a: Assignment, instance: str, offset: int, tokens: list[int],
                 version: int, final: bool = False) -> str:
    [got] = await led.commit(TokenFrame(instance_id=instance, entries=[FrameEntry.of(
        request_id=a.request_id, epoch=a.epoch, weight_version=version, offset=offset,
        token_ids=tokens, final=final, finish_reason="stop" if final else None)]))
    return got.status


async def test_a_response_records_the_version_of_each_run_of_tokens(ledger: Ledger) -> None:
    rid = f"{RUN}:3:0:0"
    first = await lease(ledger, rid, "i1", 1)
    assert first.weight_version == 1  # the instance's version, not the step's
    assert await commit(ledger, first, "i1", 0, [5, 6], 1) == "ok"
    assert await ledger.revoke(rid)  # the instance went to load version 2
    # Leased at version 2 and taken back before it committed anything: no run recorded.
    idle = await lease(ledger, rid, "i2", 2)
    assert await ledger.revoke(rid)
    assert idle.committed_token_ids == [5, 6]
    second = await lease(ledger, rid, "i3", 3)
    assert second.weight_version == 3 and second.committed_token_ids == [5, 6]
    # Its entries must be of the lease's version: another one is refused (and revoked).
    assert await commit(ledger, second, "i3", 2, [7], 2) == "wrong_version"
    third = await lease(ledger, rid, "i3", 3)
    assert await commit(ledger, third, "i3", 2, [7, 2], 3, final=True) == "step"
    [sample] = await ledger.samples([rid])
    assert sample.response_token_ids == [5, 6, 7, 2]
    assert sample.token_versions == [[0, 1], [2, 3]]
    assert sample.weight_version == 3
    # The barrier's digest, from what Redis holds, is the trainer's over this sample, and it
    # covers the versions: the same tokens all of version 3 are other training data.
    digest = await ledger.done_digest(RUN, 3)
    assert digest == sample_digest([sample])
    assert digest != sample_digest([msgspec.structs.replace(sample, token_versions=[])])
    assert digest != sample_digest([msgspec.structs.replace(sample,
                                                            token_versions=[[0, 2], [2, 3]])])


async def test_a_synchronous_step_leases_at_its_own_version(ledger: Ledger) -> None:
    rid = f"{RUN}:0:0:0"
    a = await lease(ledger, rid, "i1", None)
    assert a.weight_version == 0
    assert await commit(ledger, a, "i1", 0, [5, 2], 0, final=True) == "step"
    [sample] = await ledger.samples([rid])
    assert sample.token_versions == [] and sample.weight_version == 0
    assert await ledger.done_digest(RUN, 0) == sample_digest([sample])


def test_which_versions_serve_a_step() -> None:
    def instance(version: int) -> dict[str, object]:
        return {"weight_version": version}

    sync = ActiveStep(RUN, 4, {"version": "4"})
    assert [v for v in range(7) if sync.serves(instance(v))] == [4]
    ahead = ActiveStep(RUN, 4, {"version": "2", "staleness": "2"})
    # From the oldest version its tokens may come from to the step's own: never newer (a
    # version past the step would be trained on at an earlier step than it was made for).
    assert [v for v in range(7) if ahead.serves(instance(v))] == [2, 3, 4]
