"""A manager's registry on a real, flushed Redis with one running run: the parts heartbeat and
late-write tests drive directly, without a manager process."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from manager_svc.accounting import Ledger
from manager_svc.archive import Archive
from manager_svc.crash import CrashPoints
from manager_svc.events import InstanceEvents
from manager_svc.metrics import ManagerMetrics
from manager_svc.registry import Registry
from manager_svc.runs import RunStore
from manager_svc.soft_state import SoftState
from rlboost.stack import Stack
from shared.bus import connect_redis
from shared.config import ManagerConfig
from shared.spec import RunSpec


@asynccontextmanager
async def registry_with_run(brokers: Stack, tmp_path: Path, lease_ttl_s: float,
                            retention_s: float = 86_400.0
                            ) -> AsyncIterator[tuple[Registry, str]]:
    """The registry, and a running run at step 0 of four responses (two prompts of two)."""
    redis = await connect_redis(brokers.redis.url)
    await redis.flushdb()
    archive = Archive(tmp_path)
    runs = RunStore(redis, archive, retention_s=retention_s)
    run_id = (await runs.create(RunSpec(model="emu", prompts_per_step=2,
                                        samples_per_prompt=2)))["id"]
    assert await runs.active() == run_id
    ledger = Ledger(redis, lease_ttl_s=lease_ttl_s)
    await ledger.create_step(run_id, 0, 0, [[1, 2], [3, 4]], samples=2, max_new_tokens=8)
    # An instance lapses with its leases: one beat renews both, to the same TTL.
    cfg = ManagerConfig.from_env({"RLBOOST_LEASE_TTL_S": str(lease_ttl_s),
                                  "RLBOOST_INSTANCE_TTL_S": str(lease_ttl_s)})
    registry = Registry(cfg, redis, ledger, runs, ManagerMetrics(), SoftState(),
                        InstanceEvents(redis, archive), CrashPoints("", tmp_path))
    try:
        yield registry, run_id
    finally:
        await redis.aclose()
