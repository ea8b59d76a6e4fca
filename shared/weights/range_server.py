"""A threaded HTTP/1.1 server of checkpoint byte ranges, sent with ``sendfile``.

Contract: :class:`RangeServer` answers ``GET <prefix>/<run_id>/<version>/files/<name>`` with one
``Range: bytes=a-b`` (206) or without one (200), and ``GET <prefix>/<run_id>/<version>/<what>``
through an optional JSON hook; everything else is 404. Which file a request may read is decided by
a resolver the owner supplies (the weight service's store, or a peer's verified copies); ids and
names are validated before the resolver sees them. With tokens set, every request needs
``Authorization: Bearer <one of them>``, checked before anything else is read or done. At most
``max_connections`` connections are served at once (one thread each); a connection beyond that
is answered 503 at once and closed, so idle sockets cannot pile up threads. Errors are JSON
``{"detail": ...}`` with a 4xx status (503 for the cap). Served file bytes are reported to
``on_served`` (the owner's egress counter). With ``tls`` (a server context) every connection is
TLS, its handshake done in the connection's own thread (bounded by the same timeout); the file
bytes then go through the TLS layer rather than ``sendfile``. :func:`parse_range` is the one
Range parser of the weight service's ports (REST and data plane): bounded, so a 4,300-digit
range is a 416.

With a :class:`Link` (the weight service's ``RLBOOST_WEIGHTS_EGRESS_BYTES_S``) the file bytes go
out a block at a time, each block waiting its turn on the link, so every transfer through it
shares one rate, as pulls share a NIC.

Why a separate server: the kernel moves file pages to the socket with ``sendfile`` without a copy
through Python, so one connection runs at the link's limit on a single core, where an asyncio ASGI
stack reading and writing blocks cost several copies and far more CPU than the network (measured:
below a quarter of loopback TCP). Each connection gets a thread; the bytes never enter Python.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import re
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from shared.weights.manifest import valid_name, valid_run_id, valid_version

log = logging.getLogger(__name__)

_RANGE_RE = re.compile(r"bytes=(\d{0,19})-(\d{0,19})")
MAX_CONNECTIONS = 64
_PATH_RE = re.compile(r"/([^/]{1,200})/(\d{1,10})/(files/)?([^/]{1,200})")


class Link:
    """A link of ``bytes_s`` shared by every transfer through it. A block is sent once the
    link has carried every block asked for before it (first come, first served), so concurrent
    transfers split the rate block by block; an idle link saves no credit."""

    BLOCK = 16 << 10  # fine enough that transfers of a few blocks still interleave

    def __init__(self, bytes_s: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if bytes_s <= 0:
            raise ValueError(f"a link needs a rate > 0, got {bytes_s}")
        self.bytes_s = bytes_s
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the link has carried every block asked for so far

    def take(self, n: int) -> None:
        """Wait until ``n`` bytes have had their turn on the link."""
        with self._lock:
            now = self._clock()
            self._free_at = max(now, self._free_at) + n / self.bytes_s
            wait = self._free_at - now
        if wait > 0:
            self._sleep(wait)


class RangeError(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


# (run_id, version, name) -> path of a complete, verified file, or RangeError
Resolver = Callable[[str, int, str], Path]
# (run_id, version, what) -> JSON-able reply, or RangeError
JsonHook = Callable[[str, int, str], Any]
# (run_id, version, name, start, end) -> None if [start, end) may be served, else RangeError
RangeHook = Callable[[str, int, str, int, int], None]


def parse_range(header: str, size: int) -> tuple[int, int]:
    """One ``bytes=a-b``, ``bytes=a-`` or ``bytes=-n`` range -> [start, end);
    RangeError(416) otherwise (numbers of at most 19 digits: nothing unbounded is parsed)."""
    m = _RANGE_RE.fullmatch(header.strip()[:64])
    if m is None or len(header.strip()) > 64 or (not m[1] and not m[2]):
        raise RangeError(416, f"unsupported Range {header[:80]!r}: one bytes=a-b range only")
    if not m[1]:  # suffix form: the last n bytes
        start, end = max(size - int(m[2]), 0), size
    else:
        start = int(m[1])
        if m[2] and int(m[2]) < start:
            raise RangeError(416, f"Range {header[:80]!r} ends before it starts")
        end = size if not m[2] else min(int(m[2]) + 1, size)
    if start >= end:
        raise RangeError(416, f"Range {header[:80]!r} outside a file of {size} bytes")
    return start, end


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a puller reuses one connection for many chunks
    server: RangeServer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per chunk would drown the service's own log

    def do_GET(self) -> None:
        try:
            self._get()
        except RangeError as exc:
            self._reply_json(exc.status, {"detail": exc.detail})
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True  # the client went away; nothing to answer

    def _get(self) -> None:
        srv = self.server
        if srv.tokens:
            scheme, _, given = self.headers.get("authorization", "").partition(" ")
            # compare_digest: the time taken must not leak how much of a guess matched
            ok = scheme.lower() == "bearer" and any(
                hmac.compare_digest(given.encode(), t) for t in srv.tokens)
            if not ok:
                raise RangeError(401, "missing or wrong bearer token")
        path = self.path.split("?", 1)[0]
        if not path.startswith(srv.prefix + "/"):
            raise RangeError(404, f"no route {path[:100]!r}")
        m = _PATH_RE.fullmatch(path[len(srv.prefix) :])
        if m is None:
            raise RangeError(404, f"no route {path[:100]!r}")
        run_id, version, is_file, name = m[1], int(m[2]), m[3] is not None, m[4]
        if not valid_run_id(run_id) or not valid_version(version):
            raise RangeError(422, f"invalid run id or version in {path[:100]!r}")
        if not is_file:
            if srv.json_hook is None:
                raise RangeError(404, f"no route {path[:100]!r}")
            self._reply_json(200, srv.json_hook(run_id, version, name))
            return
        if not valid_name(name):
            raise RangeError(422, f"invalid file name {name[:80]!r}")
        self._send_file(srv.resolver(run_id, version, name), run_id, version, name)

    def _send_file(self, file: Path, run_id: str, version: int, name: str) -> None:
        try:
            f = file.open("rb")  # held open: a collection cannot cut the reply short
        except OSError:
            raise RangeError(404, f"{file.name}: not available") from None
        with f:
            size = f.seek(0, 2)
            start, end, status = 0, size, 200
            if (header := self.headers.get("range")) is not None:
                start, end = parse_range(header, size)
                status = 206
            if self.server.range_hook is not None:
                self.server.range_hook(run_id, version, name, start, end)
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(end - start))
            self.send_header("Accept-Ranges", "bytes")
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            self.end_headers()
            # Over TLS, socket.sendfile falls back to reading the file from its position,
            # which it moves only for a nonzero offset: the size probe left it at the end.
            f.seek(start)
            sent = self._send_range(f, start, end - start)
            self.server.on_served(sent)
            if sent != end - start:  # the file shrank: the client's length check catches it
                self.close_connection = True

    def _send_range(self, f: Any, start: int, count: int) -> int:
        link = self.server.link
        if link is None:
            return int(self.connection.sendfile(f, start, count))
        sent = 0
        while sent < count:
            n = min(Link.BLOCK, count - sent)
            link.take(n)
            done = int(self.connection.sendfile(f, start + sent, n))
            sent += done
            if done < n:
                break  # the file shrank
        return sent

    def _reply_json(self, status: int, body: Any) -> None:
        # As Starlette writes JSON: the REST port and this one answer byte for byte alike.
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        self.end_headers()
        self.wfile.write(data)


_BUSY_BODY = b'{"detail": "too many connections; retry shortly"}'
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
         b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
         + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)


class RangeServer(ThreadingHTTPServer):
    """Serve in a background thread; :meth:`close` is idempotent."""

    daemon_threads = True  # a stuck client must not keep the process alive
    block_on_close = False
    request_queue_size = 128  # many joiners may connect at once

    def __init__(
        self,
        host: str,
        port: int,
        prefix: str,
        resolver: Resolver,
        tokens: Sequence[str],
        on_served: Callable[[int], None] = lambda n: None,
        json_hook: JsonHook | None = None,
        range_hook: RangeHook | None = None,
        timeout_s: float = 60.0,
        max_connections: int = MAX_CONNECTIONS,
        tls: ssl.SSLContext | None = None,
        link: Link | None = None,
    ) -> None:
        super().__init__((host, port), _Handler)
        self.tls = tls
        self.link = link  # None: as fast as sendfile goes
        self.prefix = prefix
        self.resolver = resolver
        self.tokens = [t.encode() for t in tokens if t]  # any one is accepted; none = open
        self._slots = threading.BoundedSemaphore(max_connections)
        self.on_served = on_served
        self.json_hook = json_hook
        self.range_hook = range_hook
        self.timeout_s = timeout_s
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("request from %s failed", client_address, exc_info=True)  # client went away

    def get_request(self) -> tuple[Any, Any]:
        conn, addr = super().get_request()
        conn.settimeout(self.timeout_s)  # an idle or stalled client frees its thread
        if self.tls is not None:  # the handshake waits for the connection's thread
            conn = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        return conn, addr

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread per connection, up to the cap; beyond it a 503 and the socket closed."""
        if not self._slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.settimeout(1.0)
                request.sendall(_BUSY)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            if isinstance(request, ssl.SSLSocket):
                try:
                    request.do_handshake()
                except OSError:  # not TLS, an untrusted client, or too slow: nothing to serve
                    self.shutdown_request(request)
                    return
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self.serve_forever, args=(0.2,), name="weights-range-server", daemon=True
            )
            self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self.shutdown()
            self._thread.join()
            self._thread = None
            self.server_close()
