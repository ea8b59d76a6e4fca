"""The manager's Redis scripts: read from the ``.lua`` files in ``manager_svc/lua/``.

Contract: every atomic state change the manager makes in Redis (a commit, a lease, a revoke, a
heartbeat's registration, a run's activation) is one Lua script in its own file, shipped as
package data and read through :mod:`importlib.resources`, so an installed package finds them as
a source checkout does. Redis scripts cannot include one another, so a line
``-- include: NAME.lua`` is replaced by that file's text before the script is registered (the
ledger's helper functions live once, in ``common.lua``), and ``@NAME@`` by the constant of
:data:`CONSTANTS` of that name (key names stay defined once, in :mod:`shared.names`).
:func:`register` is called once per script and client, in the constructor of the part that
runs it; the client then runs it by SHA (EVALSHA, loading it again itself after a Redis restart).
"""

from __future__ import annotations

import re
from functools import cache
from importlib.resources import files

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from shared.names import TOKENS_SUFFIX

_INCLUDE = re.compile(r"^-- include: (\S+\.lua)$", re.MULTILINE)
_CONSTANT = re.compile(r"@([A-Z_]+)@")
CONSTANTS = {"TOKENS_SUFFIX": TOKENS_SUFFIX}


@cache
def source(name: str) -> str:
    """The text of ``lua/<name>`` with its includes put in place."""
    text = files("manager_svc").joinpath("lua", name).read_text(encoding="utf-8")
    text = _INCLUDE.sub(lambda m: source(m.group(1)), text)
    return _CONSTANT.sub(lambda m: CONSTANTS[m.group(1)], text)


def register(redis: aioredis.Redis, name: str) -> AsyncScript:
    return redis.register_script(source(name))
