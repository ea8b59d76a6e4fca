"""A run's published versions: the list (with the pinned ones), the newest one's manifest and
any version's manifest.

Contract: a manifest reply names the data plane's port in ``X-Rlboost-Data-Port``, where the
same files are served by ``sendfile`` (:mod:`weight_svc.peers`). A version not published (or
collected) is a 404.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Response

from shared.weights.manifest import Manifest
from weight_svc.peers import DATA_PORT_HEADER
from weight_svc.routes.dependencies import PREFIX, Service

router = APIRouter(prefix=PREFIX)


@router.get("/{run_id}")
async def list_versions(run_id: str, service: Service) -> dict[str, Any]:
    versions = await asyncio.to_thread(service.store.versions, run_id)
    pinned = await asyncio.to_thread(service.store.pins, run_id)
    return {"run_id": run_id, "versions": versions, "pinned": pinned}


@router.get("/{run_id}/latest", response_model=None)
async def latest(run_id: str, service: Service) -> Manifest:
    return await asyncio.to_thread(service.store.latest, run_id)


@router.get("/{run_id}/{version}/manifest", response_model=None)
async def manifest(run_id: str, version: int, response: Response, service: Service
                   ) -> Manifest:
    result = await asyncio.to_thread(service.store.manifest, run_id, version)
    response.headers[DATA_PORT_HEADER] = str(service.data.port)
    return result
