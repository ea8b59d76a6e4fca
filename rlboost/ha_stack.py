"""Brokers with no single box to lose: a 3-node NATS JetStream cluster and a Redis Cluster.

The same binaries as the embedded default (:mod:`rlboost.stack`: the venv's ``nats-server`` and
``redis-server``), as several processes on loopback, for ``rlboost up --ha`` (``make run-ha``),
the clustered fault campaign and ``make bench-control-plane``:

- :class:`NatsCluster`: ``size`` JetStream servers joined by routes (each its own name, store
  and cluster port); clients get every node's URL (RLBOOST_NATS_URL takes a comma-separated
  list) and reconnect to a survivor when theirs dies. The chunk stream is kept in 3 copies
  (RLBOOST_STREAM_REPLICAS), so one node lost loses no frame and stops no commit.
- :class:`RedisClusterNodes`: ``size`` primaries sharing the 16,384 slots, each with
  ``replicas`` replicas, joined as ``redis-cli --cluster create`` would. A primary killed is
  replaced by its replica (node timeout 1 s); restarted, it rejoins as that replica's replica.
  With a replica per primary the services ack a commit only once a replica holds it
  (RLBOOST_REDIS_REPLICA_ACKS=1): what the promoted replica serves has every acked commit.

Open brokers only (loopback, no credentials): the locked configuration of a deployment is
``compose/ha.yml``'s. Every node keeps its port and data directory across a restart, so a test
can kill one and start it again as the same node.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis
from redis.crc import key_slot

from rlboost.stack import server_binary
from shared.ports import free_port, wait_port

SLOTS = 16384
BUS_OFFSET = 10000  # a Redis Cluster node's bus listens on its port + 10000


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free and valid too."""
    while True:
        port = free_port()
        if port + BUS_OFFSET > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + BUS_OFFSET))
            except OSError:
                continue
        return port


def _spawn(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _stop(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGKILL) -> bool:
    """Signal ``proc`` and reap it; whether it was alive (a dead one takes no fault)."""
    if proc is None or proc.poll() is not None:
        return False
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=15)
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)
    return True


def redis_client(url: str) -> redis.Redis | redis.RedisCluster:
    """A blocking client of the Redis at ``url``: of its whole cluster where that server is a
    node of one (as shared.bus.connect_redis decides for the services)."""
    one = redis.Redis.from_url(url, decode_responses=True)
    if int(one.info("cluster").get("cluster_enabled", 0)) != 1:
        return one
    one.close()
    return redis.RedisCluster.from_url(url, decode_responses=True)


