"""The exactly-once ledger against a real redis-server: commits, duplicates, fencing, barrier."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from manager_svc.accounting import READ_SLICE, Ledger
from rlboost.stack import Stack
from shared.bus import connect_redis
from shared.digest import sample_digest
from shared.names import Keys
from shared.protocol import FrameEntry, TokenFrame

RUN = "run-acc"


def chunk(rid: str, inst: str, epoch: int, offset: int, tokens: list[int], final: bool = False,
          version: int = 0) -> TokenFrame:
    """A frame with one entry: committed exactly as that response's entry in any frame."""
    return TokenFrame(instance_id=inst, entries=[FrameEntry.of(
        request_id=rid, epoch=epoch, weight_version=version, offset=offset, token_ids=tokens,
        final=final, finish_reason="stop" if final else None)])


async def outcome(ledger: Ledger, frame: TokenFrame) -> str:
    [result] = await ledger.commit(frame)
    return result.status


@pytest.fixture
async def ledger(brokers: Stack):
    redis = await connect_redis(brokers.redis.url)
    await redis.flushdb()
    led = Ledger(redis, lease_ttl_s=0.5)
    await led.create_step(RUN, 0, 0, [[1, 2], [3, 4]], samples=2, max_new_tokens=6)
    yield led
    await redis.aclose()


async def test_create_step_is_idempotent(ledger: Ledger) -> None:
    assert not await ledger.create_step(RUN, 0, 0, [[9]], samples=5, max_new_tokens=1)
    assert await ledger.r.scard(Keys.pending(RUN, 0)) == 4


async def test_commit_in_order_then_duplicates_are_dropped(ledger: Ledger) -> None:
    rid = f"{RUN}:0:0:0"
    a = await ledger.assign(rid, "i1", 1.0, 0, 2)
    assert a is not None and a.epoch == 1 and a.committed_token_ids == []
    assert await outcome(ledger, chunk(rid, "i1", 1, 0, [5, 6])) == "ok"
    # A redelivery of the same chunk changes nothing.
    assert await outcome(ledger, chunk(rid, "i1", 1, 0, [5, 6])) == "duplicate"
    assert await outcome(ledger, chunk(rid, "i1", 1, 2, [7, 2], final=True)) == "final"
    assert await outcome(ledger, chunk(rid, "i1", 1, 2, [7, 2], final=True)) == "duplicate"
    [sample] = await ledger.samples([rid])
    assert sample.response_token_ids == [5, 6, 7, 2]
    assert sample.instances == ["i1"]
    info = await ledger.r.hgetall(Keys.step(RUN, 0))
    assert int(info["tokens"]) == 4
    assert int(info["duplicate_chunks_dropped"]) == 2


async def test_each_kind_of_instance_records_when_it_first_and_last_generated(
        ledger: Ledger) -> None:
    """The seeding controller measures the reserved rate up to the reserved side's last token:
    a step whose late spot instances took the rest would read it many times too low over the
    whole rollout."""
    rids = [f"{RUN}:0:0:0", f"{RUN}:0:0:1"]
    leases = [await ledger.assign(r, i, 1.0, 0, 2) for r, i in zip(rids, ("r1", "s1"), strict=True)]
    assert leases[0] is not None and leases[1] is not None
    first = TokenFrame(instance_id="r1", kind="reserved", entries=chunk(
        rids[0], "r1", leases[0].epoch, 0, [5]).entries)
    assert await outcome(ledger, first) == "ok"
    info = await ledger.r.hgetall(Keys.step(RUN, 0))
    assert info["reserved_first_at"] == info["reserved_last_at"] and "spot_last_at" not in info
    await asyncio.sleep(0.02)
    assert await outcome(ledger, msgspec.structs.replace(first, entries=chunk(
        rids[0], "r1", leases[0].epoch, 1, [6]).entries)) == "ok"
    assert await outcome(ledger, chunk(rids[1], "s1", leases[1].epoch, 0, [7])) == "ok"
    after = await ledger.r.hgetall(Keys.step(RUN, 0))
    assert after["reserved_first_at"] == info["reserved_first_at"]
    assert float(after["reserved_last_at"]) > float(info["reserved_last_at"])
    assert float(after["spot_last_at"]) >= float(after["reserved_last_at"])
    assert int(after["tokens_reserved"]) == 2 and int(after["tokens_spot"]) == 1


