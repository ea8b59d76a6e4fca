"""Moving one chunk: a minimal blocking HTTP/1.1 range client that verifies as it streams.

Contract: :meth:`RangeConn.fetch` asks one source (the weight service or a peer) for exactly one
chunk's byte range, hashes the body block by block as it arrives and writes each block to its
place in the destination file. It returns True only if the sha256 of the bytes matches the
manifest; otherwise the bytes it wrote are scratch that the next fetch of that chunk overwrites
(the caller records a chunk as done only after True). Failures are :class:`SourceError` with the
HTTP status (None for a transport failure, a short body or a malformed reply).

Why not httpx here: at loopback line rate an asyncio HTTP stack reads 64 KiB at a time through a
Python parser and copies each piece between layers, which costs more CPU than the network does.
This client runs in a worker thread, receives with ``recv_into`` into one reused buffer, hashes
the block while it is hot in cache (hashlib releases the GIL on large buffers, so workers hash in
parallel) and ``pwrite``s it: one copy out of the kernel, never a whole chunk in memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import socket
import ssl
import threading
from typing import Any
from urllib.parse import urlsplit

from shared.weights.manifest import Chunk

BLOCK = 1 << 20  # receive/hash/write unit; large enough that per-block Python cost vanishes
MAX_HEAD = 64 << 10  # a reply head longer than this is not from a weight service
MAX_ERROR_BODY = 64 << 10


class SourceError(Exception):
    """A source failed to deliver a chunk. ``status`` is the HTTP status, None for transport."""

    def __init__(self, status: int | None, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


class Stopped(Exception):
    """The pull was cancelled while this chunk was in flight."""


def _writeback_starter() -> Any:
    # sync_file_range(SYNC_FILE_RANGE_WRITE) starts writing a verified chunk to disk at once, so
    # the fsync before publishing waits for little instead of the whole checkpoint. Linux only;
    # elsewhere the final fsync simply does all the work.
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _writeback_starter()


def start_writeback(fd: int, offset: int, size: int) -> None:
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, size, 2)  # best effort: the fsync at publish is the guarantee


class RangeConn:
    """One keep-alive connection to one source, used by one thread at a time."""

    def __init__(self, base_url: str, token: str | None, timeout_s: float,
                 tls: ssl.SSLContext | None = None) -> None:
        """``tls``: the context an https source is verified with (default: the system's)."""
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SourceError(None, f"unsupported source URL {base_url!r}: http(s)://host:port "
                              "only")
        self.base_url = base_url
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self._tls = (tls or ssl.create_default_context()) if parts.scheme == "https" else None
        self.timeout_s = timeout_s
        self._auth = f"Authorization: Bearer {token}\r\n" if token else ""
        self._sock: socket.socket | None = None
        self._head_seen = False

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def fetch(
        self, path: str, chunk: Chunk, fd: int, buf: bytearray, stop: threading.Event
    ) -> bool:
        """GET ``path`` for ``chunk``'s range into ``fd``; True if the sha256 matched."""
        try:
            try:
                reused, self._head_seen = self._sock is not None, False
                return self._fetch(path, chunk, fd, memoryview(buf), stop)
            except OSError:
                if not reused or self._head_seen:
                    raise
                # A kept-alive connection the server closed while idle: not a failure of the
                # source. Once more on a fresh connection.
                self.close()
                return self._fetch(path, chunk, fd, memoryview(buf), stop)
        except Stopped:
            self.close()  # the reply is cut off mid-body: the connection is unusable
            raise
        except SourceError as exc:
            if exc.status is None:
                self.close()
            raise
        except (OSError, ValueError) as exc:
            self.close()
            raise SourceError(None, f"{self.base_url}: {type(exc).__name__}: {exc}") from None

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self.host)
            self._sock = sock
        return self._sock

    def _fetch(
        self, path: str, chunk: Chunk, fd: int, view: memoryview, stop: threading.Event
    ) -> bool:
        sock = self._connect()
        first, last = chunk.offset, chunk.offset + chunk.size - 1
        request = (
            f"GET {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{self._auth}"
            f"Range: bytes={first}-{last}\r\nAccept-Encoding: identity\r\n\r\n"
        )
        sock.sendall(request.encode("ascii"))
        status, headers, rest = self._read_head(sock)
        self._head_seen = True
        if "chunked" in headers.get("transfer-encoding", ""):
            raise ValueError("chunked replies are not expected from a weight source")
        length = int(headers.get("content-length", "-1"))
        keep = headers.get("connection", "").lower() != "close"
        if status != 206:
            detail = self._read_small(sock, length, rest)
            if not keep:
                self.close()
            raise SourceError(status, f"{self.base_url}{path}: HTTP {status}: {detail}")
        if length != chunk.size or len(rest) > length:
            raise ValueError(f"reply of {length} bytes for a chunk of {chunk.size}")
        h = hashlib.sha256()
        pos, left = chunk.offset, chunk.size
        if rest:
            h.update(rest)
            os.pwrite(fd, rest, pos)
            pos, left = pos + len(rest), left - len(rest)
        while left:
            if stop.is_set():
                raise Stopped()
            n = min(left, len(view))
            got = 0
            while got < n:
                r = sock.recv_into(view[got:n])
                if r == 0:
                    raise ConnectionError(f"closed with {left - got} bytes of the chunk missing")
                got += r
            h.update(view[:n])
            os.pwrite(fd, view[:n], pos)
            pos, left = pos + n, left - n
        if not keep:
            self.close()
        return h.hexdigest() == chunk.sha256

    @staticmethod
    def _read_head(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
        data = b""
        while (end := data.find(b"\r\n\r\n")) < 0:
            if len(data) > MAX_HEAD:
                raise ValueError("reply head too long")
            piece = sock.recv(MAX_HEAD)
            if not piece:
                raise ConnectionError("closed before a reply")
            data += piece
        lines = data[:end].decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        if not version.startswith("HTTP/1."):
            raise ValueError(f"not an HTTP/1.x reply: {lines[0][:80]!r}")
        headers = {}
        for line in lines[1:]:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        return int(rest[:3]), headers, data[end + 4 :]

    @staticmethod
    def _read_small(sock: socket.socket, length: int, rest: bytes) -> str:
        """An error reply's body (bounded), so the connection stays in step for reuse."""
        if not 0 <= length <= MAX_ERROR_BODY:
            raise ValueError(f"error reply with a body of {length} bytes")
        body = rest
        while len(body) < length:
            piece = sock.recv(length - len(body))
            if not piece:
                raise ConnectionError("closed mid-reply")
            body += piece
        return body.decode("utf-8", "replace")[:300]
