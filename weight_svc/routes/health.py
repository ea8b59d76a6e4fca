"""Health and metrics: ``GET /healthz`` (``{"ok": true}``) and ``GET /metrics`` (Prometheus
text)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from weight_svc.routes.dependencies import Service

router = APIRouter()


@router.get("/healthz")
async def healthz() -> dict[str, bool]:
    return {"ok": True}


@router.get("/metrics")
async def prometheus(service: Service) -> Response:
    return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)
