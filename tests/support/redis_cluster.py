"""A real Redis Cluster on loopback, and an audit of the slots each script reaches.

:class:`RedisClusterNodes` starts ``redis-server`` processes (the venv's binary, as every other
test) with ``cluster-enabled``, splits the 16,384 slots between them and joins them, as
``redis-cli --cluster create`` would with no replicas. :class:`SlotAudit` watches every node
with MONITOR, which shows each command a script runs (``[0 lua]``) right beside the script's
own call: the commands of one script execution are one unbroken run of such lines (a script
is atomic), and the audit asks the node which arguments of each command are keys (COMMAND
GETKEYS) and checks that every run reaches one slot. A Redis server does not check that
itself for keys a script builds rather than declares (6.2 and 7.0 serve them when the slot
is on the same node), so a cluster run alone would let a script that mixes two slots pass
whenever both happen to sit on one node.
"""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.crc import key_slot

from rlboost.stack import server_binary
from shared.ports import free_port, wait_port

SLOTS = 16384
BUS_OFFSET = 10000  # a node's cluster bus listens on its port + 10000
_ARG = re.compile(rb'"((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(rb"\\(x[0-9a-fA-F]{2}|.)")
_ESCAPES = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"a": b"\a", b"b": b"\b"}


def _unescape(raw: bytes) -> bytes:
    def one(m: re.Match[bytes]) -> bytes:
        code = m.group(1)
        if code.startswith(b"x") and len(code) == 3:
            return bytes([int(code[1:], 16)])
        return _ESCAPES.get(code, code)

    return _ESCAPE.sub(one, raw)


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
        with (self.root / f"redis-{port}.log").open("ab") as log:
            return subprocess.Popen(self.argv(port), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def restart(self, port: int) -> None:
        """Start the node of ``port`` again, dead or not: it rejoins from its nodes.conf
        (a primary that was failed over comes back as its successor's replica)."""
        i = self.ports.index(port)
        with contextlib.suppress(Exception):
            self.procs[i].kill()
            self.procs[i].wait(timeout=10)
        self.procs[i] = self._spawn(port)
        wait_port(port)

    @property
    def url(self) -> str:
        """Any one node: clients find the others (RLBOOST_REDIS_URL names just this one)."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, decode_responses=True)

    def start(self, timeout_s: float = 30.0) -> None:
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
        while time.monotonic() < end:
            states = [self.client(p).cluster("INFO") for p in self.ports]
            if all(s["cluster_state"] == "ok" and int(s["cluster_known_nodes"]) == len(self.ports)
                   for s in states):
                if replicating or not self.replicas:
                    if self._replicas_synced():
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

    def _replicas_synced(self) -> bool:
        return all(self.client(p).info("replication").get("master_link_status") == "up"
                   for p in self.ports[self.size:])

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
        """The port of the node serving ``key``'s slot."""
        slot = key_slot(key.encode())
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
                proc.kill()
                proc.wait(timeout=10)
        self.procs.clear()


@dataclass
class SlotAudit:
    """MONITOR on each node; :meth:`scripts` gives every script execution's keys."""

    ports: list[int]
    lines: dict[int, list[bytes]] = field(default_factory=dict)
    _socks: list[socket.socket] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for port in self.ports:
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"*1\r\n$7\r\nMONITOR\r\n")
            self.lines[port] = []
            self._socks.append(sock)
            thread = threading.Thread(target=self._read, args=(sock, self.lines[port]),
                                      daemon=True)
            thread.start()
            self._threads.append(thread)

    @staticmethod
    def _read(sock: socket.socket, out: list[bytes]) -> None:
        buf = b""
        while True:
            try:
                data = sock.recv(1 << 20)
            except OSError:
                return
            if not data:
                return
            buf += data
            *done, buf = buf.split(b"\r\n")
            out.extend(done)

    def stop(self) -> None:
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in self._threads:
            thread.join(timeout=10)

    def scripts(self) -> list[tuple[int, list[list[bytes]]]]:
        """Per script execution seen: (node port, the commands it ran, as argument lists)."""
        found: list[tuple[int, list[list[bytes]]]] = []
        for port, lines in self.lines.items():
            run: list[list[bytes]] = []
            for line in lines:
                if b" [0 lua] " in line or b" lua] " in line:
                    run.append([_unescape(a) for a in _ARG.findall(line)])
                elif run:
                    found.append((port, run))
                    run = []
            if run:
                found.append((port, run))
        return found

    def violations(self) -> tuple[int, int, list[tuple[int, set[int], list[list[bytes]]]]]:
        """(script executions seen, commands they ran, the executions that reached more
        than one slot: node, slots, commands). Keys as each node reads them (COMMAND
        GETKEYS, pipelined per node)."""
        scripts = self.scripts()
        keys: dict[tuple[int, tuple[bytes, ...]], list[bytes]] = {}
        for port in self.ports:
            todo = sorted({tuple(c) for p, run in scripts if p == port for c in run})
            node = redis.Redis(host="127.0.0.1", port=port)
            try:
                for i in range(0, len(todo), 1000):
                    pipe = node.pipeline(transaction=False)
                    for command in todo[i:i + 1000]:
                        pipe.execute_command("COMMAND GETKEYS", *command)
                    for command, got in zip(todo[i:i + 1000], pipe.execute(raise_on_error=False),
                                            strict=True):
                        # A command with no key argument is an error to GETKEYS.
                        keys[(port, command)] = [] if isinstance(got, Exception) else [
                            k if isinstance(k, bytes) else str(k).encode() for k in got]
            finally:
                node.close()
        bad = []
        commands = 0
        for port, run in scripts:
            commands += len(run)
            slots = {key_slot(k) for c in run for k in keys[(port, tuple(c))]}
            if len(slots) > 1:
                bad.append((port, slots, run))
        return len(scripts), commands, bad
