"""Loopback ports: a free one to listen on, and waiting until something listens on one.

Contract: both speak of 127.0.0.1 only. :func:`free_port` asks the kernel for a port that is
free now (another process may take it before the caller binds: callers that must not lose that
race retry); :func:`wait_port` returns once a TCP connect succeeds, or raises TimeoutError.
"""

from __future__ import annotations

import socket
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout_s: float = 15.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on port {port} after {timeout_s}s")
