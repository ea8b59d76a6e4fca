"""A spot machine's credentials cannot poison a run: the shipped NATS config, attacked.

The whole stack runs on locked brokers (compose/nats.conf's roles, rollout logins through the
manager's auth callout). An intruder holding the rollout password logs in under an instance id
of its own and tries every forbidden action: reading another instance's assignments or ``>``
or another's replies, speaking as the manager, the trainer or another instance, the JetStream
API, logging in under a live instance's id. Each fails, while its own subjects work (so the
refusals are not a broker refusing everything). During the run, chunks are forged with a
valid request id and epoch (the intruder's, and one on the holder's own subject from a bus
credential that could publish there): each is rejected and counted. The lease holder's own key
signs chunks with out-of-vocabulary tokens and a negative offset: dropped, counted, never
trained on. The run's samples equal the emu oracle's, token for token.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
import redis

from rlboost.launcher import Cluster
from rlboost.stack import Stack
from shared import names
from shared.bus import split_credentials
from shared.identity import new_user_seed, public_key
from shared.mac import entry_mac
from shared.names import LEASE_PREFIX, Keys
from shared.protocol import (
    Ack,
    FrameEntry,
    Heartbeat,
    HeartbeatReply,
    Refused,
    Release,
    RunFailed,
    TokenFrame,
    decode,
    decode_beat_reply,
    encode,
)
from tests.support.cluster import start_cluster, wait_run
from tests.support.invariants import check_run
from tests.system.test_faults import FAST, REWARD, oracle

pytestmark = pytest.mark.slow

LAPSED = "spot-9"  # the id whose binding lapses and passes to a newer process
GARBAGE = 40  # forged entries its older connection sends: past RLBOOST_QUARANTINE_INVALID
SPEC = {"model": "emu", "steps": 2, "prompts_per_step": 4, "samples_per_prompt": 2,
        "max_new_tokens": 96, "seed": 11}
LONGER = {**SPEC, "steps": 3, "max_new_tokens": 192}  # on while the older connection tries


@pytest.fixture
def cluster(locked: Stack, tmp_path: Path) -> Iterator[Cluster]:
    c = start_cluster(tmp_path, locked, spot=1, reserved=1, engine="emu", env=FAST)
    try:
        yield c
    finally:
        c.stop()


def key_of(seed: str) -> str:
    """The fingerprint a login with ``seed`` finds in its subjects, as rollout_svc derives it."""
    return names.fingerprint(public_key(seed))


async def login(stack: Stack, instance_id: str, errors: list[str], seed: str | None = None
                ) -> nats.NATS:
    """Log in as rollout instance ``instance_id`` (with key ``seed``, by default a new one),
    as rollout_svc does, recording refusals."""
    assert stack.roles is not None
    url, _ = split_credentials(stack.nats.url_for("rollout"))

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    return await nats.connect(url, name=instance_id, token=stack.roles.rollout,
                              nkeys_seed_str=seed or new_user_seed(), error_cb=on_error,
                              inbox_prefix=names.inbox_prefix(instance_id),
                              allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3)


async def try_forbidden(stack: Stack) -> dict[str, bool]:
    """Each forbidden action -> whether the broker refused it."""
    errors: list[str] = []
    seed = new_user_seed()
    nc = await login(stack, "intruder-1", errors, seed)
    refused: dict[str, bool] = {}

    async def attempt(what: str, action: Any, subject: str) -> None:
        before = len(errors)
        await action
        await nc.flush()
        await asyncio.sleep(0.2)
        refused[what] = any("permissions violation" in e and subject.lower() in e
                            for e in errors[before:])

    await attempt("subscribe another's assignments",
                  nc.subscribe(names.assign_subject("spot-0")), names.assign_subject("spot-0"))
    # Its own id's, under any key but its own: what an older connection under a reused id
    # could otherwise read of the newer process's assignments.
    for subject in (names.assign_subject("intruder-1"), names.assign_subject("intruder-1", "*"),
                    names.assign_subject("intruder-1", key_of(new_user_seed()))):
        await attempt(f"subscribe {subject}", nc.subscribe(subject), subject)
    await attempt("subscribe >", nc.subscribe(">"), '">"')
    await attempt("subscribe every inbox", nc.subscribe("_INBOX.>"), "_INBOX.>")
    for subject in (names.TRAINER_FAIL, names.TRAINER_FINISH, names.barrier_subject("r"),
                    names.assign_subject("spot-0"), names.heartbeat_subject("spot-0"),
                    names.release_subject("spot-0"), names.chunk_subject("run-x", "spot-0"),
                    names.chunk_subject("run-x", "intruder-1"),  # its id's, but not its key's
                    names.WEIGHTS_ANNOUNCE):
        await attempt(f"publish {subject}", nc.publish(subject, encode(
            RunFailed(run_id="run-x", error="forged"))), subject)
    for api in ("$JS.API.STREAM.DELETE.RLB_CHUNKS", "$JS.API.STREAM.INFO.RLB_CHUNKS",
                "$JS.API.CONSUMER.DELETE.RLB_CHUNKS.manager", "$JS.API.INFO"):
        await attempt(f"JetStream {api}", nc.publish(api, b"", reply=nc.new_inbox()), api)
    # Its own subjects work: the refusals above are permissions, not a dead connection.
    before = len(errors)
    own = await nc.subscribe(names.assign_subject("intruder-1", key_of(seed)))
    await nc.publish(names.heartbeat_subject("intruder-1", key_of(seed)), b"{}")
    await nc.flush()
    await asyncio.sleep(0.2)
    refused["own subjects refused"] = any("permissions violation" in e for e in errors[before:])
    await own.unsubscribe()
    await nc.close()
    # A live instance's id cannot be claimed by another key; a wrong password logs in nowhere.
    try:
        taken = await login(stack, "spot-0", [])
        await taken.close()
        refused["log in as spot-0"] = False
    except Exception:
        refused["log in as spot-0"] = True
    assert stack.roles is not None
    url, _ = split_credentials(stack.nats.url_for("rollout"))
    try:
        wrong = await nats.connect(url, name="intruder-2", token="wrong",
                                   nkeys_seed_str=new_user_seed(), allow_reconnect=False,
                                   max_reconnect_attempts=0, connect_timeout=3)
        await wrong.close()
        refused["wrong password"] = False
    except Exception:
        refused["wrong password"] = True
    return refused


def live_lease(store: redis.Redis, run_id: str) -> tuple[str, str, int, int, int]:
    """A response of the run under a live lease: (request id, holder, epoch, version, n)."""
    end = time.monotonic() + 30
    while time.monotonic() < end:
        for key in store.scan_iter(match=Keys.lease(f"{run_id}:*"), count=1000):
            owner = store.get(key)
            # rlb:lease:{<run>}:<step>:<prompt>:<sample> -> <run>:<step>:<prompt>:<sample>
            rid = str(key).removeprefix(LEASE_PREFIX).replace("{", "", 1).replace("}", "", 1)
            info = store.hmget(Keys.request(rid), ["version", "n", "done"])
            if owner and info[2] == "0":
                holder, epoch = str(owner).rsplit(":", 1)
                return rid, holder, int(epoch), int(info[0] or 0), int(info[1] or 0)
        time.sleep(0.02)
    raise AssertionError("no live lease seen")


async def forge(stack: Stack, store: redis.Redis, run_id: str) -> dict[str, int]:
    """Chunks with valid request ids and epochs: forged ones, and the holder's own invalid
    ones. Returns how many of each kind were sent."""
    errors: list[str] = []
    seed = new_user_seed()
    intruder = await login(stack, "intruder-3", errors, seed)
    bus = await nats.connect(stack.nats.url_for("manager"))  # a credential that reaches any
    rid, holder, epoch, version, n = live_lease(store, run_id)
    sent = {"forged": 0, "invalid": 0}

    def chunk(instance_id: str, tokens: list[int], offset: int) -> TokenFrame:
        return TokenFrame(instance_id=instance_id, entries=[FrameEntry.of(
            request_id=rid, epoch=epoch, weight_version=version, offset=offset,
            token_ids=tokens)])

    # The intruder, on its own subject, in its own name and then in the holder's: no key.
    for name in ("intruder-3", holder):
        forged = chunk(name, [7, 7, 7, 7], n)
        forged.entries[0].mac = hashlib.sha256(f"{rid}|{epoch}".encode()).hexdigest()  # a guess
        await intruder.jetstream().publish(names.chunk_subject(run_id, "intruder-3",
                                                               key_of(seed)),
                                           encode(forged), timeout=5)
        sent["forged"] += 1
    # On the holder's own subject, right epoch and offset, no MAC: knowing them is not enough.
    await bus.jetstream().publish(names.chunk_subject(run_id, holder),
                                  encode(chunk(holder, [7, 7, 7, 7], n)), timeout=5)
    sent["forged"] += 1
    # The holder's key (derived as the manager derives it) on out-of-vocabulary tokens, bytes
    # that are not whole ids and a negative offset: authentic, but never committable.
    secret = bytes.fromhex(str(store.get(Keys.chunk_key())))
    key = hmac.new(secret, f"{rid}|{epoch}".encode(), hashlib.sha256).hexdigest()
    for tokens, offset in (([10**9, 5], n), ([7], n), ([5], -3)):
        bad = chunk(holder, tokens, offset)
        if tokens == [7]:
            bad.entries[0].tokens += b"\x07"  # five bytes
        bad.entries[0].mac = entry_mac(key, holder, bad.entries[0])
        await bus.jetstream().publish(names.chunk_subject(run_id, holder), encode(bad), timeout=5)
        sent["invalid"] += 1
    await intruder.close()
    await bus.close()
    return sent


def metric(text: str, name: str, labels: str = "") -> float:
    found = re.search("^" + re.escape(name + labels) + r" (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_rollout_credential_cannot_poison_a_run(locked: Stack, cluster: Cluster) -> None:
    refused = asyncio.run(try_forbidden(locked))
    assert refused.pop("own subjects refused") is False
    assert all(refused.values()), {k: v for k, v in refused.items() if not v}
    assert len(refused) >= 17
    api = {"Authorization": "Bearer x"} if cluster.env.get("RLBOOST_API_TOKEN") else {}
    store = redis.Redis.from_url(locked.redis.url, decode_responses=True)
    with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], headers=api,
                      timeout=10) as client:
        run_id = client.post("/v1/runs", json=SPEC).json()["id"]
        sent = asyncio.run(forge(locked, store, run_id))
        final = wait_run(client, run_id, timeout_s=240, cluster=cluster)
        assert final["state"] == "succeeded", final
        samples = check_run(client, run_id, SPEC, REWARD)
        for step, got in samples.items():  # token for token what a clean run generates
            for sample in got:
                assert sample["response_token_ids"] == oracle(SPEC, sample, step), sample
                assert "intruder-3" not in sample["instances"]
                assert all(0 <= t < 32000 for t in sample["response_token_ids"])
        steps = client.get(f"/v1/runs/{run_id}/steps").json()
        assert sum(s["forged_chunks_rejected"] for s in steps) == sent["forged"]
        assert sum(s["invalid_chunks_dropped"] for s in steps) == sent["invalid"]
        text = client.get("/metrics").text
        assert metric(text, "rlboost_forged_chunks_rejected_total") == sent["forged"]
        assert metric(text, "rlboost_chunks_total", '{result="invalid"}') == sent["invalid"]
        assert metric(text, "rlboost_nats_logins_total", '{result="refused"}') >= 2
    store.close()
    # Every drop was logged (and the run finishing shows the stream survived the JetStream calls).
    manager_log = (cluster.root / "logs" / "manager.log").read_text()
    assert "forged entry of" in manager_log and "invalid entry of" in manager_log



async def older_login(stack: Stack, store: redis.Redis, seed: str, errors: list[str]
                      ) -> nats.NATS:
    """Process A logs in as ``LAPSED``, beats once, and falls silent: its binding lapses with
    its instance (RLBOOST_INSTANCE_TTL_S) while its connection stays up."""
    nc = await login(stack, LAPSED, errors, seed)
    assert str(store.get(Keys.identity(LAPSED))).endswith(public_key(seed))
    reply = decode_beat_reply((await nc.request(names.heartbeat_subject(LAPSED, key_of(seed)),
                                                encode(lapsed_beat()), timeout=5)).data)
    assert isinstance(reply, HeartbeatReply)
    end = time.monotonic() + 30
    while store.exists(Keys.identity(LAPSED)):
        assert time.monotonic() < end, "the binding never lapsed"
        await asyncio.sleep(0.1)
    return nc


def lapsed_beat() -> Heartbeat:
    return Heartbeat(instance_id=LAPSED, kind="spot", engine="emu", state="ready",
                     session="older")


def bound_key(store: redis.Redis) -> str:
    """The fingerprint of the key the id is bound to now ("" none)."""
    bound = store.get(Keys.identity(LAPSED))
    return names.fingerprint(str(bound).partition(":")[2]) if bound else ""


async def older_tries(nc: nats.NATS, seed: str, newer: str, errors: list[str],
                      store: redis.Redis, rid: str) -> dict[str, bool]:
    """What the older connection gets of the newer process's id (``rid`` one of its
    responses): garbage enough to quarantine the id, were it the newer process's, its
    assignments under any key, a beat, a release that would forget the id (and revoke the
    newer one's work)."""
    garbage = TokenFrame(instance_id=LAPSED, entries=[FrameEntry.of(
        request_id=rid, epoch=1, weight_version=0, offset=0, token_ids=[7])
        for _ in range(GARBAGE)])
    for entry in garbage.entries:
        entry.mac = "0" * 64
    run_id = rid.split(":", 1)[0]
    await nc.jetstream().publish(names.chunk_subject(run_id, LAPSED, key_of(seed)),
                                 encode(garbage), timeout=5)
    seen: dict[str, bool] = {}
    for subject in (names.assign_subject(LAPSED, newer), names.assign_subject(LAPSED, "*"),
                    f"{names.assign_subject(LAPSED)}.>"):
        before = len(errors)
        await nc.subscribe(subject)
        await nc.flush()
        await asyncio.sleep(0.2)
        seen[f"subscribe {subject} refused"] = any(
            "permissions violation" in e and subject.lower() in e for e in errors[before:])
    beat = decode_beat_reply((await nc.request(names.heartbeat_subject(LAPSED, key_of(seed)),
                                               encode(lapsed_beat()), timeout=5)).data)
    seen["beat refused"] = isinstance(beat, Refused) and LAPSED in beat.detail
    ack = decode((await nc.request(names.release_subject(LAPSED, key_of(seed)), encode(
        Release(instance_id=LAPSED, held=[], leaving=True, session="older")), timeout=5)).data,
        Ack)
    seen["release refused"] = not ack.ok
    seen["the run was on throughout"] = store.hget(Keys.run(run_id), "state") == "running"
    return seen


async def lapse_and_reuse(stack: Stack, cluster: Cluster, store: redis.Redis,
                          client: httpx.Client) -> tuple[str, dict[str, bool], list[bytes]]:
    """A lapses, B joins under its id, a run starts, B is assigned work, A tries; then A's
    own key's subject is watched until the run ends. Returns the run, what A saw refused,
    and what reached A's subject."""
    seed, errors, got = new_user_seed(), list[str](), list[bytes]()
    nc = await older_login(stack, store, seed, errors)

    async def on_msg(msg: Any) -> None:
        got.append(bytes(msg.data))

    await nc.subscribe(names.assign_subject(LAPSED, key_of(seed)), cb=on_msg)
    cluster.add_instance("spot", LAPSED)  # B: a real rollout process, with a key of its own
    end = time.monotonic() + 120
    while not bound_key(store) or store.hget(Keys.instance(LAPSED), "fp") != bound_key(store):
        assert time.monotonic() < end, "B never joined"
        await asyncio.sleep(0.1)
    newer = bound_key(store)
    assert newer != key_of(seed)
    # Under load the run may end before B (weights still loading) is leased anything, its
    # responses all held by the instances that were ready first: then another run, until B
    # holds work in one.
    run_id = ""
    held: set[str] = set()
    while not held:
        assert time.monotonic() < end + 120, "B was never assigned work"
        if not run_id or store.hget(Keys.run(run_id), "state") in (
                "succeeded", "failed", "cancelled"):
            if run_id:
                await asyncio.to_thread(wait_run, client, run_id, 120, cluster)
            run_id = client.post("/v1/runs", json=LONGER).json()["id"]
        held = store.smembers(Keys.held(run_id, LAPSED))
        await asyncio.sleep(0.02)
    seen = await older_tries(nc, seed, newer, errors, store, sorted(held)[0])
    seen["B keeps the id"] = bound_key(store) == newer == store.hget(Keys.instance(LAPSED), "fp")
    while (await asyncio.to_thread(client.get, f"/v1/runs/{run_id}")).json()["state"] \
            == "running" and time.monotonic() < end + 240:
        await asyncio.sleep(0.3)
    await nc.close()
    return run_id, seen, got


def test_an_older_connection_reads_nothing_of_the_newer_process(locked: Stack,
                                                                cluster: Cluster) -> None:
    """Issue 37: A logs in as an id and lapses (declared dead, still connected); B logs in as
    the same id with its own key and is assigned work. A cannot subscribe to B's assignments
    (a permissions violation), receives none on its own key's subject, its beat and its
    leaving release are refused, and its forged entries, though counted, never quarantine
    B: B keeps the id and its work, and the run's samples are the oracle's, B's among them."""
    store = redis.Redis.from_url(locked.redis.url, decode_responses=True)
    api = {"Authorization": "Bearer x"} if cluster.env.get("RLBOOST_API_TOKEN") else {}
    with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], headers=api,
                      timeout=10) as client:
        run_id, seen, got = asyncio.run(lapse_and_reuse(locked, cluster, store, client))
        final = wait_run(client, run_id, timeout_s=240, cluster=cluster)
        assert final["state"] == "succeeded", final
        samples = check_run(client, run_id, LONGER, REWARD)
        for step, step_samples in samples.items():
            for sample in step_samples:
                assert sample["response_token_ids"] == oracle(LONGER, sample, step), sample
        assert any(LAPSED in s["instances"] for ss in samples.values() for s in ss)
        assert not any(LAPSED in w for w in final.get("warnings") or []), final
        steps = client.get(f"/v1/runs/{run_id}/steps").json()
        assert sum(s["forged_chunks_rejected"] for s in steps) >= GARBAGE
        text = client.get("/metrics").text
    store.close()
    assert all(seen.values()), seen
    assert got == []  # nothing reached the older connection, on any subject it may read
    assert metric(text, "rlboost_superseded_messages_total", '{message="heartbeat"}') >= 1
    assert metric(text, "rlboost_superseded_messages_total", '{message="release"}') >= 1
    assert metric(text, "rlboost_instances_quarantined_total", '{cause="invalid"}') == 0
