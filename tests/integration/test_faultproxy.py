"""The fault proxy against a real TCP echo server: it forwards, cuts, black-holes, slows, heals.

The fault campaign trusts these behaviours (a cut resets, a black hole holds without losing
bytes, a slow link is slow); each test fails on a proxy that forwards regardless.
"""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from tests.support.faultproxy import Hub, Link


class Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def link(echo_port: int) -> Iterator[Link]:
    hub = Hub()
    yield hub.link("echo", [echo_port])
    hub.close()


def connect(link: Link) -> socket.socket:
    return socket.create_connection((link.host, link.ports[0]), timeout=5)


def roundtrip(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        data = sock.recv(65536)
        if not data:
            break
        got += data
    return got


def test_forwards_both_ways_on_its_own_address(link: Link, echo_port: int) -> None:
    assert link.host != "127.0.0.1" and link.host.startswith("127.")
    assert link.url(f"nats://u:p@127.0.0.1:{echo_port}") == f"nats://u:p@{link.host}:{echo_port}"
    with connect(link) as sock:
        payload = bytes(range(256)) * 1000
        assert roundtrip(sock, payload) == payload
        assert link.live() == 1
    assert link.stats.bytes_forwarded >= 2 * len(payload)


def test_cut_resets_open_connections_and_refuses_until_healed(link: Link) -> None:
    sock = connect(link)
    assert roundtrip(sock, b"before") == b"before"
    link.cut()
    with pytest.raises(OSError):  # reset, or the peer closed: the connection is gone
        sock.sendall(b"x" * 100_000)
        if not sock.recv(10):
            raise ConnectionResetError("closed")
    sock.close()
    with pytest.raises(OSError), connect(link) as again:  # refused: reset on arrival
        again.sendall(b"x")
        if not again.recv(10):
            raise ConnectionResetError("closed")
    assert link.stats.refused >= 1 and link.live() == 0
    link.heal()
    with connect(link) as sock:
        assert roundtrip(sock, b"after") == b"after"


def test_black_hole_holds_bytes_and_delivers_them_on_heal(link: Link) -> None:
    sock = connect(link)
    assert roundtrip(sock, b"warm") == b"warm"
    link.blackhole()
    sock.sendall(b"held")
    fresh = connect(link)  # accepted: a black hole does not refuse
    fresh.sendall(b"new")
    for s in (sock, fresh):
        s.settimeout(0.5)
        with pytest.raises(TimeoutError):
            s.recv(10)
    link.heal()
    for s, want in ((sock, b"held"), (fresh, b"new")):
        s.settimeout(5)
        assert roundtrip(s, b"") + s.recv(10) == want  # nothing lost, only late
        s.close()


def test_slow_link_adds_latency_and_caps_bandwidth(link: Link) -> None:
    with connect(link) as sock:
        link.slow(latency_s=0.2, bytes_per_s=1e6)
        t0 = time.monotonic()
        assert roundtrip(sock, b"ping") == b"ping"
        assert time.monotonic() - t0 >= 0.4  # 0.2 s each way
        payload = b"y" * 300_000
        t0 = time.monotonic()
        assert roundtrip(sock, payload) == payload
        assert time.monotonic() - t0 >= 0.3  # 300 kB at 1 MB/s, whatever else it costs
        link.heal()
        assert roundtrip(sock, b"fast") == b"fast"
