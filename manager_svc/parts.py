"""What the parts of :class:`manager_svc.service.ManagerService` share.

The service is composed of mixins (dispatch, chunk ingest, the trainer protocol), each in its own
module; this base declares, once, the attributes the service sets up and the methods one part
calls on another, so each mixin type-checks on its own.
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis
from nats.aio.client import Client as Nats

from manager_svc.accounting import Ledger
from manager_svc.metrics import ManagerMetrics
from manager_svc.runs import RunStore
from shared.config import ManagerConfig


class ManagerParts:
    cfg: ManagerConfig
    metrics: ManagerMetrics
    redis: aioredis.Redis
    nc: Nats
    ledger: Ledger
    runs: RunStore
    _wake: asyncio.Event  # set to make dispatch look again at once
    _stopping: bool  # set by stop(): background loops end at their next turn

    async def instances(self) -> list[dict[str, Any]]:
        raise NotImplementedError  # provided by ManagerService
