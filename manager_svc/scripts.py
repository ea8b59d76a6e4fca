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

import re
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, ResponseError

from shared.names import HELD_PREFIX, LEASE_PREFIX, REQUEST_PREFIX, RUN_PREFIX, TOKENS_SUFFIX

_INCLUDE = re.compile(r"^-- include: (\S+\.lua)$", re.MULTILINE)
_CONSTANT = re.compile(r"@([A-Z_]+)@")
CONSTANTS = {"TOKENS_SUFFIX": TOKENS_SUFFIX, "REQUEST_PREFIX": REQUEST_PREFIX,
             "LEASE_PREFIX": LEASE_PREFIX, "HELD_PREFIX": HELD_PREFIX, "RUN_PREFIX": RUN_PREFIX}


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


async def run_batch(redis: aioredis.Redis, calls: list[Call]) -> list[Any]:
    """Run ``calls`` pipelined, in order, and return their replies in order.

    Sent as raw EVALSHA commands: a cluster client refuses a script's own pipelined call, and
    a plain pipeline of scripts asks SCRIPT EXISTS first, a round trip every batch. A node
    that lost its script cache (restarted) answers NOSCRIPT to each call of a script: those
    calls are sent again, in order, once it is loaded. Any other error is raised."""
    if not calls:
        return []
    replies = await _send(redis, calls)
    missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    if missing:
        for script in {id(calls[i].script): calls[i].script for i in missing}.values():
            await redis.script_load(script.script)
        again = await _send(redis, [calls[i] for i in missing])
        for i, reply in zip(missing, again, strict=True):
            replies[i] = reply
    for reply in replies:
        if isinstance(reply, ResponseError):
            raise reply
    return replies


async def _send(redis: aioredis.Redis, calls: list[Call]) -> list[Any]:
    pipe = redis.pipeline(transaction=False)
    for call in calls:
        pipe.execute_command("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)
    return list(await pipe.execute(raise_on_error=False))
