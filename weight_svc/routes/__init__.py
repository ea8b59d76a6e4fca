"""The weight service's REST routes, one :class:`fastapi.APIRouter` per concern: health and
metrics, versions and manifests, peers, publishing (uploads, commits, pins: the write token)
and downloads.

Each route takes the service through :data:`~weight_svc.routes.dependencies.Service` and holds
no state; :func:`weight_svc.app.create_app` assembles the routers with the guard, the error
handlers and the OpenAPI document.
"""
