"""Fixtures of the integration tier."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from rlboost.stack import Stack
from shared.bus import connect_redis


@pytest.fixture
async def store(brokers: Stack) -> AsyncIterator[aioredis.Redis]:
    """A client of the test's own, empty redis-server."""
    client = await connect_redis(brokers.redis.url)
    await client.flushdb()
    yield client
    await client.aclose()