async def test_stale_epoch_is_fenced_and_migration_resumes(ledger: Ledger) -> None:
    rid = f"{RUN}:0:1:0"
    first = await ledger.assign(rid, "i1", 1.0, 0, 2)
    assert first is not None
    assert await outcome(ledger, chunk(rid, "i1", first.epoch, 0, [5])) == "ok"
    assert await ledger.revoke(rid)
    second = await ledger.assign(rid, "i2", 1.0, 0, 2)
    assert second is not None and second.epoch == first.epoch + 2
    assert second.committed_token_ids == [5]
    # The old owner wakes up: every chunk it sends is rejected, whatever its offset.
    assert await outcome(ledger, chunk(rid, "i1", first.epoch, 1, [6])) == "stale"
    assert await outcome(ledger, chunk(rid, "i2", second.epoch, 1, [7, 2], True)) == "final"
    [sample] = await ledger.samples([rid])
    assert sample.response_token_ids == [5, 7, 2]
    assert sample.instances == ["i1", "i2"]
    info = await ledger.r.hgetall(Keys.step(RUN, 0))
    assert int(info["stale_chunks_rejected"]) == 1
    assert int(info["tokens_regenerated"]) == 1
    assert int(info["migrations"]) == 1


async def test_one_script_leases_many_and_skips_what_is_taken(ledger: Ledger) -> None:
    rids = [f"{RUN}:0:{p}:{s}" for p in range(2) for s in range(2)]
    taken = await ledger.assign(rids[1], "i1", 1.0, 0, 2)
    assert taken is not None
    assert await outcome(ledger, chunk(rids[1], "i1", taken.epoch, 0, [5])) == "ok"
    assert await ledger.revoke(rids[1])  # back to pending, its token kept: a migration next
    assert await ledger.assign(rids[2], "i3", 1.0, 0, 2) is not None  # another pass took it
    got = await ledger.assign_many(rids, "i2", 0.5, 9, 2)
    assert [a.request_id for a in got] == [rids[0], rids[1], rids[3]]
    by = {a.request_id: a for a in got}
    assert by[rids[1]].committed_token_ids == [5] and by[rids[1]].epoch == taken.epoch + 2
    assert by[rids[0]].epoch == 1 and by[rids[0]].prompt_token_ids == [1, 2]
    assert by[rids[3]].prompt_token_ids == [3, 4] and by[rids[3]].max_new_tokens == 6
    assert all(a.temperature == 0.5 and a.seed == 9 and a.weight_version == 0 for a in got)
    assert await ledger.r.smembers(Keys.held(RUN, "i2")) == set(by)
    assert await ledger.r.scard(Keys.pending(RUN, 0)) == 0
    assert await ledger.r.get(Keys.lease(rids[3])) == "i2:1"
    info = await ledger.r.hgetall(Keys.step(RUN, 0))
    assert int(info["migrations"]) == 1  # only the response with another's tokens moved
    # Every lease of the batch fences like a single one: the new owner's next offset commits.
    assert await outcome(ledger, chunk(rids[1], "i2", by[rids[1]].epoch, 1, [6])) == "ok"
    assert await ledger.assign_many(rids, "i4", 1.0, 0, 2) == []
    # One step per call: an id of another step would be leased against this step's sets.
    with pytest.raises(ValueError, match="one step"):
        await ledger.assign_many([rids[0], f"{RUN}:1:0:0"], "i4", 1.0, 0, 2)
    assert await ledger.r.scard(Keys.held(RUN, "i4")) == 0


