"""Publishing a version, the write token's routes: upload its files, commit it, pin it.

Contract: ``PUT .../files/{name}`` streams the body to the version's staging directory (never
whole in memory), up to RLBOOST_WEIGHTS_MAX_FILE_BYTES (413 past it; a client gone mid-upload
is a 400 and leaves nothing staged). ``POST .../commit`` publishes the staged files as a
manifest, collects the run's versions past RLBOOST_WEIGHTS_KEEP (never a pinned one, nor
fewer than the newest two) and announces the version on NATS; committing a published version
again answers its manifest. ``POST``/``DELETE .../pin`` keep a version from collection or
release it. A commit's collection and a pin of the same run never interleave.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Request
from starlette.requests import ClientDisconnect

from shared.weights.manifest import Manifest
from weight_svc.routes.dependencies import PREFIX, Service
from weight_svc.store import StoreError, check_ids

log = logging.getLogger("weight_svc.app")
_WRITE_BATCH = 1 << 20  # request pieces are small; one thread hop per MiB, not per piece

router = APIRouter(prefix=PREFIX)


@router.put("/{run_id}/{version}/files/{name}")
async def put_file(run_id: str, version: int, name: str, request: Request, service: Service
                   ) -> dict[str, Any]:
    store = service.store
    check_ids(run_id, version, name)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > store.limits.max_file_bytes:
        raise StoreError(413, f"{name}: larger than {store.limits.max_file_bytes} bytes")
    upload = await asyncio.to_thread(store.open_upload, run_id, version, name)
    try:
        batch = bytearray()
        async for piece in request.stream():
            batch += piece
            if len(batch) >= _WRITE_BATCH:
                await asyncio.to_thread(upload.write, bytes(batch))
                batch.clear()
        await asyncio.to_thread(upload.write, bytes(batch))
        await asyncio.to_thread(upload.finish)
    except ClientDisconnect:
        upload.abort()
        raise StoreError(400, f"{name}: client went away mid-upload") from None
    except BaseException:
        upload.abort()
        raise
    service.metrics.uploads.inc()
    service.metrics.bytes_received.inc(upload.size)
    return {"run_id": run_id, "version": version, "name": name, "size": upload.size}


@router.post("/{run_id}/{version}/commit", response_model=None)
async def commit(run_id: str, version: int, service: Service) -> Manifest:
    store, metrics = service.store, service.metrics
    check_ids(run_id, version)
    async with service.run_locks[run_id]:
        result, created = await asyncio.to_thread(store.commit, run_id, version)
        gone = await asyncio.to_thread(store.collect, run_id, service.cfg.keep_last, version)
    if gone:
        log.info("collected %s versions %s", run_id, gone)
        service.peers.forget(run_id, gone)
        metrics.collected.inc(len(gone))
    service.count_versions(run_id)
    if created:
        metrics.commits.inc()
        log.info("published %s/%d (%d files)", run_id, version, len(result["files"]))
        if await service.announcer.announce(run_id, version):
            metrics.announced.inc()
    return result


@router.post("/{run_id}/{version}/pin")
async def pin(run_id: str, version: int, service: Service) -> dict[str, Any]:
    async with service.run_locks[run_id]:  # a pin must not race a collection of the same version
        await asyncio.to_thread(service.store.pin, run_id, version)
    return {"run_id": run_id, "version": version, "pinned": True}


@router.delete("/{run_id}/{version}/pin")
async def unpin(run_id: str, version: int, service: Service) -> dict[str, Any]:
    await asyncio.to_thread(service.store.unpin, run_id, version)
    return {"run_id": run_id, "version": version, "pinned": False}
