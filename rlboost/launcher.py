"""``rlboost up``: the whole system on one machine, on the embedded brokers, as real processes.

Contract: starts ``nats-server -js`` and ``redis-server`` from the venv (unless
RLBOOST_NATS_URL / RLBOOST_REDIS_URL are set), then the manager, the weight service, the
trainer and the rollout instances, each as its own ``python -m <service>`` process with the
design's environment variables. Every child dies with the launcher (SIGTERM on the way out,
SIGKILL after a grace period, and the kernel's parent-death signal if the launcher is killed:
see :mod:`shared.process`),
so nothing is left running, whatever happens.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rlboost.ha_stack import HaStack
from rlboost.stack import Stack, child_env
from shared.ports import free_port, wait_port


def _port_or_free(preferred: int) -> int:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred))
            return preferred
        except OSError:
            return free_port()


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv, env=child_env(self.env), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class Cluster:
    """The processes of one embedded deployment, in start order."""

    root: Path
    spot: int = 2
    reserved: int = 1
    engine: str = "torch"
    # The trainer as a torchrun group of this many ranks (1: one plain process), started again
    # by torchrun up to trainer_restarts times when a rank dies (trainer_svc.torchrun).
    trainer_ranks: int = 1
    trainer_restarts: int = 3
    # Manager processes: "manager" on RLBOOST_MANAGER_URL, then "manager-1" ... on free ports
    # (their URLs in manager_urls), all on the same brokers (manager_svc.leader).
    managers: int = 1
    manager_urls: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    base_env: dict[str, str] | None = None  # default: the RLBOOST_* variables of this process
    # No broker given (RLBOOST_NATS_URL / RLBOOST_REDIS_URL unset): the embedded ones, one
    # process each, or with ``ha`` the clustered ones (rlboost.ha_stack: 3 NATS nodes, 3 Redis
    # shards each with a replica).
    ha: bool = False
    stack: Stack | HaStack | None = None
    # Per role (manager, trainer, weights, rollout), what its environment changes: each
    # service's own NATS login on locked brokers (Stack.role_env).
    role_env: dict[str, dict[str, str]] = field(default_factory=dict)
    children: list[Child] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    scheme: str = "http"  # of the manager's and the weight service's URLs
    # What one child's environment changes, by its name and environment: a fault test points
    # each process at its own proxy of every link (tests.support.links). None: nothing.
    per_child: Callable[[str, dict[str, str]], dict[str, str]] | None = None

    def start(self) -> None:
        logs = self.root / "logs"
        env = dict(self.base_env) if self.base_env is not None else {
            k: v for k, v in os.environ.items() if k.startswith("RLBOOST_")}
        env.setdefault("RLBOOST_DATA_DIR", str(self.root / "data"))
        if not env.get("RLBOOST_NATS_URL") or not env.get("RLBOOST_REDIS_URL"):
            self.stack = (HaStack.create(self.root / "brokers") if self.ha
                          else Stack.create(self.root / "brokers"))
            self.stack.start()
            for key, value in self.stack.env().items():
                env.setdefault(key, value)
            self.role_env = self.stack.role_env()
        # The manager and the weight service serve HTTPS where they have a certificate.
        self.scheme = "https" if env.get("RLBOOST_TLS_CERT_FILE") else "http"
        env.setdefault("RLBOOST_MANAGER_URL", f"{self.scheme}://127.0.0.1:{_port_or_free(8000)}")
        env.setdefault("RLBOOST_WEIGHTS_URL", f"{self.scheme}://127.0.0.1:{_port_or_free(8001)}")
        # Four torch processes share two cores: one intra-op thread each avoids thrashing.
        env.setdefault("RLBOOST_TORCH_THREADS", "1")
        env["RLBOOST_PARENT_PID"] = str(os.getpid())  # children exit if we die (shared.process)
        env.update(self.extra_env)
        self.env = env
        py = sys.executable
        self._spawn("weights", [py, "-m", "weight_svc"], self.role_env.get("weights", {}), logs)
        self.manager_urls = [env["RLBOOST_MANAGER_URL"]] + [
            f"{self.scheme}://127.0.0.1:{free_port()}" for _ in range(1, self.managers)]
        for i, url in enumerate(self.manager_urls):
            self._spawn("manager" if i == 0 else f"manager-{i}", [py, "-m", "manager_svc"],
                        {**self.role_env.get("manager", {}), "RLBOOST_MANAGER_URL": url}, logs)
        for url in self.manager_urls:
            self.wait_http(url)
        self.wait_http(env["RLBOOST_WEIGHTS_URL"])
        trainer = [py, "-m", "trainer_svc"]
        if self.trainer_ranks > 1:
            trainer = [py, "-m", "trainer_svc.torchrun", str(self.trainer_ranks),
                       str(self.trainer_restarts)]
        self._spawn("trainer", trainer, self.role_env.get("trainer", {}), logs)
        for kind, count in (("reserved", self.reserved), ("spot", self.spot)):
            for i in range(count):
                self.add_instance(kind, f"{kind}-{i}")

    def add_instance(self, kind: str, instance_id: str,
                     extra: dict[str, str] | None = None) -> Child:
        return self._spawn(instance_id, [sys.executable, "-m", "rollout_svc"], {
            **self.role_env.get("rollout-reserved" if kind == "reserved" else "rollout", {}),
            "RLBOOST_INSTANCE_KIND": kind,
            "RLBOOST_INSTANCE_ID": instance_id,
            "RLBOOST_ENGINE": self.env.get("RLBOOST_ENGINE", self.engine), **(extra or {}),
        }, self.root / "logs")

    def _spawn(self, name: str, argv: list[str], extra: dict[str, str], logs: Path) -> Child:
        env = {**self.env, **extra}
        if self.per_child is not None:
            env.update(self.per_child(name, env))
        child = Child(name, argv, env, logs / f"{name}.log")
        child.start()
        self.children.append(child)
        return child

    def wait_http(self, url: str, timeout_s: float = 60.0) -> None:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            dead = [c for c in self.children if not c.alive()]
            if dead:
                raise RuntimeError(f"{dead[0].name} exited during start-up:\n{dead[0].tail()}")
            try:
                wait_port(port, timeout_s=0.5)
                return
            except TimeoutError:
                continue
        raise TimeoutError(f"{url} did not come up in {timeout_s}s")

    def dead(self) -> list[Child]:
        return [c for c in self.children if c.proc is not None and not c.alive()]

    def stop(self, grace_s: float = 10.0) -> None:
        """Rollouts and trainer first (they hand work back), then manager, weights, brokers."""
        for child in reversed(self.children):
            child.signal(signal.SIGTERM)
        end = time.monotonic() + grace_s
        for child in reversed(self.children):
            if child.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.proc.wait(timeout=max(0.1, end - time.monotonic()))
                child.signal(signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.proc.wait(timeout=5)
        if self.stack is not None:
            self.stack.stop()
