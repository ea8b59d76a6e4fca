"""Health and metrics: ``GET /healthz`` (the brokers answer; whether the API wants a token)
and ``GET /metrics`` (Prometheus text, the instance counts by kind refreshed on each read)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from manager_svc.routes.dependencies import Service
from shared.settings import reveal

router = APIRouter()


@router.get("/healthz")
async def healthz(service: Service) -> dict[str, Any]:
    await service.redis.ping()
    # "auth": whether the API wants a token; the dashboard asks for one before calling it.
    token = reveal(service.cfg.common.api_token)
    return {"ok": True, "nats": service.nc.is_connected, "auth": token is not None}


@router.get("/metrics")
async def metrics(service: Service) -> Response:
    alive: dict[str, int] = {"reserved": 0, "spot": 0}
    for inst in await service.registry.instances():
        alive[inst["kind"]] = alive.get(inst["kind"], 0) + 1
    for kind, count in alive.items():
        service.metrics.instances.labels(kind).set(count)
    return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)
