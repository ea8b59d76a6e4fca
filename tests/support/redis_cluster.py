"""A real Redis Cluster on loopback, and an audit of the slots each script reaches.

:class:`RedisClusterNodes` (:mod:`rlboost.ha_stack`) starts ``redis-server`` processes (the
venv's binary, as every other test) with ``cluster-enabled``, splits the 16,384 slots between
them and joins them, as ``redis-cli --cluster create`` would. :class:`SlotAudit` watches every node
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
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import redis
from redis.crc import key_slot

from rlboost.ha_stack import RedisClusterNodes

__all__ = ["RedisClusterNodes", "SlotAudit"]

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

    def evalsha_calls(self) -> list[tuple[str, list[bytes]]]:
        """Every script a client ran by SHA1 (EVALSHA) on any node: (SHA1, its declared keys)."""
        found: list[tuple[str, list[bytes]]] = []
        for lines in self.lines.values():
            for line in list(lines):
                if b'"EVALSHA"' in line.upper():
                    args = _ARG.findall(line)
                    if len(args) > 2:
                        found.append((args[1].decode().lower(),
                                      [_unescape(k) for k in args[3:3 + int(args[2])]]))
        return found

    def evalshas(self) -> set[str]:
        """The SHA1 of every script a client ran (EVALSHA) on any node."""
        return {sha for sha, _ in self.evalsha_calls()}

    def settle(self, client: Callable[[int], redis.Redis]) -> None:
        """Until each node's MONITOR feed shows a marker sent now (``client``: a client of the
        node on a port): the feed reaches the audit's threads asynchronously, and a line still
        on its way would go unchecked."""
        marker = f"audit-end-{uuid.uuid4().hex}".encode()
        for port in self.ports:
            with client(port) as node:
                node.echo(marker)
        end = time.monotonic() + 10
        while not all(any(marker in line for line in self.lines[p][-200:]) for p in self.ports):
            assert time.monotonic() < end, "a node's MONITOR feed did not catch up"
            time.sleep(0.05)

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
