"""Commits acked only once a replica holds them (RLBOOST_REDIS_REPLICA_ACKS), on real servers.

A primary answers a write before its replicas have it, and a replica that takes over loses
what it had not received: frames acked after such a commit would be gone for good. With
``replica_acks`` the ledger's commit returns only once that many replicas of the node hold
it. Each case stops the replica (SIGSTOP: alive, connected, not replicating), shows that a
commit does not return meanwhile, lets it go on, and checks that the commit then returns
its own statuses (nothing was sent twice) and that the replica holds the tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.exceptions import RedisError

from manager_svc.accounting import Ledger
from manager_svc.archive import Archive
from manager_svc.runs import RunStore
from manager_svc.scripts import Call, run_batch
from rlboost.stack import Server
from shared.bus import connect_redis
from shared.names import Keys
from shared.ports import free_port
from shared.protocol import FrameEntry, TokenFrame
from shared.spec import RunSpec
from tests.support.redis_cluster import RedisClusterNodes

RUN = "run-acks"
STALL_S = 1.5  # longer than a WAIT (scripts.WAIT_MS): a commit still waiting is held back


def frame(rid: str, epoch: int, offset: int, tokens: list[int]) -> TokenFrame:
    return TokenFrame(instance_id="i1", entries=[FrameEntry.of(
        request_id=rid, epoch=epoch, weight_version=0, offset=offset, token_ids=tokens)])


async def held_back_until_replicated(url: str, replica: subprocess.Popen[bytes],
                                     replica_port: int) -> None:
    ledger = Ledger(await connect_redis(url), lease_ttl_s=60, replica_acks=1)
    await ledger.create_step(RUN, 0, 0, [[1, 2]], samples=1, max_new_tokens=8)
    rid = f"{RUN}:0:0:0"
    lease = await ledger.assign(rid, "i1", 1.0, 0, 2)
    assert lease is not None
    [first] = await ledger.commit(frame(rid, lease.epoch, 0, [5, 6]))
    assert first.status == "ok"
    copy = redis.Redis(host="127.0.0.1", port=replica_port, decode_responses=True)
    with contextlib.suppress(redis.ResponseError):  # a cluster replica serves reads so
        copy.execute_command("READONLY")
    # Answered only once the replica held it: read there at once, it is there.
    assert copy.get(Keys.tokens(rid)) == "5,6"
    replica.send_signal(signal.SIGSTOP)
    try:
        pending = asyncio.ensure_future(ledger.run_calls(
            ledger.pack([frame(rid, lease.epoch, 2, [7])]), wait_for_redis=True))
        done, _ = await asyncio.wait([pending], timeout=STALL_S)
        assert not done, "the commit returned while no replica could hold it"
    finally:
        replica.send_signal(signal.SIGCONT)
    [second] = await asyncio.wait_for(pending, timeout=30)
    assert second.status == "ok"  # its own reply, not a duplicate of a second send
    assert copy.get(Keys.tokens(rid)) == "5,6,7"
    copy.close()
    await ledger.r.aclose()


@pytest.fixture
def primary(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes], int]]:
    """A primary's URL, and its replica's process and port, in sync."""
    servers = [Server("redis", free_port(), tmp_path / name, tmp_path / f"{name}.log")
               for name in ("primary", "replica")]
    first, second = servers
    try:
        for server in servers:
            server.start()
        follower = redis.Redis(host="127.0.0.1", port=second.port)
        follower.replicaof("127.0.0.1", first.port)
        while follower.info("replication").get("master_link_status") != "up":
            time.sleep(0.05)
        follower.close()
        assert second.proc is not None
        yield first.url, second.proc, second.port
    finally:
        for server in servers:
            server.kill()


async def test_a_commit_waits_for_the_replica_of_a_primary(
        primary: tuple[str, subprocess.Popen[bytes], int]) -> None:
    await held_back_until_replicated(*primary)


async def test_a_finished_step_is_recorded_once_the_replica_holds_it(
        primary: tuple[str, subprocess.Popen[bytes], int], tmp_path: Path) -> None:
    url, replica, port = primary
    runs = RunStore(await connect_redis(url), Archive(tmp_path), replica_acks=1)
    run_id = (await runs.create(RunSpec(model="emu", steps=2)))["id"]
    assert await runs.active() == run_id
    replica.send_signal(signal.SIGSTOP)
    try:
        pending = asyncio.ensure_future(runs.finish_step(run_id, 0, {"step": 0}, "[]", 2))
        done, _ = await asyncio.wait([pending], timeout=STALL_S)
        assert not done, "the step was recorded while no replica could hold it"
    finally:
        replica.send_signal(signal.SIGCONT)
    await asyncio.wait_for(pending, timeout=30)
    copy = redis.Redis(host="127.0.0.1", port=port, decode_responses=True)
    assert copy.hget(Keys.run(run_id), "step") == "1"
    copy.close()
    await runs.r.aclose()


async def test_a_commit_waits_for_the_replica_of_its_cluster_node(tmp_path: Path) -> None:
    # The run's node, not any other: the WAIT goes on the connection that sent the commit.
    with RedisClusterNodes(tmp_path / "cluster", replicas=1) as nodes:
        home = nodes.ports.index(nodes.node_of(Keys.run(RUN)))
        replica = nodes.size + home  # one replica each, in the primaries' order
        await held_back_until_replicated(nodes.url, nodes.procs[replica], nodes.ports[replica])


async def test_no_batch_is_acked_while_its_new_primary_has_no_replica(tmp_path: Path) -> None:
    # The primary of the slot dies: its replica takes over with no replica of its own, so
    # no batch on that slot may come back acked until the dead node returns as its replica
    # (a WAIT answered by another node, or on another connection, would let one through).
    with RedisClusterNodes(tmp_path / "cluster", replicas=1) as nodes:
        client = await connect_redis(nodes.url)
        count = client.register_script("return redis.call('INCR', KEYS[1])")
        key = Keys.run(RUN)
        assert await run_batch(client, [Call(count, [key], [])], replicas=1) == [1]
        home = nodes.node_of(key)
        victim = nodes.procs[nodes.ports.index(home)]
        assert victim.poll() is None
        victim.kill()
        victim.wait(timeout=10)
        # Batches sent all through the failover (~2 s) and after it: none may come back.
        end = time.monotonic() + 8
        tries = 0
        while time.monotonic() < end:
            tries += 1
            with contextlib.suppress(RedisError, TimeoutError):
                got = await asyncio.wait_for(run_batch(client, [Call(count, [key], [])],
                                                       replicas=1), timeout=2)
                raise AssertionError(f"acked with no replica to hold it: {got}")
            await asyncio.sleep(0.3)
        assert tries >= 3 and nodes.primary_of(key) != home, "the slot did not fail over"
        nodes.restart(home)  # back as the new primary's replica
        got = None
        end = time.monotonic() + 60
        while got is None and time.monotonic() < end:
            with contextlib.suppress(RedisError, TimeoutError):
                got = await asyncio.wait_for(run_batch(client, [Call(count, [key], [])],
                                                       replicas=1), timeout=5)
        assert got is not None and int(got[0]) >= 2, got
        await client.aclose()
