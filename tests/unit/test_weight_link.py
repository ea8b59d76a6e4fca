"""The weight service's emulated link (RLBOOST_WEIGHTS_EGRESS_BYTES_S), and its switches for
full pulls from the service alone (RLBOOST_WEIGHTS_DELTAS, RLBOOST_WEIGHTS_PEERS)."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shared.weights.range_server import Link, RangeServer
from weight_svc.peers import PeerRegistry
from weight_svc.routes.peers import list_peers
from weight_svc.store import Store, StoreLimits

RUN = "run-1"


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


def test_a_link_serves_blocks_in_turn_and_saves_no_credit() -> None:
    t = FakeTime()
    link = Link(1000.0, clock=t.clock, sleep=t.sleep)
    link.take(1000)  # alone: a second
    link.take(500)  # asked at the same instant: after the first
    t.now = 10.0  # idle since 1.5 s: no burst allowance
    link.take(100)
    assert t.slept == [pytest.approx(1.0), pytest.approx(1.5), pytest.approx(0.1)]
    with pytest.raises(ValueError):
        Link(0.0)


def test_concurrent_downloads_share_the_link(tmp_path: Path) -> None:
    """Two 64 KiB downloads at 256 KiB/s: together half a second, neither much sooner."""
    (tmp_path / "weights.bin").write_bytes(b"w" * (64 << 10))
    server = RangeServer("127.0.0.1", 0, "/v1/weights", lambda r, v, n: tmp_path / n, [],
                         link=Link(256 << 10))
    server.start()
    took: list[float] = []

    def fetch() -> None:
        start = time.monotonic()
        url = f"http://127.0.0.1:{server.port}/v1/weights/{RUN}/1/files/weights.bin"
        with urllib.request.urlopen(url, timeout=10) as reply:
            assert len(reply.read()) == 64 << 10
        took.append(time.monotonic() - start)

    try:
        threads = [threading.Thread(target=fetch) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        server.close()
    assert len(took) == 2 and min(took) >= 0.35 and max(took) >= 0.49


def publish(store: Store, version: int, content: bytes) -> dict[str, Any]:
    upload = store.open_upload(RUN, version, "model.bin")
    upload.write(content)
    upload.finish()
    return dict(store.commit(RUN, version)[0])


@pytest.mark.parametrize("deltas", [True, False])
def test_deltas_off_publishes_full_versions_only(tmp_path: Path, deltas: bool) -> None:
    store = Store(tmp_path, StoreLimits(chunk_bytes=4096, max_file_bytes=1 << 20,
                                        deltas=deltas))
    publish(store, 0, bytes(64 << 10))
    manifest = publish(store, 1, bytes((64 << 10) - 1) + b"\x01")  # a delta would pay off
    assert ("delta" in manifest) == deltas


@pytest.mark.parametrize("peers", [True, False])
def test_peers_off_lists_none(peers: bool) -> None:
    registry = PeerRegistry()
    registry.register(RUN, 1, "http://127.0.0.1:9999")
    service = SimpleNamespace(cfg=SimpleNamespace(peers=peers), peers=registry)
    reply = asyncio.run(list_peers(RUN, 1, service))  # type: ignore[arg-type]
    assert reply["peers"] == (["http://127.0.0.1:9999"] if peers else [])