async def test_a_plan_leases_to_many_instances_in_one_round_trip(ledger: Ledger) -> None:
    rids = [f"{RUN}:0:{p}:{s}" for p in range(2) for s in range(2)]
    assert await ledger.assign(rids[3], "i9", 1.0, 0, 2) is not None  # another pass took it
    plan = [("i1", rids[:2]), ("i2", []), ("i3", rids[2:])]
    got = await ledger.assign_plan(plan, 0.7, 5, 2)
    assert [[a.request_id for a in g] for g in got] == [rids[:2], [], [rids[2]]]
    assert await ledger.r.smembers(Keys.held(RUN, "i1")) == set(rids[:2])
    assert await ledger.r.smembers(Keys.held(RUN, "i3")) == {rids[2]}
    assert await ledger.r.get(Keys.lease(rids[2])) == "i3:1"
    assert all(a.temperature == 0.7 and a.seed == 5 for g in got for a in g)
    assert await ledger.r.scard(Keys.pending(RUN, 0)) == 0
    assert await ledger.assign_plan([("i4", []), ("i5", [])], 1.0, 0, 2) == [[], []]
    with pytest.raises(ValueError, match="one step"):
        await ledger.assign_plan([("i4", [rids[0], f"{RUN}:1:0:0"])], 1.0, 0, 2)


async def test_the_log_grows_by_the_new_tokens_not_the_whole_response(ledger: Ledger) -> None:
    """Redis logs a script by its effects: a response kept as one hash field rewritten per
    commit would grow the append-only file with the square of its length."""
    await ledger.create_step(RUN, 1, 0, [[1]], samples=1, max_new_tokens=4096)
    rid = f"{RUN}:1:0:0"
    a = await ledger.assign(rid, "i1", 1.0, 0, 2)
    assert a is not None
    chunks = [[10_000 + 16 * k + i for i in range(16)] for k in range(64)]
    before = int((await ledger.r.info("persistence"))["aof_current_size"])
    for k, toks in enumerate(chunks):
        assert await outcome(ledger, chunk(rid, "i1", a.epoch, 16 * k, toks)) == "ok"
    grown = int((await ledger.r.info("persistence"))["aof_current_size"]) - before
    text = ",".join(str(t) for c in chunks for t in c)
    # Measured: 30 KB for these 6.1 KB of tokens; rewriting a field each time logs ~215 KB.
    assert grown < 2 * len(text) + 64 * 500, (grown, len(text))
    assert await ledger.r.get(Keys.tokens(rid)) == text
    assert not await ledger.r.hexists(Keys.request(rid), "tokens")
    [sample] = await ledger.samples([rid])
    assert sample.response_token_ids == [t for c in chunks for t in c]


async def test_a_response_from_before_the_tokens_key_continues_exactly(ledger: Ledger) -> None:
    """A response committed by an older manager holds its tokens in its hash: an upgraded one
    resumes it from them and appends after them."""
    rid = f"{RUN}:0:1:1"
    a = await ledger.assign(rid, "i1", 1.0, 0, 2)
    assert a is not None
    assert await outcome(ledger, chunk(rid, "i1", a.epoch, 0, [5, 6])) == "ok"
    await ledger.r.delete(Keys.tokens(rid))  # as the older layout had it
    await ledger.r.hset(Keys.request(rid), "tokens", "5,6")
    assert [s.response_token_ids for s in await ledger.samples([rid])] == [[5, 6]]
    assert await ledger.revoke(rid)
    b = await ledger.assign(rid, "i2", 1.0, 0, 2)
    assert b is not None and b.committed_token_ids == [5, 6]
    assert await outcome(ledger, chunk(rid, "i2", b.epoch, 2, [7], final=True)) == "final"
    [sample] = await ledger.samples([rid])
    assert sample.response_token_ids == [5, 6, 7]
    assert not await ledger.r.hexists(Keys.request(rid), "tokens")


