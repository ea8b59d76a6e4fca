"""The manager's REST API (the design's interface; clients and harnesses rely on it verbatim).

Contract: JSON in and out; every error is a 4xx with a ``detail`` message. Validation errors are
422, unknown ids 404, a missing or wrong bearer token 401 (only when RLBOOST_API_TOKEN is set),
a body over RLBOOST_MAX_BODY_BYTES 413; the token and the size are checked before any body is
read (:mod:`shared.http_guard`). ``/metrics`` and the docs are open or behind the token as
RLBOOST_EXPOSE says. A broker outage is a 503 with a ``detail``; nothing reaches a user as a
traceback. The OpenAPI document declares the bearer scheme and every error status.

:func:`create_app` only assembles: the service's lifespan, the guard, the error handlers, the
routers of :mod:`manager_svc.routes` (one per concern, each taking the service from
``app.state`` by dependency) and the document. The routes read through the service's parts
(the run store, the instance registry); none holds state.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from manager_svc.routes import dashboard, health, instances, progress, runs
from manager_svc.service import ManagerService
from shared.http_guard import INFO_PATHS, Access, Guard, Rule, document, info_open
from shared.settings import reveal

log = logging.getLogger("manager.api")


def create_app(service: ManagerService, manage_lifecycle: bool = True,
               bind_host: str = "127.0.0.1") -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_lifecycle:
            await service.start()
        try:
            yield
        finally:
            if manage_lifecycle:
                await service.stop()

    app = FastAPI(title="rlboost manager", version="0.1.0", lifespan=lifespan)
    app.state.service = service
    token = reveal(service.cfg.common.api_token)
    info = None if info_open(service.cfg.common.expose, bind_host) else "api"
    rule = access_rule(service.cfg.max_body_bytes, info)
    app.add_middleware(Guard, rule=rule, tokens={"api": [token] if token else []})
    app.exception_handler(RequestValidationError)(invalid)
    app.exception_handler(RedisError)(broker_down)
    for router in (health.router, runs.router, progress.router, instances.router):
        app.include_router(router)
    app.mount("/ui", dashboard.static_files(), name="ui")
    app.include_router(dashboard.router)
    describe(app, rule)
    return app


def access_rule(limit: int, info: str | None) -> Rule:
    """The guard's rule: every ``/v1`` route wants the API token; /metrics and the docs want
    it when ``info`` is "api"; every body is held to ``limit`` bytes."""
    def rule(method: str, path: str) -> Access:
        if path.startswith("/v1/"):
            return Access("api", limit)
        return Access(info if path in INFO_PATHS else None, limit)
    return rule


async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type")}
              for e in exc.errors()]
    return JSONResponse({"detail": errors}, status_code=422)


async def broker_down(_: Request, exc: RedisError) -> JSONResponse:
    log.warning("redis unavailable: %s", exc)
    return JSONResponse({"detail": "state store unavailable, retry shortly"}, status_code=503)


def describe(app: FastAPI, rule: Rule) -> None:
    """Serve FastAPI's document with the run spec's schemas beside its own, the bearer scheme
    and every error status, made once on first read."""
    fastapi_document = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = fastapi_document()
            doc.setdefault("components", {}).setdefault("schemas", {}).update(runs.SPEC_SCHEMAS)
            document(doc, rule, _errors, {"api": "RLBOOST_API_TOKEN"})
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]


def _errors(method: str, path: str) -> set[int]:
    """The statuses a route answers besides success and the guard's (OpenAPI)."""
    codes = {503} if path != "/metrics" and not path.startswith("/docs") else set()
    if "{run_id}" in path:
        codes |= {404, 422}
    if method == "POST" and path == "/v1/runs":
        codes |= {422, 429}
    if method == "GET" and path == "/v1/runs":
        codes |= {422}
    if path.endswith("/resume"):
        codes |= {409}
    return codes
