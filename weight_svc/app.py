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

A manifest may carry ``delta`` (``{"base", "file", "sections"}``, :mod:`shared.weights.delta`):
the version as a compressed XOR against version ``base`` = version - 1, built at commit when
that one is published and the delta is at most half the version's bytes. Its blob is served as
the version's file ``file.name`` (``rlboost-delta-<base>``, a name no upload may take) by both
download routes; it is not among ``files``.

Collection keeps the newest max(K, 2) versions (K = RLBOOST_WEIGHTS_KEEP) and every pinned one:
in synchronous training the step being rolled out uses the newest or, while the trainer publishes
the next, the one before, so an instance joining mid-step always finds its step's version. A
caller that holds a version longer (an evaluation, a slow step) pins it and unpins it after.

Downloads are served twice: by this API, and fast by the ``sendfile`` data plane of
:mod:`weight_svc.peers` on the port that manifest replies name in ``X-Rlboost-Data-Port``.

Contract: every error is JSON ``{"detail": ...}`` with a 4xx status (507 when the disk itself
fails), counted by status; no traceback ever reaches a client. Bodies stream in both directions,
so memory use does not grow with file size.

:func:`create_app` only assembles: the lifespan of the service's parts
(:class:`~weight_svc.service.WeightService`), the guard, the error handlers, the routers of
:mod:`weight_svc.routes` (one per concern, each taking the service from ``app.state`` by
dependency) and the document.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from shared.config import WeightsConfig
from shared.http_guard import INFO_PATHS, Access, Guard, Rule, document, info_open
from weight_svc.routes import downloads, health, peers, publish, versions
from weight_svc.service import WeightService
from weight_svc.store import StoreError, StoreLimits

log = logging.getLogger(__name__)

MAX_BODY = 64 << 10  # every body but an upload: a peer registration is ~50 bytes
_UPLOAD = re.compile(r"/v1/weights/[^/]+/[^/]+/files/[^/]+")
_WRITE = re.compile(r"/v1/weights/[^/]+/[^/]+/(commit|pin)")


def create_app(cfg: WeightsConfig, limits: StoreLimits | None = None) -> FastAPI:
    """The service; ``limits`` default to the configured ones (tests pass small chunks)."""
    service = WeightService(cfg, limits)
    info = None if info_open(cfg.common.expose, service.host) else "read"
    rule = access_rule(service.store.limits.max_file_bytes, info)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="rlboost weight service", version="0.1.0", lifespan=lifespan)
    app.state.service = service
    app.add_middleware(Guard, rule=rule,
                       tokens={"read": service.readers, "write": service.writers})
    app.exception_handler(StoreError)(on_store_error)
    app.exception_handler(HTTPException)(on_http_error)
    app.exception_handler(RequestValidationError)(on_invalid)
    app.exception_handler(OSError)(on_disk_error)
    for router in (health.router, versions.router, peers.router, publish.router,
                   downloads.router):
        app.include_router(router)
    describe(app, rule)
    return app


def access_rule(max_file_bytes: int, info: str | None) -> Rule:
    """The guard's rule: an upload wants the write token and takes up to ``max_file_bytes``;
    a commit or a pin (or unpin) wants the write token; every other ``/v1`` route the read
    token; /metrics and the docs the read token when ``info`` is "read"."""
    def rule(method: str, path: str) -> Access:
        if path.startswith("/v1/"):
            if method == "PUT" and _UPLOAD.fullmatch(path):
                return Access("write", max_file_bytes)
            if _WRITE.fullmatch(path) and method in ("POST", "DELETE"):
                return Access("write", MAX_BODY)
            return Access("read", MAX_BODY)
        return Access(info if path in INFO_PATHS else None, MAX_BODY)
    return rule


def _error(status: int, detail: Any, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def _count(request: Request, status: int | str) -> None:
    service: WeightService = request.app.state.service
    service.metrics.errors.labels(str(status)).inc()


async def on_store_error(request: Request, exc: StoreError) -> JSONResponse:
    _count(request, exc.status)
    return _error(exc.status, exc.detail)


async def on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    _count(request, exc.status_code)
    return _error(exc.status_code, exc.detail, exc.headers)


async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    _count(request, "422")
    return _error(422, [{"loc": e["loc"], "msg": e["msg"]} for e in exc.errors()])


async def on_disk_error(request: Request, exc: OSError) -> JSONResponse:
    log.error("storage failure on %s %s: %s", request.method, request.url.path, exc)
    _count(request, "507")
    return _error(507, f"storage failure: {exc.strerror or type(exc).__name__}")


def describe(app: FastAPI, rule: Rule) -> None:
    """Serve FastAPI's document with the bearer scheme, every error status, and a download's
    body as octets (whole, 200, or one range, 206), made once on first read."""
    fastapi_document = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = document(fastapi_document(), rule, _errors, {
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