async def test_expired_lease_rejects_chunks(ledger: Ledger) -> None:
    rid = f"{RUN}:0:0:1"
    a = await ledger.assign(rid, "i1", 1.0, 0, 2)
    assert a is not None
    await asyncio.sleep(0.7)  # past the 0.5 s lease
    assert await outcome(ledger, chunk(rid, "i1", a.epoch, 0, [5])) == "stale"


async def test_gap_revokes_and_wrong_version_is_rejected(ledger: Ledger) -> None:
    rid = f"{RUN}:0:0:0"
    a = await ledger.assign(rid, "i1", 1.0, 0, 2)
    assert a is not None
    assert await outcome(ledger, chunk(rid, "i1", a.epoch, 3, [5])) == "gap"
    assert await ledger.r.sismember(Keys.pending(RUN, 0), rid)
    b = await ledger.assign(rid, "i1", 1.0, 0, 2)
    assert b is not None
    status = await outcome(ledger, chunk(rid, "i1", b.epoch, 0, [5], version=7))
    assert status == "wrong_version"
    [sample] = await ledger.samples([rid])
    assert sample.response_token_ids == []


async def test_overlong_response_is_refused(ledger: Ledger) -> None:
    rid = f"{RUN}:0:1:1"
    a = await ledger.assign(rid, "i1", 1.0, 0, 2)
    assert a is not None
    assert await outcome(ledger, chunk(rid, "i1", a.epoch, 0, [5] * 7)) == "overlong"


async def test_group_and_step_completion_fire_once(ledger: Ledger) -> None:
    statuses = []
    for p in range(2):
        for s in range(2):
            rid = f"{RUN}:0:{p}:{s}"
            a = await ledger.assign(rid, "i1", 1.0, 0, 2)
            assert a is not None
            statuses.append(await outcome(ledger, chunk(rid, "i1", a.epoch, 0, [2], True)))
    assert statuses == ["final", "group", "final", "step"]
    done = await ledger.done_samples(RUN, 0)
    assert [(s.prompt_index, s.sample_index) for s in done] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # A finished response cannot be assigned again.
    assert await ledger.assign(f"{RUN}:0:0:0", "i2", 1.0, 0, 2) is None


async def test_the_barrier_digest_is_the_trainers_digest(ledger: Ledger) -> None:
    """The barrier hashes the stored CSV text; the trainer hashes the samples it was served.
    Chunked, migrated and empty responses must give both the same digest."""
    plan = {(0, 0): [[5, 6], [7]], (0, 1): [[]], (1, 0): [[3], [4, 4]], (1, 1): [[9, 10, 11]]}
    for (p, s), chunks in plan.items():
        rid = f"{RUN}:0:{p}:{s}"
        inst, offset = "i1", 0
        a = await ledger.assign(rid, inst, 1.0, 0, 2)
        assert a is not None
        for i, tokens in enumerate(chunks):
            if (p, s) == (1, 0) and i == 1:  # migrated: the rest comes from another instance
                assert await ledger.revoke(rid)
                inst, a = "i2", await ledger.assign(rid, "i2", 1.0, 0, 2)
                assert a is not None and a.committed_token_ids == [3]
            last = i == len(chunks) - 1
            status = await outcome(ledger, chunk(rid, inst, a.epoch, offset, tokens, final=last))
            assert status in ("ok", "final", "group", "step"), status
            offset += len(tokens)
    done = await ledger.done_samples(RUN, 0)
    assert len(done) == 4
    digest = await ledger.done_digest(RUN, 0)
    assert digest == sample_digest(done)
    assert (digest.responses, digest.tokens) == (4, 9)
    # Another token anywhere is another digest.
    done[1].response_token_ids.append(2)
    assert sample_digest(done) != digest


