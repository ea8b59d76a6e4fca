"""TCP fault proxies: one per network link, so a test can hurt a link while both ends live.

Contract: a :class:`Hub` runs one asyncio loop in a daemon thread and hosts any number of
:class:`Link` s. A link listens on its own loopback address (``127.x.y.z``: the whole of
127/8 reaches ``lo`` on Linux) on the *same ports* as the services it stands in front of,
and forwards each connection to ``127.0.0.1`` on that port. So a URL is pointed at a link
by swapping its host (:meth:`Link.url`), and a service that advertises a second port (the
weight service's sendfile data plane, reached on the host the client used) is proxied too,
as long as that port is listed.

A link is in one of these states, switched from any thread:

- healthy (:meth:`Link.heal`): bytes flow, after ``latency_s`` and at most ``bytes_per_s``
  when :meth:`Link.slow` set them;
- cut (:meth:`Link.cut`): every open connection is reset, and new ones are accepted and
  reset at once (a refused connect, as a firewall with REJECT gives);
- black hole (:meth:`Link.blackhole`): nothing is forwarded either way and new connections are
  accepted but never reach the server; nothing is lost, as with TCP over a dead route, so on
  heal what was sent during the outage flows late (a client that gave up has reset by then).

Bytes within a connection are never dropped or reordered: TCP does not, and the brokers'
protocols would fail for reasons no real network gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

T = TypeVar("T")
READ_BYTES = 64 << 10
QUEUE_CHUNKS = 16  # per direction: a slow or held link pushes back on the sender's socket


@dataclass
class LinkStats:
    connections: int = 0  # accepted over the link's life
    refused: int = 0  # reset on arrival while cut
    bytes_forwarded: int = 0


@dataclass(eq=False)  # hashed by identity: a set holds the open ones
class _Conn:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    open_ways: int = 2  # directions not yet at EOF: the connection closes when both are

    def abort(self) -> None:
        for w in (self.client, self.server):
            if w is not None:
                w.transport.abort()
        for t in self.tasks:
            t.cancel()


class Link:
    """One link's proxy: ``host`` listens on ``ports`` and forwards each to 127.0.0.1."""

    def __init__(self, hub: Hub, name: str, host: str, ports: list[int]) -> None:
        self.hub = hub
        self.name = name
        self.host = host
        self.ports = list(ports)
        self.stats = LinkStats()
        self.state = "healthy"  # healthy | cut | blackhole
        self.latency_s = 0.0
        self.bytes_per_s = 0.0  # 0 = unlimited
        self._conns: set[_Conn] = set()
        self._servers: list[asyncio.Server] = []
        self._flowing = asyncio.Event()  # set while bytes may flow; used on the hub's loop only
        self._flowing.set()

    # --- control, from any thread ---------------------------------------------------------

    def url(self, url: str) -> str:
        """``url`` with its host replaced by this link's (credentials and port kept)."""
        parts = urlsplit(url)
        userinfo, at, hostport = parts.netloc.rpartition("@")
        port = hostport.rsplit(":", 1)[1]
        return urlunsplit(parts._replace(netloc=f"{userinfo}{at}{self.host}:{port}"))

    def live(self) -> int:
        """Open connections now: a fault on a link nobody uses hurts nothing."""
        return self.hub.call(self._live())

    def cut(self) -> None:
        self.hub.call(self._set("cut"))

    def blackhole(self) -> None:
        self.hub.call(self._set("blackhole"))

    def slow(self, latency_s: float, bytes_per_s: float) -> None:
        """Delay every byte by ``latency_s`` and cap each direction at ``bytes_per_s``."""
        self.latency_s, self.bytes_per_s = latency_s, bytes_per_s

    def heal(self) -> None:
        self.latency_s, self.bytes_per_s = 0.0, 0.0
        self.hub.call(self._set("healthy"))

    # --- on the hub's loop ----------------------------------------------------------------

    async def _live(self) -> int:
        return len(self._conns)

    async def _set(self, state: str) -> None:
        self.state = state
        if state == "healthy":
            self._flowing.set()
            return
        self._flowing.clear()
        if state == "cut":
            for conn in list(self._conns):
                conn.abort()
            self._conns.clear()

    async def _start(self) -> None:
        for port in self.ports:
            self._servers.append(await asyncio.start_server(
                functools.partial(self._accept, port=port), self.host, port,
                reuse_address=True))

    async def _close(self) -> None:
        for server in self._servers:
            server.close()
        for conn in list(self._conns):
            conn.abort()
        self._conns.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      port: int) -> None:
        self.stats.connections += 1
        if self.state == "cut":
            self.stats.refused += 1
            writer.transport.abort()
            return
        conn = _Conn(writer)
        self._conns.add(conn)
        try:
            await self._flowing.wait()  # a black hole holds the connect too
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        except (OSError, asyncio.CancelledError):
            conn.abort()
            self._conns.discard(conn)
            return
        if conn not in self._conns:  # cut while connecting
            up_writer.transport.abort()
            return
        conn.server = up_writer
        conn.tasks = [asyncio.create_task(self._pipe(reader, up_writer, conn)),
                      asyncio.create_task(self._pipe(up_reader, writer, conn))]

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    conn: _Conn) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)
        sender = asyncio.create_task(self._send(queue, dst))
        clean = False
        try:
            while data := await src.read(READ_BYTES):
                await queue.put((time.monotonic() + self.latency_s, data))
            await queue.put((0.0, b""))  # EOF after what is queued
            await sender
            conn.open_ways -= 1
            clean = conn.open_ways > 0  # a half-close: the other way still flows
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            sender.cancel()
            if not clean:
                conn.abort()
                self._conns.discard(conn)

    async def _send(self, queue: asyncio.Queue[tuple[float, bytes]],
                    dst: asyncio.StreamWriter) -> None:
        while True:
            due, data = await queue.get()
            await self._flowing.wait()
            if not data:
                with contextlib.suppress(OSError):
                    dst.write_eof()
                return
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            await self._flowing.wait()  # a black hole that began during the delay
            dst.write(data)
            await dst.drain()
            self.stats.bytes_forwarded += len(data)
            if self.bytes_per_s > 0:
                await asyncio.sleep(len(data) / self.bytes_per_s)


class Hub:
    """The loop every link of a test runs on; ``close()`` resets every connection."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.links: dict[str, Link] = {}
        self._thread = threading.Thread(target=self.loop.run_forever, name="faultproxy",
                                        daemon=True)
        self._thread.start()
        self._next = 0

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        # Every link of a test shares this one loop, and it shares two cores with a dozen
        # services: at load 20+ (make chaos beside other work) a control call waited > 10 s
        # for its turn, which is a slow test host, not a fault that failed to land.
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def link(self, name: str, ports: list[int]) -> Link:
        """A new link in front of ``ports`` (on 127.0.0.1), on a loopback address of its own."""
        self._next += 1
        host = f"127.{77 + self._next // 65536}.{self._next // 256 % 256}.{self._next % 256}"
        link = Link(self, name, host, ports)

        self.call(link._start())
        self.links[name] = link
        return link

    def close(self) -> None:
        for link in self.links.values():
            with contextlib.suppress(Exception):
                self.call(link._close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
