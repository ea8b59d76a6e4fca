"""The dashboard: its static files, mounted at ``/ui`` by the app, and ``/`` redirecting there.

The files hold no data: every figure on the page comes from the API with the bearer token the
page asks for.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

router = APIRouter()


def static_files() -> StaticFiles:
    """The page's files (``manager_svc/ui``), index.html at the mount's root."""
    return StaticFiles(directory=str(files("manager_svc").joinpath("ui")), html=True)


@router.get("/", include_in_schema=False)
async def root() -> RedirectResponse:
    return RedirectResponse("/ui/")