async def test_samples_are_read_in_slices_and_kept_in_order(ledger: Ledger) -> None:
    prompts = [[p, p + 1] for p in range(READ_SLICE)]
    await ledger.create_step(RUN, 1, 0, prompts, samples=2, max_new_tokens=4)
    rids = [f"{RUN}:1:{p}:{s}" for p in range(READ_SLICE) for s in range(2)][::-1]
    samples = await ledger.samples(rids)
    assert [(x.prompt_index, x.sample_index) for x in samples] == \
        [(p, s) for p in range(READ_SLICE) for s in range(2)]
    assert all(x.prompt_token_ids == prompts[x.prompt_index] for x in samples)
    assert await ledger.samples([]) == []


async def test_expired_leases_are_those_nobody_renewed(ledger: Ledger) -> None:
    kept, lapsed = f"{RUN}:0:0:0", f"{RUN}:0:1:1"
    a = await ledger.assign(kept, "i1", 1.0, 0, 2)
    b = await ledger.assign(lapsed, "i2", 1.0, 0, 2)
    assert a is not None and b is not None
    assert await ledger.expired_leases(RUN, 0) == []
    for _ in range(4):  # past the 0.5 s TTL, renewing only one of them
        await asyncio.sleep(0.2)
        assert await ledger.renew_many("i1", [(kept, a.epoch, 0)]) == []
    assert await ledger.expired_leases(RUN, 0) == [lapsed]


async def test_stalled_leases_are_those_that_committed_nothing_for_the_bound(
        ledger: Ledger) -> None:
    """The progress check: a lease renewed by every heartbeat but committing nothing is
    stalled; a commit (or a fresh grant) restarts its clock; a complete or revoked response
    is no one's stalled lease."""
    moving, hung, done, taken = (f"{RUN}:0:0:0", f"{RUN}:0:0:1", f"{RUN}:0:1:0", f"{RUN}:0:1:1")
    leases = {rid: await ledger.assign(rid, inst, 1.0, 0, 2) for rid, inst in (
        (moving, "i1"), (hung, "i2"), (done, "i1"), (taken, "i2"))}
    epoch = {rid: lease.epoch for rid, lease in leases.items() if lease is not None}
    assert len(epoch) == 4
    assert await ledger.stalled_leases(RUN, 0, 0.25) == []  # just granted
    assert await outcome(ledger, chunk(done, "i1", epoch[done], 0, [5, 2], final=True)) == "final"
    assert await ledger.revoke(taken)
    for offset in range(3):  # 0.45 s: commits for one, heartbeats alone for the other
        await asyncio.sleep(0.15)
        assert await outcome(ledger, chunk(moving, "i1", epoch[moving], offset, [7])) == "ok"
        assert await ledger.renew_many("i1", [(moving, epoch[moving], 0)]) == []
        assert await ledger.renew_many("i2", [(hung, epoch[hung], 0)]) == []
    [(rid, owner, idle_s)] = await ledger.stalled_leases(RUN, 0, 0.25)
    assert (rid, owner) == (hung, "i2") and 0.4 <= idle_s < 2.0
    assert await ledger.stalled_leases(RUN, 0, 5.0) == []
    await asyncio.sleep(0.3)  # and now the committing one has been quiet too
    assert [r for r, _, _ in await ledger.stalled_leases(RUN, 0, 0.25)] == [moving, hung]


async def test_heartbeat_renews_only_leases_it_owns(ledger: Ledger) -> None:
    mine, theirs = f"{RUN}:0:0:0", f"{RUN}:0:0:1"
    a = await ledger.assign(mine, "i1", 1.0, 0, 2)
    b = await ledger.assign(theirs, "i2", 1.0, 0, 2)
    assert a is not None and b is not None
    await asyncio.sleep(0.3)
    lost = await ledger.renew_many("i1", [(mine, a.epoch, 3), (theirs, b.epoch, 0),
                                          (mine, a.epoch + 5, 0)])
    assert lost == [theirs, mine]  # not its lease; and a stale epoch of its own
    await asyncio.sleep(0.3)  # 0.6 s after assignment: only the renewed lease is alive
    assert await ledger.r.exists(Keys.lease(mine))
    assert not await ledger.r.exists(Keys.lease(theirs))
    assert await ledger.r.hget(Keys.request(mine), "seen") == "3"


