"""The manager's Redis scripts: read from the ``.lua`` files in ``manager_svc/lua/``.

Contract: every atomic state change the manager makes in Redis (a commit, a lease, a revoke, a
heartbeat's registration, a run's activation) is one Lua script in its own file, shipped as
package data and read through :mod:`importlib.resources`, so an installed package finds them as
a source checkout does. Redis scripts cannot include one another, so a line
``-- include: NAME.lua`` is replaced by that file's text before the script is registered (the
ledger's helper functions live once, in ``common.lua``, the key builders in ``keys.lua``), and
``@NAME@`` by the constant of :data:`CONSTANTS` of that name (key names stay defined once, in
:mod:`shared.names`). :func:`register` is called once per script and client, in the
constructor of the part that runs it; the client then runs it by SHA (EVALSHA, loading it
again itself after a Redis restart).

Every script reaches the keys of one slot only (one run's, or the control keys: see
:class:`shared.names.Keys`) and is called with at least one of them in KEYS, which is how a
Redis Cluster client finds the node to send it to. :func:`run_batch` sends many calls in one
round trip (per node) on a plain client and on a cluster client alike.
"""

from __future__ import annotations

import asyncio
import logging
import re
import weakref
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    NoScriptError,
    RedisError,
    ResponseError,
    TryAgainError,
)

from shared.names import (
    HELD_PREFIX,
    LEASE_PREFIX,
    LOGPROBS_SUFFIX,
    REQUEST_PREFIX,
    RUN_PREFIX,
    TOKENS_SUFFIX,
)

log = logging.getLogger("manager")
WAIT_MS = 1000  # one WAIT for replicas; a shortfall is waited for again, never skipped
# What a plain client of one cluster node takes from the cluster client's node settings.
_NODE_KWARGS = ("username", "password", "credential_provider", "decode_responses", "encoding",
                "encoding_errors", "socket_timeout", "socket_connect_timeout", "protocol")
# Answers that say the slot is not served here now: the batch may not have run.
_NOT_HERE = (MovedError, AskError, ClusterDownError, TryAgainError)
# Per cluster client, a plain client of each node (by name) for the batches that wait for
# replicas: a cache beside the client it serves, gone with it.
_NODE_CLIENTS: weakref.WeakKeyDictionary[Any, dict[str, aioredis.Redis]] = (
    weakref.WeakKeyDictionary())
_INCLUDE = re.compile(r"^-- include: (\S+\.lua)$", re.MULTILINE)
_CONSTANT = re.compile(r"@([A-Z_]+)@")
CONSTANTS = {"TOKENS_SUFFIX": TOKENS_SUFFIX, "LOGPROBS_SUFFIX": LOGPROBS_SUFFIX,
             "REQUEST_PREFIX": REQUEST_PREFIX, "LEASE_PREFIX": LEASE_PREFIX,
             "HELD_PREFIX": HELD_PREFIX, "RUN_PREFIX": RUN_PREFIX}


@cache
def source(name: str) -> str:
    """The text of ``lua/<name>`` with its includes put in place (each file once)."""
    return _expand(name, set())


def _expand(name: str, seen: set[str]) -> str:
    seen.add(name)
    text = files("manager_svc").joinpath("lua", name).read_text(encoding="utf-8")

    def include(m: re.Match[str]) -> str:
        return "" if m.group(1) in seen else _expand(m.group(1), seen)

    text = _INCLUDE.sub(include, text)
    return _CONSTANT.sub(lambda m: CONSTANTS[m.group(1)], text)


def register(redis: aioredis.Redis, name: str) -> AsyncScript:
    return redis.register_script(source(name))


@dataclass(frozen=True, slots=True)
class Call:
    """One script call of a batch: KEYS (the first one names its slot) and ARGV."""

    script: AsyncScript
    keys: list[str]
    args: list[Any]


async def run_batch(redis: aioredis.Redis, calls: list[Call], replicas: int = 0) -> list[Any]:
    """Run ``calls`` pipelined, in order, and return their replies in order; with
    ``replicas``, only once that many replicas of each node they ran on hold their writes.

    Sent as raw EVALSHA commands: a cluster client refuses a script's own pipelined call, and
    a plain pipeline of scripts asks SCRIPT EXISTS first, a round trip every batch. A node
    that lost its script cache (restarted) answers NOSCRIPT to each call of a script: those
    calls are sent again, in order, once it is loaded. Any other error is raised.

    Redis replicates asynchronously: a write a primary has answered can still be lost when a
    replica takes its place. So the batch ends, on each node's connection, with WAIT (which
    counts the replicas holding every write that connection sent). A node that answers with
    too few gets a write of its own on that slot and WAIT again, until enough replicas hold
    it (replication is one ordered stream, so they then hold the batch too); the replies are
    kept meanwhile, nothing is sent twice. A node that stops answering, or no longer serves
    the slot (failed over), may have lost the batch: :class:`ReplicationUnknown` (a
    RedisError) is raised, and the caller sends the batch again, whose part that survived
    reads as duplicates."""
    if not calls:
        return []
    replies, short = await _send(redis, calls, replicas)
    missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    if missing:
        for script in {id(calls[i].script): calls[i].script for i in missing}.values():
            await redis.script_load(script.script)
        again, short_again = await _send(redis, [calls[i] for i in missing], replicas)
        for i, reply in zip(missing, again, strict=True):
            replies[i] = reply
        short += short_again
    for reply in replies:
        if isinstance(reply, ResponseError):
            raise reply
    for key, node in short:
        await _replicated(redis, key, node, replicas)
    return replies


