"""Script batches against a real redis-server: in order, through a lost script cache."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from manager_svc.scripts import Call, run_batch, source

APPEND = "redis.call('APPEND', KEYS[1], ARGV[1]); return redis.call('GET', KEYS[1])"


async def test_a_batch_runs_in_order_and_reloads_a_lost_cache(store: aioredis.Redis) -> None:
    append = store.register_script(APPEND)
    calls = [Call(append, ["k"], [c]) for c in "abc"]
    assert await run_batch(store, calls) == ["a", "ab", "abc"]
    await store.script_flush()  # what a restarted Redis has: no scripts
    assert await run_batch(store, calls) == ["abca", "abcab", "abcabc"]
    assert await run_batch(store, []) == []


async def test_a_script_error_is_raised_not_returned(store: aioredis.Redis) -> None:
    failing = store.register_script("return redis.error_reply('refused')")
    append = store.register_script(APPEND)
    with pytest.raises(ResponseError, match="refused"):
        await run_batch(store, [Call(append, ["k"], ["x"]), Call(failing, ["k"], [])])
    assert await store.get("k") == "x"  # the calls before it ran: a batch is no transaction


def test_every_include_is_expanded_once() -> None:
    text = source("beat_run.lua")  # includes observe.lua and renew.lua, which includes keys.lua
    assert "-- include:" not in text and "@" not in text.replace("'@'", "")
    assert text.count("local function tagged(") == 1
    assert "local function renew_leases(" in text and "local function observe(" in text
