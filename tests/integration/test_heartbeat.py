"""A heartbeat against a real redis-server: one script registers it, answers the run to serve,
renews the instance's own leases of that run, drops the rest and records its events once; and
an instance whose registration and leases lapse together is reaped as a preemption."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from pydantic import SecretStr

from manager_svc.accounting import Ledger
from manager_svc.crash import CrashPoints
from manager_svc.dispatcher import Dispatcher
from manager_svc.registry import Registry, assign_subjects
from rlboost.stack import Stack
from shared import names
from shared.identity import new_account_seed, new_user_seed, public_key
from shared.names import Keys, request_id
from shared.protocol import Assignment, Heartbeat, HeartbeatReply, Held, Refused, Release, Target
from tests.support.registry import registry_with_run

LEASE_TTL_S = 0.6


@pytest.fixture
async def parts(brokers: Stack, tmp_path: Path) -> AsyncIterator[tuple[Registry, str]]:
    """A registry on a flushed Redis, with one running run at step 0 of four responses."""
    async with registry_with_run(brokers, tmp_path, LEASE_TTL_S) as got:
        yield got


def beat(held: list[Held], version: int | None = 0, run_id: str | None = None,
         session: str = "s1") -> Heartbeat:
    return Heartbeat(instance_id="i1", kind="spot", engine="emu", state="ready", run_id=run_id,
                     weight_version=version, held=held, capacity=2, session=session)


async def leased_to_i1_and_i2(ledger: Ledger, run_id: str
                              ) -> tuple[tuple[str, Assignment], tuple[str, Assignment]]:
    """Two responses of step 0, the first leased to i1 and the second to i2."""
    out = []
    for sample, instance in ((0, "i1"), (1, "i2")):
        rid = request_id(run_id, 0, 0, sample)
        lease = await ledger.assign(rid, instance, 1.0, 0, 2)
        assert lease is not None
        out.append((rid, lease))
    return out[0], out[1]


async def test_a_beat_renews_its_own_leases_and_drops_the_rest(
        parts: tuple[Registry, str]) -> None:
    registry, run_id = parts
    ledger = registry.ledger
    (mine, a), (theirs, _) = await leased_to_i1_and_i2(ledger, run_id)
    other_run = request_id("run-gone", 3, 0, 0)  # still leased to it, but of another run
    await ledger.r.set(Keys.lease(other_run), "i1:1")
    reply = await registry.on_heartbeat(beat([
        Held(request_id=mine, epoch=a.epoch, buffered=5), Held(request_id=theirs, epoch=1),
        Held(request_id=other_run, epoch=1)], run_id=run_id))
    assert reply.target == Target(run_id=run_id, weight_version=0)
    assert sorted(reply.revoke) == sorted([theirs, other_run])
    assert await ledger.r.hget(Keys.request(mine), "seen") == "5"
    # Renewed on every beat, the lease outlives its TTL; the other instance's lapses.
    for _ in range(4):
        await asyncio.sleep(LEASE_TTL_S / 3)
        await registry.on_heartbeat(beat([Held(request_id=mine, epoch=a.epoch)],
                                         run_id=run_id))
    assert await ledger.r.exists(Keys.lease(mine))
    assert not await ledger.r.exists(Keys.lease(theirs))
    [me] = [i for i in await registry.instances() if i["id"] == "i1"]
    assert (me["held"], me["weight_version"], me["state"]) == (1, 0, "ready")


async def test_join_and_each_new_version_are_recorded_once(parts: tuple[Registry, str]) -> None:
    registry, run_id = parts
    for _ in range(3):
        await registry.on_heartbeat(beat([], version=None))
    await registry.on_heartbeat(beat([], version=0, run_id=run_id))
    await registry.on_heartbeat(beat([], version=0, run_id=run_id))
    await registry.on_heartbeat(beat([], version=7, run_id="another-run"))  # not this run's
    await registry.on_heartbeat(beat([], version=None, session="s2"))  # a new process
    events = [(e["type"], e["version"]) for e in await registry.events.read(run_id)]
    assert events == [("join", None), ("version", 0), ("join", None)]


async def test_without_a_running_run_or_after_leaving_everything_is_dropped(
        parts: tuple[Registry, str]) -> None:
    registry, run_id = parts
    rid = request_id(run_id, 0, 1, 0)
    a = await registry.ledger.assign(rid, "i1", 1.0, 0, 2)
    assert a is not None
    held = [Held(request_id=rid, epoch=a.epoch)]
    await registry.runs.set_state(run_id, "cancelled")
    reply = await registry.on_heartbeat(beat(held, run_id=run_id))
    assert (reply.target, reply.revoke) == (None, [rid])
    await registry.redis.set(Keys.departed("i1"), "s1")  # this process released and left
    reply = await registry.on_heartbeat(beat(held, run_id=run_id))
    assert (reply.target, reply.revoke) == (None, [rid])
    assert await registry.on_heartbeat(beat([], session="s2")) is not None  # a restart may


async def test_a_beat_in_flight_after_leaving_records_no_join(
        parts: tuple[Registry, str]) -> None:
    registry, run_id = parts
    await registry.on_heartbeat(beat([], run_id=run_id))
    await registry.events.left(run_id, "i1", "spot", "preempt", "s1")
    # Sent before the release, answered after it: the run part runs with the beat (one
    # round trip), and must not take the leaver for a new process.
    await registry.on_heartbeat(beat([], run_id=run_id))
    await registry.on_heartbeat(beat([], run_id=run_id, session="s2"))  # a new process joins
    events = [(e["type"], e["instance"]) for e in await registry.events.read(run_id)]
    assert events == [("join", "i1"), ("leave", "i1"), ("join", "i1")]


async def test_leases_that_lapse_with_their_instance_are_a_preemption(
        parts: tuple[Registry, str], tmp_path: Path) -> None:
    """The reap pass found the instance alive ms before its registration and its leases
    lapsed, together; the lease expiry of the same pass then finds them gone: the instance is
    reaped there, so its work goes back as one preemption (counted in the step), not as
    leases that lapsed one by one (the fault suite's zombie test saw preemptions 0)."""
    registry, run_id = parts
    ledger, metrics = registry.ledger, registry.metrics
    rids = [request_id(run_id, 0, 0, s) for s in range(2)]
    held = []
    for rid in rids:
        lease = await ledger.assign(rid, "i1", 1.0, 0, 2)
        assert lease is not None
        held.append(Held(request_id=rid, epoch=lease.epoch))
    await registry.on_heartbeat(beat(held, run_id=run_id))
    dispatcher = Dispatcher(registry.cfg, registry.redis, None, ledger,  # type: ignore[arg-type]
                            registry.runs, registry, None, metrics,  # type: ignore[arg-type]
                            registry.soft, CrashPoints("", tmp_path), None)  # type: ignore[arg-type]
    await registry.reap_dead()  # the pass's reap: alive still
    assert await registry.redis.exists(Keys.instance("i1"))
    await asyncio.sleep(LEASE_TTL_S * 1.5)  # both lapse before the pass's lease expiry
    await dispatcher._expire_leases()
    step = await registry.redis.hgetall(Keys.step(run_id, 0))
    assert (step.get("preemptions"), step.get("preempted_responses")) == ("1", "2"), step
    assert metrics.revocations.labels("dead")._value.get() == 2
    assert metrics.revocations.labels("expired")._value.get() == 0
    assert set(rids) <= await registry.redis.smembers(Keys.pending(run_id, 0))


async def test_a_release_hands_back_only_the_senders_own_leases(
        parts: tuple[Registry, str]) -> None:
    """An instance that names another's lease in a release (ids are predictable, epochs small)
    takes nothing from it: the holder keeps its lease and epoch, and the refusal is counted.
    Its own lease in the same release goes back to pending."""
    registry, run_id = parts
    ledger = registry.ledger
    (mine, a), (theirs, b) = await leased_to_i1_and_i2(ledger, run_id)
    ack = await registry.on_release(Release(instance_id="i1", leaving=False, reason="preempt",
                                            held=[Held(request_id=theirs, epoch=b.epoch),
                                                  Held(request_id=mine, epoch=a.epoch)]))
    assert ack.ok
    assert await ledger.r.get(Keys.lease(theirs)) == f"i2:{b.epoch}"
    assert await ledger.r.hget(Keys.request(theirs), "epoch") == str(b.epoch)
    assert await ledger.r.hget(Keys.request(theirs), "owner") == "i2"
    assert not await ledger.r.exists(Keys.lease(mine))
    assert await ledger.r.hget(Keys.request(mine), "epoch") == str(a.epoch + 1)
    metrics = registry.metrics.registry
    assert metrics.get_sample_value("rlboost_foreign_releases_total") == 1
    # The manager's own decisions (load balancing, a dead holder) still take any lease back.
    assert await ledger.revoke(theirs, b.epoch)


async def test_a_leaving_instance_reads_draining_while_it_hands_back(
        parts: tuple[Registry, str]) -> None:
    """What a leaving instance hands back must not be leased straight back to it: from the
    moment its release arrives it reads draining (and takes no work), not ready as its last
    beat said, until it is forgotten."""
    registry, run_id = parts
    ledger = registry.ledger
    await registry.on_heartbeat(beat([]))
    (mine, a), _ = await leased_to_i1_and_i2(ledger, run_id)
    seen: list[str | None] = []
    hand_back = ledger.hand_back

    async def watched(request: str, epoch: int, instance: str) -> int:
        seen.append(await ledger.r.hget(Keys.instance("i1"), "state"))
        return await hand_back(request, epoch, instance)

    ledger.hand_back = watched  # type: ignore[method-assign]
    assert (await registry.on_release(Release(instance_id="i1", leaving=True, reason="preempt",
                                              held=[Held(request_id=mine, epoch=a.epoch)]))).ok
    assert seen == ["draining"]
    assert not await ledger.r.exists(Keys.instance("i1"))  # then forgotten
    # A release naming an instance the registry does not know creates no record of it.
    assert (await registry.on_release(Release(instance_id="ghost", leaving=True,
                                              reason="preempt", held=[]))).ok
    assert not await ledger.r.exists(Keys.instance("ghost"))


async def test_an_engine_that_stops_while_holding_work_is_drained_until_it_moves(
        parts: tuple[Registry, str]) -> None:
    """Beats carry the engine's decode steps: a count that stays put while the instance holds
    work ages; past the bound the instance is drained (its leases revoked, counted, ``draining``
    until its count moves); an idle engine's count does not age at all."""
    registry, run_id = parts
    (mine, a), _ = await leased_to_i1_and_i2(registry.ledger, run_id)
    held = [Held(request_id=mine, epoch=a.epoch)]

    async def beat_and_drain(steps: int, work: list[Held]) -> list[tuple[str, list[str]]]:
        await registry.on_heartbeat(msgspec.structs.replace(
            beat(work, run_id=run_id), decode_steps=steps))
        return await registry.drain_stuck(await registry.instances(run_id), run_id, 0.3)

    for _ in range(3):  # idle, its count unchanged: nothing ages
        assert await beat_and_drain(7, []) == []
        await asyncio.sleep(0.15)
    assert await beat_and_drain(8, held) == []  # moving while it holds work
    await asyncio.sleep(0.2)
    assert await beat_and_drain(9, held) == []
    await asyncio.sleep(0.35)  # stuck at 9, still holding: drained
    assert await beat_and_drain(9, held) == [("i1", [mine])]
    [row] = [r for r in await registry.instances(run_id) if r["id"] == "i1"]
    assert row["state"] == "draining" and row["decode_steps"] == 9
    assert registry.metrics.stuck_engines._value.get() == 1
    assert await registry.ledger.r.sismember(Keys.pending(run_id, 0), mine)
    await beat_and_drain(9, [])  # idle now, still at 9: still draining
    assert [r["state"] for r in await registry.instances(run_id) if r["id"] == "i1"] == [
        "draining"]
    await beat_and_drain(10, [])  # its engine moved again: it may take work
    assert [r["state"] for r in await registry.instances(run_id) if r["id"] == "i1"] == [
        "ready"]


async def test_only_the_key_an_id_is_bound_to_speaks_for_it(
        parts: tuple[Registry, str]) -> None:
    """With the auth callout on, an id is bound to one process's key: a beat or a release
    under another key (an older connection under the id, its binding lapsed) or under none
    (an image before key fingerprints) is refused and counted, and changes nothing: the newer
    process stays registered, keeps its lease, and its work goes to its own key's subject."""
    registry, run_id = parts
    registry.cfg = registry.cfg.model_copy(
        update={"issuer_seed": SecretStr(new_account_seed())})
    bound = public_key(new_user_seed())
    newer, older = names.fingerprint(bound), names.fingerprint(public_key(new_user_seed()))
    await registry.redis.set(Keys.identity("i1"), f"spot:{bound}", px=60_000)  # the callout's
    reply = await registry.on_heartbeat(beat([], run_id=run_id), key=newer)
    assert isinstance(reply, HeartbeatReply) and reply.target is not None
    assert await assign_subjects(registry.redis, ["i1", "i2"]) == [
        names.assign_subject("i1", newer), names.assign_subject("i2")]
    (mine, a), _ = await leased_to_i1_and_i2(registry.ledger, run_id)
    for key in (older, ""):
        refused = await registry.on_heartbeat(beat([], session="old"), key=key)
        assert isinstance(refused, Refused) and "i1" in refused.detail, refused
        ack = await registry.on_release(Release(instance_id="i1", held=[
            Held(request_id=mine, epoch=a.epoch)], session="old"), key=key)
        assert not ack.ok and "i1" in ack.detail
    info = await registry.redis.hgetall(Keys.instance("i1"))
    assert (info["session"], info["fp"]) == ("s1", newer)
    assert await registry.redis.get(Keys.lease(mine)) == f"i1:{a.epoch}"
    assert await registry.redis.exists(Keys.identity("i1"))
    counted = registry.metrics.registry.get_sample_value
    for message in ("heartbeat", "release"):
        assert counted("rlboost_superseded_messages_total", {"message": message}) == 2
    # The newer process's own release is honoured.
    ack = await registry.on_release(Release(instance_id="i1", leaving=False, reason="preempt",
                                            held=[Held(request_id=mine, epoch=a.epoch)]),
                                    key=newer)
    assert ack.ok and not await registry.redis.exists(Keys.lease(mine))


async def test_a_spot_instance_is_leased_no_more_than_the_spot_capacity(
        parts: tuple[Registry, str]) -> None:
    """A spot instance's declared capacity is bounded by RLBOOST_MAX_SPOT_CAPACITY (a claim of
    thousands would take a whole step's work); a reserved one's is its own. Counted."""
    registry, run_id = parts
    registry.cfg = registry.cfg.model_copy(update={"max_spot_capacity": 3})
    greedy = msgspec.structs.replace(beat([], run_id=run_id), capacity=4000)
    assert isinstance(await registry.on_heartbeat(greedy), HeartbeatReply)
    reserved = msgspec.structs.replace(greedy, instance_id="i2", kind="reserved")
    assert isinstance(await registry.on_heartbeat(reserved), HeartbeatReply)
    listed = {i["id"]: i["capacity"] for i in await registry.instances()}
    assert listed == {"i1": 3, "i2": 4000}
    counted = registry.metrics.registry.get_sample_value
    assert counted("rlboost_capacity_claims_clamped_total", {}) == 1
