"""The weight service's REST API: a thin layer over :class:`weight_svc.store.Store`.

Endpoints (every ``/v1`` one requires ``Authorization: Bearer <token>`` when a token is set:
the write token RLBOOST_WEIGHTS_TOKEN for PUT, commit and pin/unpin, the read token
RLBOOST_WEIGHTS_READ_TOKEN or the write token for the rest; a read token on a write route is
403. Tokens and body limits are checked before any body is read (:mod:`shared.http_guard`):
uploads up to RLBOOST_WEIGHTS_MAX_FILE_BYTES, every other body up to 64 KiB):
    GET    /healthz                                    {"ok": true}
    GET    /metrics                                    Prometheus text
    GET    /v1/weights/{run_id}                        {"run_id", "versions", "pinned"}
    GET    /v1/weights/{run_id}/latest                 manifest of the highest version
    PUT    /v1/weights/{run_id}/{version}/files/{name} body streamed to the staging directory
    POST   /v1/weights/{run_id}/{version}/commit       publish the staged files -> manifest
    GET    /v1/weights/{run_id}/{version}/manifest     manifest
    GET    /v1/weights/{run_id}/{version}/files/{name} the file; one ``Range: bytes=a-b`` -> 206
    POST   /v1/weights/{run_id}/{version}/pin          never collect this version
    DELETE /v1/weights/{run_id}/{version}/pin
    POST   /v1/weights/{run_id}/{version}/peers        {"url": "http://host:port"}: a peer
                                                       serves this version (expires in 60 s)
    GET    /v1/weights/{run_id}/{version}/peers        {"peers": [url, ...]}

Collection keeps the newest max(K, 2) versions (K = RLBOOST_WEIGHTS_KEEP) and every pinned one:
in synchronous training the step being rolled out uses the newest or, while the trainer publishes
the next, the one before, so an instance joining mid-step always finds its step's version. A
caller that holds a version longer (an evaluation, a slow step) pins it and unpins it after.

Downloads are served twice: by this API, and fast by the ``sendfile`` data plane of
:mod:`weight_svc.peers` on the port that manifest replies name in ``X-Rlboost-Data-Port``.

Contract: every error is JSON ``{"detail": ...}`` with a 4xx status (507 when the disk itself
fails); no traceback ever reaches a client. Bodies stream in both directions, so memory use does
not grow with file size. Downloads are served by our own range code rather than Starlette's
FileResponse (which supports ranges in this version) so that a bad range gets a JSON detail like
every other error and served bytes are counted. Ranges are parsed by the data plane's own
parser (:func:`shared.weights.range_server.parse_range`), so both ports answer alike.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections import defaultdict
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, BinaryIO

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from shared.config import WeightsConfig
from shared.http_guard import INFO_PATHS, Access, Guard, document, info_open
from shared.settings import reveal
from shared.weights.manifest import Manifest
from shared.weights.range_server import RangeError, parse_range
from weight_svc.announce import Announcer
from weight_svc.peers import (
    DATA_PORT_HEADER,
    DataPlane,
    PeerRegistry,
    bind_host,
    check_peer_url,
)
from weight_svc.store import Store, StoreError, StoreLimits, check_ids

log = logging.getLogger(__name__)

_WRITE_BATCH = 1 << 20  # request pieces are small; one thread hop per MiB, not per piece
_READ_BLOCK = 1 << 20
MAX_BODY = 64 << 10  # every body but an upload: a peer registration is ~50 bytes
_UPLOAD = re.compile(r"/v1/weights/[^/]+/[^/]+/files/[^/]+")
_WRITE = re.compile(r"/v1/weights/[^/]+/[^/]+/(commit|pin)")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.bytes_served = Counter("rlboost_weights_bytes_served", "File bytes sent", registry=r)
        self.bytes_received = Counter("rlboost_weights_bytes_received", "Upload bytes", registry=r)
        self.uploads = Counter("rlboost_weights_uploads", "Files uploaded", registry=r)
        self.commits = Counter("rlboost_weights_commits", "Versions published", registry=r)
        self.collected = Counter("rlboost_weights_collected", "Versions collected", registry=r)
        self.announced = Counter("rlboost_weights_announced", "Versions announced", registry=r)
        self.errors = Counter("rlboost_weights_errors", "Error replies", ["status"], registry=r)
        self.versions = Gauge(
            "rlboost_weights_versions", "Versions on disk", ["run_id"], registry=r
        )


def _error(status: int, detail: Any, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


class PeerIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(max_length=300)  # http://host:port of the peer's chunk server


def create_app(cfg: WeightsConfig, limits: StoreLimits | None = None) -> FastAPI:
    """The service; ``limits`` default to the configured ones (tests pass small chunks)."""
    store = Store(cfg.common.data_dir, limits or StoreLimits.of(cfg))
    write, read = reveal(cfg.token), reveal(cfg.read_token)
    metrics = Metrics()
    peers = PeerRegistry()
    host = bind_host(cfg.common.weights_url)
    readers = [t for t in (read, write) if t]
    data = DataPlane(store, host, cfg.data_port, readers, metrics.bytes_served.inc,
                     cfg.max_connections)
    info = None if info_open(cfg.common.expose, host) else "read"

    def rule(method: str, path: str) -> Access:
        if path.startswith("/v1/"):
            if method == "PUT" and _UPLOAD.fullmatch(path):
                return Access("write", store.limits.max_file_bytes)
            if _WRITE.fullmatch(path) and method in ("POST", "DELETE"):
                return Access("write", MAX_BODY)
            return Access("read", MAX_BODY)
        return Access(info if path in INFO_PATHS else None, MAX_BODY)
    announcer = Announcer(cfg.common.nats_url)
    run_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    nats_up = Gauge(
        "rlboost_weights_nats_connected", "1 if NATS is connected", registry=metrics.registry
    )
    nats_up.set_function(lambda: float(announcer.connected))

    def count_versions(run_id: str) -> None:
        metrics.versions.labels(run_id).set(len(store.versions(run_id)))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(store.sweep)
        for run_id in await asyncio.to_thread(store.runs):
            count_versions(run_id)
        announcer.start()
        data.start()
        log.info("data plane (sendfile downloads) on port %d", data.port)
        try:
            yield
        finally:
            await asyncio.to_thread(data.close)
            await announcer.close()

    app = FastAPI(title="rlboost weight service", version="0.1.0", lifespan=lifespan)
    app.add_middleware(Guard, rule=rule,
                       tokens={"read": readers, "write": [write] if write else []})

    @app.exception_handler(StoreError)
    async def on_store_error(request: Request, exc: StoreError) -> JSONResponse:
        metrics.errors.labels(str(exc.status)).inc()
        return _error(exc.status, exc.detail)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
        metrics.errors.labels(str(exc.status_code)).inc()
        return _error(exc.status_code, exc.detail, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.errors.labels("422").inc()
        return _error(422, [{"loc": e["loc"], "msg": e["msg"]} for e in exc.errors()])

    @app.exception_handler(OSError)
    async def on_disk_error(request: Request, exc: OSError) -> JSONResponse:
        log.error("storage failure on %s %s: %s", request.method, request.url.path, exc)
        metrics.errors.labels("507").inc()
        return _error(507, f"storage failure: {exc.strerror or type(exc).__name__}")

    @app.get("/healthz")
    async def healthz() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    v1 = APIRouter(prefix="/v1/weights")

    @v1.get("/{run_id}")
    async def list_versions(run_id: str) -> dict[str, Any]:
        versions = await asyncio.to_thread(store.versions, run_id)
        pinned = await asyncio.to_thread(store.pins, run_id)
        return {"run_id": run_id, "versions": versions, "pinned": pinned}

    @v1.get("/{run_id}/latest", response_model=None)
    async def latest(run_id: str) -> Manifest:
        return await asyncio.to_thread(store.latest, run_id)

    @v1.get("/{run_id}/{version}/manifest", response_model=None)
    async def manifest(run_id: str, version: int, response: Response) -> Manifest:
        result = await asyncio.to_thread(store.manifest, run_id, version)
        response.headers[DATA_PORT_HEADER] = str(data.port)
        return result

    @v1.post("/{run_id}/{version}/peers")
    async def add_peer(run_id: str, version: int, body: PeerIn) -> dict[str, Any]:
        url = check_peer_url(body.url)
        await asyncio.to_thread(store.manifest, run_id, version)  # published versions only
        ttl = peers.register(run_id, version, url)
        return {"run_id": run_id, "version": version, "url": url, "ttl_s": ttl}

    @v1.get("/{run_id}/{version}/peers")
    async def list_peers(run_id: str, version: int) -> dict[str, Any]:
        check_ids(run_id, version)
        return {"run_id": run_id, "version": version, "peers": peers.peers(run_id, version)}

    @v1.put("/{run_id}/{version}/files/{name}")
    async def put_file(run_id: str, version: int, name: str, request: Request) -> dict[str, Any]:
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
        metrics.uploads.inc()
        metrics.bytes_received.inc(upload.size)
        return {"run_id": run_id, "version": version, "name": name, "size": upload.size}

    @v1.post("/{run_id}/{version}/commit", response_model=None)
    async def commit(run_id: str, version: int) -> Manifest:
        check_ids(run_id, version)
        async with run_locks[run_id]:
            result, created = await asyncio.to_thread(store.commit, run_id, version)
            gone = await asyncio.to_thread(store.collect, run_id, cfg.keep_last, version)
        if gone:
            log.info("collected %s versions %s", run_id, gone)
            peers.forget(run_id, gone)
            metrics.collected.inc(len(gone))
        count_versions(run_id)
        if created:
            metrics.commits.inc()
            log.info("published %s/%d (%d files)", run_id, version, len(result["files"]))
            if await announcer.announce(run_id, version):
                metrics.announced.inc()
        return result

    @v1.post("/{run_id}/{version}/pin")
    async def pin(run_id: str, version: int) -> dict[str, Any]:
        async with run_locks[run_id]:  # a pin must not race a collection of the same version
            await asyncio.to_thread(store.pin, run_id, version)
        return {"run_id": run_id, "version": version, "pinned": True}

    @v1.delete("/{run_id}/{version}/pin")
    async def unpin(run_id: str, version: int) -> dict[str, Any]:
        await asyncio.to_thread(store.unpin, run_id, version)
        return {"run_id": run_id, "version": version, "pinned": False}

    @v1.get("/{run_id}/{version}/files/{name}")
    async def get_file(run_id: str, version: int, name: str, request: Request) -> Response:
        path = await asyncio.to_thread(store.file_path, run_id, version, name)
        f = await asyncio.to_thread(path.open, "rb")  # held open: a collection cannot cut us off
        size = os.fstat(f.fileno()).st_size
        headers = {"Accept-Ranges": "bytes"}
        status, start, end = 200, 0, size
        if (header := request.headers.get("range")) is not None:
            try:
                start, end = parse_range(header, size)
            except RangeError as exc:
                f.close()
                metrics.errors.labels("416").inc()
                return _error(416, exc.detail, {"Content-Range": f"bytes */{size}"})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        headers["Content-Length"] = str(end - start)
        body = _stream(f, start, end, metrics)
        return StreamingResponse(body, status, headers, "application/octet-stream")

    app.include_router(v1)
    describe = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = document(describe(), rule, _errors, {
                "read": "RLBOOST_WEIGHTS_READ_TOKEN (or the write token)",
                "write": "RLBOOST_WEIGHTS_TOKEN"})
            file = doc["paths"]["/v1/weights/{run_id}/{version}/files/{name}"]["get"]
            octets = {"application/octet-stream": {"schema": {"type": "string",
                                                              "format": "binary"}}}
            file["responses"]["200"] = {"description": "The file", "content": octets}
            file["responses"]["206"] = {"description": "One byte range of it",
                                        "content": octets}
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _errors(method: str, path: str) -> set[int]:
    """The statuses a route answers besides success and the guard's (OpenAPI)."""
    if not path.startswith("/v1/"):
        return set()
    codes = {404, 422, 507}
    if path.endswith("/files/{name}"):
        codes |= {400, 409} if method == "PUT" else {416}
    if path.endswith("/commit") or path.endswith("/pin"):
        codes |= {409}
    if path.endswith("/peers") and method == "POST":
        codes |= {429}
    return codes


async def _stream(f: BinaryIO, start: int, end: int, metrics: Metrics) -> AsyncIterator[bytes]:
    try:
        offset = start
        while offset < end:
            block = await asyncio.to_thread(
                os.pread, f.fileno(), min(_READ_BLOCK, end - offset), offset
            )
            if not block:
                break  # the file shrank; the client's length check catches it
            offset += len(block)
            metrics.bytes_served.inc(len(block))
            yield block
    finally:
        f.close()