@dataclass
class NatsCluster:
    """``size`` JetStream servers routed to one another (``nats``: their client ports)."""

    root: Path
    size: int = 3
    ports: list[int] = field(default_factory=list)
    routes: list[int] = field(default_factory=list)
    monitors: list[int] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes] | None] = field(default_factory=list)

    def argv(self, i: int) -> list[str]:
        others = ",".join(f"nats://127.0.0.1:{p}" for j, p in enumerate(self.routes) if j != i)
        return [server_binary("nats-server"), "-js", "-a", "127.0.0.1", "-p", str(self.ports[i]),
                "-m", str(self.monitors[i]), "-n", f"nats-{i + 1}", "-sd",
                str(self.root / f"nats-{i + 1}"), "--cluster_name", "rlboost", "--cluster",
                f"nats://127.0.0.1:{self.routes[i]}", "--routes", others]

    @property
    def url(self) -> str:
        """Every node, comma-separated (RLBOOST_NATS_URL): a client starting while one is
        down connects to another."""
        return ",".join(f"nats://127.0.0.1:{p}" for p in self.ports)

    def start(self, timeout_s: float = 60.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.ports = [free_port() for _ in range(self.size)]
        self.routes = [free_port() for _ in range(self.size)]
        self.monitors = [free_port() for _ in range(self.size)]
        self.procs = [None] * self.size
        for i in range(self.size):
            self.restart(i, wait=False)
        self.wait_ready(timeout_s)

    def restart(self, i: int, wait: bool = True) -> None:
        """Start node ``i`` again (killed first if alive): same name, ports and store, so it
        rejoins the cluster and catches its streams up from the others."""
        _stop(self.procs[i])
        self.procs[i] = _spawn(self.argv(i), self.root / f"nats-{i + 1}.log")
        wait_port(self.ports[i], 30)
        if wait:
            self.wait_ready(60.0, [i])

    def kill(self, i: int, sig: int = signal.SIGKILL) -> bool:
        return _stop(self.procs[i], sig)

    def wait_ready(self, timeout_s: float, nodes: list[int] | None = None) -> None:
        """Until each node's /healthz is ok: JetStream current with the cluster's meta leader
        and every stream and consumer it holds caught up."""
        end = time.monotonic() + timeout_s
        todo = list(range(self.size)) if nodes is None else nodes
        last = ""
        while todo and time.monotonic() < end:
            try:
                resp = httpx.get(f"http://127.0.0.1:{self.monitors[todo[0]]}/healthz", timeout=2)
                if resp.status_code == 200:
                    todo.pop(0)
                    continue
                last = resp.text
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(0.2)
        if todo:
            raise TimeoutError(f"NATS node {todo[0] + 1} not ready in {timeout_s}s: {last}")

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(Exception):
                _stop(proc, signal.SIGTERM)


@dataclass
class RedisClusterNodes:
    """``size`` primaries sharing the slots, each with ``replicas`` replicas (``ports``: the
    primaries' first, then each primary's replicas in order)."""

    root: Path
    size: int = 3
    replicas: int = 0
    ports: list[int] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def argv(self, port: int) -> list[str]:
        return [server_binary("redis-server"), "--port", str(port), "--bind", "127.0.0.1",
                "--dir", str(self.root / f"redis-{port}"), "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1000",
                "--cluster-replica-validity-factor", "0", "--appendonly", "yes",
                "--appendfsync", "always", "--save", "", "--protected-mode", "no"]

    def _spawn(self, port: int) -> subprocess.Popen[bytes]:
        (self.root / f"redis-{port}").mkdir(parents=True, exist_ok=True)
        return _spawn(self.argv(port), self.root / f"redis-{port}.log")

    def restart(self, port: int) -> None:
        """Start the node of ``port`` again, dead or not: it rejoins from its nodes.conf
        (a primary that was failed over comes back as its successor's replica)."""
        i = self.ports.index(port)
        _stop(self.procs[i])
        self.procs[i] = self._spawn(port)
        wait_port(port)

    def kill(self, port: int, sig: int = signal.SIGKILL) -> bool:
        return _stop(self.procs[self.ports.index(port)], sig)

    @property
    def url(self) -> str:
        """Any one node: clients find the others (RLBOOST_REDIS_URL names just this one)."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, decode_responses=True,
                           socket_timeout=5)

    def start(self, timeout_s: float = 30.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.ports = [cluster_port() for _ in range(self.size * (1 + self.replicas))]
        self.procs = [self._spawn(port) for port in self.ports]
        for port in self.ports:
            wait_port(port)
        share = SLOTS // self.size
        for i, port in enumerate(self.ports[:self.size]):
            node = self.client(port)
            last = SLOTS - 1 if i == self.size - 1 else (i + 1) * share - 1
            node.execute_command("CLUSTER ADDSLOTS", *range(i * share, last + 1))
            node.execute_command("CLUSTER SET-CONFIG-EPOCH", i + 1)
        for port in self.ports[1:]:
            self.client(port).execute_command("CLUSTER MEET", "127.0.0.1", self.ports[0])
        end = time.monotonic() + timeout_s
        replicating = False
        states: list[dict[str, str]] = []
        while time.monotonic() < end:
            states = [self.client(p).cluster("INFO") for p in self.ports]
            if all(s["cluster_state"] == "ok" and int(s["cluster_known_nodes"]) == len(self.ports)
                   for s in states):
                if replicating or not self.replicas:
                    if self.replicas_synced():
                        return
                else:
                    self._replicate()
                    replicating = True
            time.sleep(0.2)
        raise TimeoutError(f"the Redis cluster did not form in {timeout_s}s: {states}")

    def _replicate(self) -> None:
        for i in range(self.size):
            primary = self.client(self.ports[i]).execute_command("CLUSTER MYID")
            for r in range(self.replicas):
                port = self.ports[self.size + i * self.replicas + r]
                self.client(port).execute_command("CLUSTER REPLICATE", primary)

    def replicas_synced(self) -> bool:
        """Whether every node that is a replica now has its link to its primary up."""
        for port in self.ports:
            with contextlib.suppress(redis.RedisError):
                info = self.client(port).info("replication")
                if info.get("role") == "slave" and info.get("master_link_status") != "up":
                    return False
        return True

    def primary_of(self, key: str) -> int:
        """The port of the node serving ``key``'s slot now (after any failover)."""
        slot = key_slot(key.encode())
        for port in self.ports:
            with contextlib.suppress(redis.RedisError):
                for lo, hi, primary, *_ in self.client(port).execute_command("CLUSTER SLOTS"):
                    if lo <= slot <= hi:
                        return int(primary[1])
        raise LookupError(f"no live node knows slot {slot}")

    def node_of(self, key: str) -> int:
        """The port of the node first given ``key``'s slot."""
        slot = int(key_slot(key.encode()))
        share = SLOTS // self.size
        return self.ports[min(slot // share, self.size - 1)]

    def __enter__(self) -> RedisClusterNodes:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(Exception):
                _stop(proc)
        self.procs.clear()


@dataclass
class HaStack:
    """The clustered brokers, as :class:`rlboost.stack.Stack` offers the embedded ones."""

    nats: NatsCluster
    redis: RedisClusterNodes

    @classmethod
    def create(cls, root: Path, shards: int = 3, replicas: int = 1,
               nats_nodes: int = 3) -> HaStack:
        return cls(NatsCluster(root / "nats", nats_nodes),
                   RedisClusterNodes(root / "redis", shards, replicas))

    def start(self, attempts: int = 3) -> None:
        """Start both clusters; again on fresh ports if one fails to form (a free port can be
        taken by another process between its choice and the server's bind)."""
        for attempt in range(attempts):
            try:
                self.nats.start()
                self.redis.start()
                return
            except (redis.RedisError, TimeoutError, OSError):
                self.stop()
                if attempt == attempts - 1:
                    raise
            except BaseException:
                self.stop()
                raise

    def stop(self) -> None:
        self.nats.stop()
        self.redis.stop()

    def env(self, role: str = "manager") -> dict[str, str]:
        """Every role's broker settings (the brokers are open: one set for all)."""
        del role
        return {"RLBOOST_NATS_URL": self.nats.url, "RLBOOST_REDIS_URL": self.redis.url,
                "RLBOOST_STREAM_REPLICAS": str(min(3, self.nats.size)),
                "RLBOOST_REDIS_REPLICA_ACKS": "1" if self.redis.replicas else "0"}

    def role_env(self) -> dict[str, dict[str, str]]:
        return {}
