"""Quarantine: an instance that sends garbage, or cannot serve the run's model, gets no more work.

Contract: a quarantine is Redis data, a field of the run's ``Keys.quarantined`` hash (instance
id -> reason) that expires ``ttl_s`` after the latest one was imposed: a restarted manager, or
another replica, keeps skipping the instance. Imposing it revokes the instance's leases through
the ledger (so fencing drops whatever it still sends for them), tells it to stop on them, and
notes the reason among the run's warnings and events; the registry lists the instance as
``state: "quarantined"`` with its ``reason``, and the dispatcher leases it nothing.

Two causes. Ingest tells :meth:`Quarantine.reject` of every entry it drops before a commit (bad
MAC, bad offset, a token id outside the vocabulary), which tallies them per (run, instance):
``after`` of them in a run quarantine the sender. Counting them in metrics and the step's
record, and logging them, is :class:`manager_svc.chunk_auth.Rejections`' alone. The dispatcher's
:meth:`Quarantine.screen` quarantines an instance whose engine cannot serve the run's model at
all (:func:`shared.spec.engine_mismatch`) before it is leased anything, and
:meth:`Quarantine.watch` puts in the run's record that no instance can serve it, and fails the
run, naming why, once that has lasted ``fail_s``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis.asyncio as aioredis
from nats.aio.client import Client as Nats

from manager_svc.accounting import Ledger
from manager_svc.events import InstanceEvents
from manager_svc.metrics import ManagerMetrics
from manager_svc.registry import assign_subjects
from manager_svc.runs import RunStore
from manager_svc.soft_state import SoftState
from shared.names import Keys
from shared.protocol import Revoke, encode
from shared.spec import engine_mismatch

log = logging.getLogger("manager")
# With no instance registered at all the run waits (spot machines come and go) but says so
# after this long; with instances that all are quarantined it says so after WARN_S.
NONE_WARN_S, WARN_S = 30.0, 5.0
TALLY_MAX = 4096  # (run, instance) pairs whose drops are counted in memory
REASONS_SHOWN = 4  # instances named in a warning or error (then "and N more")
class Quarantine:
    def __init__(self, redis: aioredis.Redis, nc: Nats, ledger: Ledger, runs: RunStore,
                 metrics: ManagerMetrics, soft: SoftState, after: int = 16,
                 ttl_s: float = 3600.0, fail_s: float = 60.0) -> None:
        self.r = redis
        self.nc = nc
        self.ledger = ledger
        self.runs = runs
        self.metrics = metrics
        self.soft = soft
        self.after = after  # dropped entries that quarantine their sender (0: never)
        self.ttl_ms = int(ttl_s * 1000)
        self.fail_s = fail_s
        self._tally: dict[tuple[str, str, str], int] = {}  # (run, instance, key) -> dropped
        self._models: dict[str, str] = {}  # run id -> its spec's model
        self._unserved: dict[str, float] = {}  # run id -> since when no instance serves it
        self._warned: set[tuple[str, str]] = set()  # (run id, warning) noted already

    async def reject(self, run_id: str, instance_id: str, why: str, key: str = "") -> None:
        """Ingest dropped an entry of ``instance_id`` in ``run_id`` (its subject's) for
        ``why``: tally it, and quarantine the sender at ``after``. ``key``: the sender's key
        fingerprint its subject names ("" none). Entries are tallied per key, and an id is
        quarantined only for those of the key its accepted beats name: an older connection
        under the id (its binding lapsed, a newer process logged in under it) cannot have the
        newer process quarantined."""
        tally = (run_id, instance_id, key)
        if tally not in self._tally and len(self._tally) >= TALLY_MAX:
            self._tally.clear()
        total = self._tally[tally] = self._tally.get(tally, 0) + 1
        if self.after and total == self.after and (
                not key or await self.r.hget(Keys.instance(instance_id), "fp") == key):
            await self.impose(run_id, instance_id, f"{total} invalid entries, the last: {why}",
                              "invalid")

    async def impose(self, run_id: str, instance_id: str, reason: str, cause: str) -> bool:
        """Give ``instance_id`` no more work in ``run_id``; whether it was not already so.
        Only in a running run: a frame's subject names any run its sender likes, and keys of
        a run that does not exist (or has ended) would never expire with it."""
        if await self.r.hget(Keys.run(run_id), "state") != "running":
            return False
        key = Keys.quarantined(run_id)
        pipe = self.r.pipeline(transaction=True)  # one key: one slot
        pipe.hsetnx(key, instance_id, reason)
        pipe.pexpire(key, self.ttl_ms)
        new, _ = await pipe.execute()
        if not new:
            return False
        self.metrics.quarantined.labels(cause).inc()
        log.warning("instance %s quarantined in run %s: %s", instance_id, run_id[:64], reason)
        held = sorted(await self.r.smembers(Keys.held(run_id, instance_id)))
        revoked = [rid for rid in held if await self.ledger.revoke(rid)]
        if revoked:
            self.metrics.revocations.labels("quarantine").inc(len(revoked))
            [subject] = await assign_subjects(self.r, [instance_id])
            await self.nc.publish(subject, encode(Revoke(request_ids=revoked)))
        await self.runs.warn(run_id, f"instance {instance_id} quarantined: {reason}")
        await InstanceEvents(self.r, self.runs.archive).quarantined(run_id, instance_id, reason)
        self.soft.wake.set()  # its responses are pending again
        return True

    async def reasons(self, run_id: str) -> dict[str, str]:
        """The run's quarantined instances, each with its reason."""
        return dict(await self.r.hgetall(Keys.quarantined(run_id)))

    async def screen(self, run_id: str, instances: list[dict[str, Any]]) -> None:
        """Quarantine the instances (rows of Registry.instances) whose engine cannot serve
        the run's model, marking their rows as the registry would list them now."""
        model = self._models.get(run_id)
        if model is None:
            spec = await self.runs.spec(run_id)
            if spec is None:
                return
            if len(self._models) >= TALLY_MAX:
                self._models.clear()
            model = self._models[run_id] = spec.model
        for inst in instances:
            why = engine_mismatch(str(inst["engine"]), model) if inst["engine"] else None
            if inst["state"] != "quarantined" and why is not None:
                await self.impose(run_id, inst["id"], why, "mismatch")
                inst["state"], inst["reason"] = "quarantined", why

    async def watch(self, run_id: str, instances: list[dict[str, Any]]) -> None:
        """The run has work pending and these instances: say in its record when none can
        serve it, and fail it once every one has been quarantined for ``fail_s``."""
        now = time.monotonic()
        if any(i["state"] != "quarantined" for i in instances):
            self._unserved.pop(run_id, None)
            return
        since = self._unserved.setdefault(run_id, now)
        if not instances:
            if now - since >= NONE_WARN_S:
                await self._warn(run_id, "no rollout instance is registered: the run waits "
                                 "for one")
            return
        shown = "; ".join(f"{i['id']}: {i['reason']}" for i in instances[:REASONS_SHOWN])
        if len(instances) > REASONS_SHOWN:
            shown += f"; and {len(instances) - REASONS_SHOWN} more"
        if now - since >= min(WARN_S, self.fail_s):
            await self._warn(run_id, "no instance can serve this run: every live one is "
                             "quarantined")
        if now - since >= self.fail_s:
            error = f"no instance could serve this run for {self.fail_s:g}s ({shown})"
            log.error("run %s failed: %s", run_id[:64], error)
            self._unserved.pop(run_id, None)
            await self.runs.clear_active(run_id)  # before it is failed, as the trainer does
            await self.runs.set_state(run_id, "failed", error[:2000])

    async def _warn(self, run_id: str, warning: str) -> None:
        """Note ``warning`` once (the store keeps it once too, but reading its list each
        dispatch pass would cost a round trip every pass)."""
        if (run_id, warning) not in self._warned:
            if len(self._warned) >= TALLY_MAX:
                self._warned.clear()
            self._warned.add((run_id, warning))
            await self.runs.warn(run_id, warning)
