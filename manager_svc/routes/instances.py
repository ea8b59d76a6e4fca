"""The rollout instances: ``GET /v1/instances``, each with ``id``, ``kind``, ``state`` (a
quarantined one with its ``reason``), ``weight_version`` and ``engine``, as the registry has
them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from manager_svc.routes.dependencies import Service

router = APIRouter()


@router.get("/v1/instances")
async def instances(service: Service) -> list[dict[str, Any]]:
    """Each live instance: ``id``, ``kind``, ``engine``, ``state`` (starting, loading, ready,
    draining, or quarantined in the active run), ``reason`` (why it is quarantined, else
    null), ``run_id`` and ``weight_version`` loaded, ``capacity``, ``held`` (responses of the
    active run it holds), ``pid``, ``metrics_port``, ``last_seen``, ``joined_at``."""
    return await service.registry.instances()
