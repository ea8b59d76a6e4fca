"""Which manager replica dispatches: a lease in Redis, taken and renewed by one at a time.

Contract: any number of manager replicas may run against one Redis and one NATS. Each serves
REST and answers the bus (NATS queue groups spread the requests), and ingest is one pinned
JetStream consumer (:func:`manager_svc.ingest.bind_consumer`); dispatch, reaping dead
instances and expiring leases run only in the replica holding this lease
(``lua/leader.lua``: SET with a TTL, renewed by its holder, compare-and-set so no replica
renews or drops another's). A leader that dies stops renewing and another takes over within a
TTL; a leader cut off from Redis stops dispatching once its last renewal is older than the
TTL, before any other can take the lease. Two dispatchers for a moment would still be safe,
only wasteful: every assignment and revocation is one fenced script (:mod:`.accounting`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from manager_svc.metrics import ManagerMetrics
from manager_svc.scripts import register

log = logging.getLogger("manager")


def replica_id() -> str:
    """A name no other manager process shares, readable in logs: host, pid, a random tag."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Leadership:
    def __init__(self, redis: aioredis.Redis, key: str, holder: str, ttl_s: float,
                 metrics: ManagerMetrics) -> None:
        self.key = key
        self.holder = holder
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.metrics = metrics
        self._script = register(redis, "leader.lua")
        self._renew_every = ttl_s / 3
        self._asked = float("-inf")  # monotonic time of the last renewal attempt
        self._valid_until = float("-inf")  # the lease is ours until then, as far as we know

    async def held(self) -> bool:
        """Whether this replica leads now; takes or renews the lease when one is due."""
        now = time.monotonic()
        if now - self._asked >= self._renew_every:
            self._asked = now
            was = self.leading(now)
            try:
                got = int(await self._script(keys=[self.key], args=[self.holder, self.ttl_ms]))
            except RedisError as exc:
                log.warning("dispatch lease not renewed: %s", exc)
                got = 0
            # Counted from before the request: the lease may have been set any time after.
            self._valid_until = now + self.ttl_ms / 1000 if got else float("-inf")
            if self.leading(now) != was:
                log.info("dispatch: this replica %s the lead (%s)",
                         "takes" if got else "loses", self.holder)
            self.metrics.dispatch_leader.set(int(got))
        return self.leading(time.monotonic())

    def leading(self, now: float) -> bool:
        return now < self._valid_until

    async def release(self) -> None:
        """Give the lease up (a clean stop): another replica leads at its next try."""
        if self.leading(time.monotonic()):
            self._valid_until = float("-inf")
            self.metrics.dispatch_leader.set(0)
            try:
                await self._script(keys=[self.key], args=[self.holder, 0])
            except RedisError as exc:
                log.warning("dispatch lease not released (it expires): %s", exc)
