"""One real manager process on given brokers, and a REST client for it."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rlboost.launcher import Child
from rlboost.stack import Stack
from shared.ports import free_port


@contextlib.contextmanager
def running_manager(brokers: Stack, root: Path, env: dict[str, str] | None = None
                    ) -> Iterator[httpx.Client]:
    """A manager with ``env`` over the brokers' settings, stopped (SIGTERM) on exit."""
    port = free_port()
    child = Child("manager", [sys.executable, "-m", "manager_svc"], {
        **brokers.env(), "RLBOOST_MANAGER_URL": f"http://127.0.0.1:{port}",
        "RLBOOST_DATA_DIR": str(root / "data"), **(env or {}),
    }, root / "manager.log")
    child.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            end = time.monotonic() + 30
            while time.monotonic() < end:
                with contextlib.suppress(httpx.TransportError):
                    if client.get("/healthz").status_code == 200:
                        break
                time.sleep(0.05)
            else:
                pytest.fail(f"manager did not start:\n{child.tail()}")
            yield client
    finally:
        child.signal(15)
        if child.proc is not None:
            child.proc.wait(timeout=10)