class ReplicationUnknown(RedisError):  # type: ignore[misc]  # redis-py is Any to mypy here
    """Whether a batch's writes outlived their node is unknown: send it again."""


async def _send(redis: aioredis.Redis, calls: list[Call], replicas: int
                ) -> tuple[list[Any], list[tuple[str, Any]]]:
    """The calls' replies, and (a key, its node: None on a plain client) of each node whose
    replicas fell short. A plain client's pipeline is one connection: its WAIT covers it."""
    if replicas and isinstance(redis, RedisCluster):
        return await _send_to_nodes(redis, calls, replicas)
    pipe = redis.pipeline(transaction=False)
    for call in calls:
        pipe.execute_command("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)
    if replicas:
        pipe.execute_command("WAIT", replicas, WAIT_MS)
    got = list(await pipe.execute(raise_on_error=False))
    if not replicas:
        return got, []
    if isinstance(got[-1], Exception):
        raise ReplicationUnknown(f"WAIT: {got[-1]}")
    return got[:-1], [(calls[-1].keys[0], None)] if int(got[-1]) < replicas else []


def _node_client(redis: RedisCluster, node: Any) -> aioredis.Redis:
    clients = _NODE_CLIENTS.setdefault(redis, {})
    if node.name not in clients:
        kwargs = {k: v for k, v in node.connection_kwargs.items() if k in _NODE_KWARGS}
        clients[node.name] = aioredis.Redis(host=node.host, port=node.port, **kwargs)
    return clients[node.name]


async def _on_node(redis: RedisCluster, node: Any, commands: list[tuple[Any, ...]],
                   replicas: int) -> list[Any]:
    """``commands`` then WAIT on one connection to ``node`` itself. The cluster client's
    pipeline cannot be trusted with WAIT: a retry or a MOVED resends a script to another node
    on another connection, while the WAIT is answered by the first. A redirect, a node that
    does not answer, or a WAIT that fails: the slot map is read again and
    :class:`ReplicationUnknown` raised (the caller sends the batch again)."""
    pipe = _node_client(redis, node).pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    pipe.execute_command("WAIT", replicas, WAIT_MS)
    try:
        got = list(await pipe.execute(raise_on_error=False))
    except RedisError as exc:
        got = [exc]
    # Script errors (NOSCRIPT included) are the caller's; any other is the node's.
    moved = [r for r in got if isinstance(r, _NOT_HERE) or (
        isinstance(r, RedisError) and not isinstance(r, ResponseError))]
    if moved or isinstance(got[-1], Exception):
        await redis.nodes_manager.initialize()
        raise ReplicationUnknown(f"batch on {node.name}: {(moved or got)[-1]}")
    return got


async def _send_to_nodes(redis: RedisCluster, calls: list[Call], replicas: int
                         ) -> tuple[list[Any], list[tuple[str, Any]]]:
    """:func:`_send` on a cluster with replicas to wait for: each node's calls and WAIT on
    that node's own connection, node after node."""
    groups: dict[str, tuple[Any, list[int]]] = {}
    for i, call in enumerate(calls):
        node = redis.get_node_from_key(call.keys[0])
        groups.setdefault(node.name, (node, []))[1].append(i)
    replies: list[Any] = [None] * len(calls)
    short: list[tuple[str, Any]] = []
    for node, idx in groups.values():
        got = await _on_node(redis, node, [
            ("EVALSHA", calls[i].script.sha, len(calls[i].keys), *calls[i].keys,
             *calls[i].args) for i in idx], replicas)
        for i, reply in zip(idx, got, strict=False):
            replies[i] = reply
        if int(got[-1]) < replicas:
            short.append((calls[idx[0]].keys[0], node))
    return replies, short


def wait_key(key: str) -> str:
    """A key of ``key``'s slot to write when waiting for replicas (its hash tag's)."""
    start = key.find("{")
    end = key.find("}", start + 1)
    tag = key[start:end + 1] if start >= 0 and end > start + 1 else "{" + key + "}"
    return f"rlb:replicated:{tag}"


async def _replicated(redis: aioredis.Redis, key: str, node: Any, replicas: int) -> None:
    """Wait until ``replicas`` replicas of the node serving ``key`` (``node`` on a cluster)
    hold every write it has had: a marker write on its slot and WAIT, on one connection;
    raise :class:`ReplicationUnknown` once it stops answering or serving the key."""
    delay = 0.05
    while True:
        marker = ("SET", wait_key(key), "1", "PX", 60_000)
        if isinstance(redis, RedisCluster):
            if redis.get_node_from_key(key).name != node.name:
                raise ReplicationUnknown(f"{node.name} failed over while its replicas lagged")
            acked = (await _on_node(redis, node, [marker], replicas))[-1]
        else:
            pipe = redis.pipeline(transaction=False)
            pipe.execute_command(*marker)
            pipe.execute_command("WAIT", replicas, WAIT_MS)
            try:
                acked = (await pipe.execute(raise_on_error=False))[-1]
            except RedisError as exc:
                raise ReplicationUnknown(f"the node of {key}: {exc}") from exc
            if isinstance(acked, Exception):
                raise ReplicationUnknown(f"WAIT on the node of {key}: {acked}")
        if int(acked) >= replicas:
            return
        log.warning("commits wait for %d Redis replica(s) of the node of %s: %d hold them",
                    replicas, key, int(acked))
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)
