"""What the weight service's routes take from their app: the service.

Contract: :func:`get_service` yields the :class:`~weight_svc.service.WeightService` that
:func:`weight_svc.app.create_app` keeps in ``app.state.service``; a route declares it as a
parameter of type :data:`Service`, which adds nothing to the OpenAPI document.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from weight_svc.service import WeightService

PREFIX = "/v1/weights"  # every route of a run's weights


async def get_service(request: Request) -> WeightService:
    # async: FastAPI runs a plain function dependency in a worker thread, a hop per request.
    service: WeightService = request.app.state.service
    return service


Service = Annotated[WeightService, Depends(get_service)]