async def test_concurrent_activation_never_loses_the_run(brokers: Stack, tmp_path: Path) -> None:
    """Handlers ask for the active run concurrently; exactly one run becomes active and stays."""
    from manager_svc.archive import Archive
    from manager_svc.runs import RunSpec, RunStore

    redis = await connect_redis(brokers.redis.url)
    await redis.flushdb()
    store = RunStore(redis, Archive(tmp_path))
    first = await store.create(RunSpec(steps=1))
    second = await store.create(RunSpec(steps=1))
    for _ in range(20):
        results = await asyncio.gather(*(store.active() for _ in range(16)))
        assert set(results) == {first["id"]}
    assert (await store.get(first["id"]) or {})["state"] == "running"
    assert (await store.get(second["id"]) or {})["state"] == "queued"
    await redis.aclose()


async def test_a_late_second_finish_of_a_step_records_nothing(brokers: Stack,
                                                              tmp_path: Path) -> None:
    """A finish whose Redis commands arrive after its retry recorded the step (the client
    timed out on a stalled link, the server ran them later) must not append a second record."""
    from manager_svc.archive import Archive
    from manager_svc.runs import RunSpec, RunStore

    redis = await connect_redis(brokers.redis.url)
    await redis.flushdb()
    store = RunStore(redis, Archive(tmp_path))
    run = await store.create(RunSpec(steps=2))
    assert await store.active() == run["id"]
    await store.finish_step(run["id"], 0, {"step": 0, "try": "retry"}, "[]", 2)
    await store.finish_step(run["id"], 0, {"step": 0, "try": "late"}, "[]", 2)  # the late one
    assert await store.step_records(run["id"]) == [{"step": 0, "try": "retry"}]
    assert (await store.get(run["id"]) or {})["step"] == 1
    archived = await store.archive.step(run["id"], 0)  # it keeps what Redis keeps
    assert archived is not None and '"retry"' in archived["record"]
    await store.finish_step(run["id"], 1, {"step": 1, "try": "only"}, "[]", 2)
    assert [r["step"] for r in await store.step_records(run["id"])] == [0, 1]
    assert (await store.get(run["id"]) or {})["state"] == "succeeded"
    await redis.aclose()


async def test_a_frame_checks_each_response_alone(ledger: Ledger) -> None:
    """One frame, one script call, yet each entry is fenced and ordered by its own response:
    a stale entry and a gap do not stop the frame's good entries, nor commit anything."""
    ok, stale, gap = f"{RUN}:0:0:0", f"{RUN}:0:0:1", f"{RUN}:0:1:0"
    a, b, c = [await ledger.assign(rid, "i1", 1.0, 0, 2) for rid in (ok, stale, gap)]
    assert a is not None and b is not None and c is not None
    assert await ledger.revoke(stale)

    def entry(rid: str, epoch: int, offset: int, tokens: list[int]) -> FrameEntry:
        return FrameEntry.of(request_id=rid, epoch=epoch, weight_version=0, offset=offset,
                             token_ids=tokens)
    frame = TokenFrame(instance_id="i1", entries=[
        entry(ok, a.epoch, 0, [5]), entry(stale, b.epoch, 0, [6]), entry(gap, c.epoch, 2, [7]),
        entry(ok, a.epoch, 1, [8, 9])])
    results = await ledger.commit(frame)
    assert [r.status for r in results] == ["ok", "stale", "gap", "ok"]
    assert [r.committed for r in results] == [1, 0, 0, 3]
    # Redelivered whole (a manager killed before its ack): every entry is a duplicate or stale.
    again = [r.status for r in await ledger.commit_many([frame, frame])]
    assert again == ["duplicate", "stale", "stale", "duplicate"] * 2
    samples = {s.request_id: s.response_token_ids for s in await ledger.samples([ok, stale, gap])}
    assert samples == {ok: [5, 8, 9], stale: [], gap: []}
