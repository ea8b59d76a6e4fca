"""The manager's REST routes, one :class:`fastapi.APIRouter` per concern: health and metrics,
runs, a run's progress (steps, events, the live stream, samples), instances and the dashboard.

Each route takes the service through :data:`~manager_svc.routes.dependencies.Service` and
holds no state; :func:`manager_svc.app.create_app` assembles the routers with the guard, the
error handlers and the OpenAPI document.
"""
