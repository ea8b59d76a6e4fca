"""A hostile instance with a valid spot credential attacks a run; the run does not notice.

The whole stack runs on locked brokers (compose/nats.conf, rollout logins through the
manager's auth callout; the reserved instance logs in with the reserved password). While an
honest run goes on, ``hostile-1`` logs in with the spot password and tries every attack of
issue 37 in turn: releasing the honest holders' leases, a heartbeat whose reply subject is the
stream's purge endpoint, heartbeats flooded at once and with oversized fields, a beat
claiming ``reserved``, logging in under a live instance's id and past its credential's cap,
forged entries by the ten thousand, and subscriptions past the server's per-connection limit.
The run succeeds with every sample token for token what a fault-free run generates (the emu
oracle, invariant 5), the stream never lost a frame, the manager's memory stays bounded, and
each attack moved its own counter on ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import psutil
import pytest
import redis

from rlboost.launcher import Cluster
from rlboost.stack import Stack
from shared import names
from shared.identity import new_user_seed
from shared.protocol import FrameEntry, Heartbeat, Held, Release, TokenFrame, encode
from tests.support.cluster import start_cluster, wait_run
from tests.support.invariants import check_run
from tests.system.test_faults import FAST, REWARD, oracle
from tests.system.test_least_privilege import key_of, live_lease, login, metric

pytestmark = pytest.mark.slow

SPEC = {"model": "emu", "steps": 3, "prompts_per_step": 4, "samples_per_prompt": 2,
        "max_new_tokens": 160, "seed": 5}
HOSTILE = "hostile-1"
CAP = 2  # live ids per rollout credential: spot-0 and hostile-1
FLOOD = 3000  # heartbeats sent back to back
FORGED_FRAMES, FORGED_ENTRIES = 10, 2000


@pytest.fixture
def cluster(locked: Stack, tmp_path: Path) -> Iterator[Cluster]:
    c = start_cluster(tmp_path, locked, spot=1, reserved=1, engine="emu",
                      env={**FAST, "RLBOOST_MAX_INSTANCES_PER_CREDENTIAL": str(CAP)})
    try:
        yield c
    finally:
        c.stop()


def beat(**fields: Any) -> Heartbeat:
    """A beat of the hostile instance: never ``ready``, so it is never given work."""
    return Heartbeat(**{"instance_id": HOSTILE, "kind": "spot", "engine": "emu",
                        "state": "starting", **fields})


async def refused_login(stack: Stack, instance_id: str) -> bool:
    try:
        nc = await login(stack, instance_id, [])
    except Exception:
        return True
    await nc.close()
    return False


async def attack(stack: Stack, store: redis.Redis, run_id: str) -> dict[str, Any]:
    """Every attack once, from a spot credential; returns what was sent and seen."""
    rid, holder, epoch, version, n = live_lease(store, run_id)  # the run is on
    errors: list[str] = []
    seed = new_user_seed()
    nc = await login(stack, HOSTILE, errors, seed)
    beats, releases = (names.heartbeat_subject(HOSTILE, key_of(seed)),
                       names.release_subject(HOSTILE, key_of(seed)))
    seen: dict[str, Any] = {}
    # Someone else's lease, as a release: refused, its holder keeps it.
    await nc.request(releases, encode(Release(
        instance_id=HOSTILE, held=[Held(request_id=rid, epoch=epoch)], leaving=False)),
        timeout=5)
    owner = store.get(names.Keys.lease(rid))  # None: finished meanwhile
    seen["lease kept"] = owner in (None, f"{holder}:{epoch}")
    # The manager's answer reflected onto the JetStream API.
    await nc.publish(beats, encode(beat()),
                     reply=f"$JS.API.STREAM.PURGE.{names.CHUNK_STREAM}")
    # reserved, from a spot credential
    await nc.request(beats, encode(beat(kind="reserved")), timeout=5)
    seen["served as spot"] = store.hget(names.Keys.instance(HOSTILE), "kind") == "spot"
    # Identities: a live id is not taken over; past its credential's cap, no new id.
    seen["takeover refused"] = await refused_login(stack, "spot-0")
    await nc.request(beats, encode(beat()), timeout=5)  # still live
    seen["cap refused"] = await refused_login(stack, "hostile-2")
    # Floods: a burst of valid beats, then beats with oversized fields.
    for _ in range(FLOOD):
        await nc.publish(beats, encode(beat()),
                         reply=nc.new_inbox())
    big = encode(beat()).replace(b'"engine":"emu"', b'"engine":"' + b"x" * 100_000 + b'"')
    for _ in range(FLOOD // 10):
        await nc.publish(beats, big)
    await nc.flush()
    # Forged entries at a high rate, on its own subject with a live lease's id and epoch.
    rid, holder, epoch, version, n = live_lease(store, run_id)
    frame = TokenFrame(instance_id=HOSTILE, entries=[FrameEntry.of(
        request_id=rid, epoch=epoch, weight_version=version, offset=n, token_ids=[7, 7])
        for _ in range(FORGED_ENTRIES)])
    for entry in frame.entries:
        entry.mac = "0" * 64
    start = time.monotonic()
    for _ in range(FORGED_FRAMES):
        await nc.jetstream().publish(names.chunk_subject(run_id, HOSTILE, key_of(seed)),
                                     encode(frame), timeout=10)
    seen["forge_s"] = time.monotonic() - start
    seen["forged_at"] = time.monotonic()
    # Subscriptions past the server's per-connection limit: the server cuts the connection.
    for _ in range(300):
        await nc.subscribe(names.assign_subject(HOSTILE, key_of(seed)))
    with contextlib.suppress(Exception):
        await nc.flush(timeout=2)
    await asyncio.sleep(0.5)
    seen["subscriptions cut"] = nc.is_closed
    await nc.close()
    return seen


def stream_state(stack: Stack) -> dict[str, Any]:
    async def read() -> dict[str, Any]:
        nc = await nats.connect(stack.nats.url_for("manager"))
        try:
            js = nc.jetstream()
            stream = await js.stream_info(names.CHUNK_STREAM)
            consumer = await js.consumer_info(names.CHUNK_STREAM, names.CHUNK_CONSUMER)
            return {"deny_purge": stream.config.deny_purge, "last": stream.state.last_seq,
                    "left": stream.state.messages, "acked": consumer.ack_floor.stream_seq}
        finally:
            await nc.close()
    return asyncio.run(read())


def test_a_hostile_instance_cannot_hurt_a_run(locked: Stack, cluster: Cluster) -> None:
    manager = psutil.Process(next(c.proc.pid for c in cluster.children
                                  if c.name == "manager" and c.proc is not None))
    store = redis.Redis.from_url(locked.redis.url, decode_responses=True)
    api = {"Authorization": "Bearer x"} if cluster.env.get("RLBOOST_API_TOKEN") else {}
    with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], headers=api,
                      timeout=10) as client:
        run_id = client.post("/v1/runs", json=SPEC).json()["id"]
        rss_before = manager.memory_info().rss
        seen = asyncio.run(attack(locked, store, run_id))
        rss_after = manager.memory_info().rss
        forged = FORGED_FRAMES * FORGED_ENTRIES
        while metric(client.get("/metrics").text, "rlboost_forged_chunks_rejected_total") < forged \
                and time.monotonic() < seen["forged_at"] + 60:
            time.sleep(0.05)
        rejected_s = time.monotonic() - seen.pop("forged_at")
        kinds = {i["id"]: i["kind"] for i in client.get("/v1/instances").json()}
        final = wait_run(client, run_id, timeout_s=300, cluster=cluster)
        assert final["state"] == "succeeded", final
        samples = check_run(client, run_id, SPEC, REWARD)
        for step, got in samples.items():  # token for token a fault-free run's
            for sample in got:
                assert sample["response_token_ids"] == oracle(SPEC, sample, step), sample
                assert HOSTILE not in sample["instances"]
        steps = client.get(f"/v1/runs/{run_id}/steps").json()
        text = client.get("/metrics").text
    store.close()
    print(f"manager RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB; {forged} "
          f"forged entries sent in {seen['forge_s']:.2f} s, all rejected {rejected_s:.2f} s "
          "after the last (the attack's later steps included)")
    assert seen.pop("forge_s") < 30
    assert all(seen.values()), seen
    assert kinds.get("reserved-0") == "reserved", kinds  # the reserved credential's kind
    assert rss_after - rss_before < 96 << 20
    assert metric(text, "rlboost_foreign_releases_total") >= 1
    # Each oversized beat (and the reflected one) was shed unread or dropped as malformed.
    malformed = metric(text, "rlboost_malformed_messages_total",
                       f'{{subject="{names.HEARTBEAT_ANY}"}}')
    shed = metric(text, "rlboost_bus_messages_shed_total", '{reason="pending"}')
    assert malformed >= 1 and shed >= 1 and malformed + shed >= 1 + FLOOD // 10
    assert metric(text, "rlboost_kind_claims_refused_total") >= 1
    assert metric(text, "rlboost_nats_logins_total", '{result="refused"}') >= 2
    assert metric(text, "rlboost_forged_chunks_rejected_total") == forged
    assert sum(s.get("forged_chunks_rejected", 0) for s in steps) == forged
    # The stream: purge denied, and every frame ever stored was delivered and acked.
    state = stream_state(locked)
    assert state["deny_purge"] and state["left"] == 0 and state["acked"] == state["last"]
    # One line per kind per 10 s, not one per forged entry.
    log = (cluster.root / "logs" / "manager.log").read_text()
    assert 1 <= log.count("forged entry of") <= 10
