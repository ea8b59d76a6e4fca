"""The manager's REST API (the design's interface; clients and harnesses rely on it verbatim).

Contract: JSON in and out; every error is a 4xx with a ``detail`` message. Validation errors are
422, unknown ids 404, a missing or wrong bearer token 401 (only when RLBOOST_API_TOKEN is set).
A broker outage is a 503 with a ``detail``; nothing reaches a user as a traceback. The routes
read through the service's parts (the run store, the instance registry); none holds state.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError

from manager_svc.runs import RunSpec
from manager_svc.service import ManagerService
from shared.settings import reveal

log = logging.getLogger("manager.api")


def create_app(service: ManagerService, manage_lifecycle: bool = True) -> FastAPI:
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
    token = reveal(service.cfg.common.api_token)

    async def auth(request: Request) -> None:
        if token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
            raise HTTPException(401, "missing or wrong bearer token",
                                headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type")}
                  for e in exc.errors()]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(RedisError)
    async def broker_down(_: Request, exc: RedisError) -> JSONResponse:
        log.warning("redis unavailable: %s", exc)
        return JSONResponse({"detail": "state store unavailable, retry shortly"}, status_code=503)

    async def run_or_404(run_id: str) -> dict[str, Any]:
        run = await service.runs.get(run_id)
        if run is None:
            raise HTTPException(404, f"no run {run_id!r}")
        return run

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        await service.redis.ping()
        return {"ok": True, "nats": service.nc.is_connected}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/runs", status_code=201, dependencies=[Depends(auth)])
    async def create_run(spec: RunSpec | None = None) -> dict[str, Any]:
        run = await service.runs.create(spec or RunSpec())
        service.soft.wake.set()
        return run

    @app.get("/v1/runs", dependencies=[Depends(auth)])
    async def list_runs() -> list[dict[str, Any]]:
        return await service.runs.list_runs()

    @app.get("/v1/runs/{run_id}", dependencies=[Depends(auth)])
    async def get_run(run_id: str) -> dict[str, Any]:
        run = await run_or_404(run_id)
        run["progress"] = await service.runs.step_progress(run_id, run["step"])
        return run

    @app.post("/v1/runs/{run_id}/cancel", dependencies=[Depends(auth)])
    async def cancel_run(run_id: str) -> dict[str, Any]:
        run = await service.runs.cancel(run_id)
        if run is None:
            raise HTTPException(404, f"no run {run_id!r}")
        return run

    @app.get("/v1/runs/{run_id}/steps", dependencies=[Depends(auth)])
    async def run_steps(run_id: str) -> list[dict[str, Any]]:
        await run_or_404(run_id)
        return await service.runs.step_records(run_id)

    @app.get("/v1/runs/{run_id}/steps/{step}/samples", dependencies=[Depends(auth)])
    async def step_samples(run_id: str, step: int) -> list[dict[str, Any]]:
        await run_or_404(run_id)
        samples = await service.runs.samples(run_id, step)
        if samples is None:
            raise HTTPException(404, f"step {step} of {run_id} has not finished")
        return samples

    @app.get("/v1/instances", dependencies=[Depends(auth)])
    async def instances() -> list[dict[str, Any]]:
        return await service.registry.instances()

    return app
