"""What the manager's routes take from their app: the service, and a run that must exist.

Contract: :func:`get_service` yields the :class:`~manager_svc.service.ManagerService` that
:func:`manager_svc.app.create_app` keeps in ``app.state.service``; a route declares it as a
parameter of type :data:`Service`, which adds nothing to the OpenAPI document.
:func:`no_run` is the one 404 of an unknown run id; :func:`run_or_404` reads a run with it.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request

from manager_svc.service import ManagerService


async def get_service(request: Request) -> ManagerService:
    # async: FastAPI runs a plain function dependency in a worker thread, a hop per request.
    service: ManagerService = request.app.state.service
    return service


Service = Annotated[ManagerService, Depends(get_service)]


def no_run(run_id: str) -> HTTPException:
    return HTTPException(404, f"no run {run_id!r}")


async def run_or_404(service: ManagerService, run_id: str) -> dict[str, Any]:
    run = await service.runs.get(run_id)
    if run is None:
        raise no_run(run_id)
    return run
