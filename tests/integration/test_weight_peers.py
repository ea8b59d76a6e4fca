"""Peer fan-out, version retention and puller crashes, against real `python -m weight_svc` and
real PeerServers (64 KiB chunks)."""

from __future__ import annotations

import asyncio
import http.client
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shared.errors import ConfigError, WeightsError
from shared.weights import PeerServer, list_peers, pin_version, pull_version, upload_version
from shared.weights import plan as weights_plan
from tests.integration.test_weight_svc import REPO, Serve, ServiceProcess, publish, serve  # noqa: F401
from tests.integration.test_weights_client import assert_same_files, bytes_served, make_model

TOKEN = "peer-tok"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    svc = ServiceProcess(tmp_path_factory.mktemp("svc"), token=TOKEN)
    svc.start()
    yield svc
    svc.stop()


@pytest.fixture
def peer_a(tmp_path: Path) -> Iterator[PeerServer]:
    peer = PeerServer(tmp_path / "a", TOKEN)
    peer.start()
    yield peer
    peer.close()


async def test_peer_registry_api(service: ServiceProcess, tmp_path: Path) -> None:
    await upload_version(service.url, TOKEN, "reg", 1, make_model(tmp_path / "m", 1000))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=service.url, headers=auth) as c:
        r = await c.post("/v1/weights/reg/1/peers", json={"url": "http://10.0.0.7:9000"})
        assert r.status_code == 200 and r.json()["ttl_s"] == 60
        assert (await c.post("/v1/weights/reg/1/peers", json={"url": "http://10.0.0.7:9000"}))
        for bad in ["ftp://x:1", "http://x", "http://x:1/path", "http://x:99999", 5, "a" * 400]:
            r = await c.post("/v1/weights/reg/1/peers", json={"url": bad})
            assert r.status_code == 422 and r.json()["detail"], bad
        r = await c.post("/v1/weights/reg/1/peers", json={"url": "http://x:1", "extra": 1})
        assert r.status_code == 422
        r = await c.post("/v1/weights/reg/2/peers", json={"url": "http://x:1"})
        assert r.status_code == 404  # only published versions have peers
    assert await list_peers(service.url, TOKEN, "reg", 1) == ["http://10.0.0.7:9000"]
    r = httpx.post(f"{service.url}/v1/weights/reg/1/peers", json={"url": "http://e:1"})
    assert r.status_code == 401
    with pytest.raises(WeightsError, match="unauthorized"):
        await list_peers(service.url, "wrong", "reg", 1)


async def test_joiner_takes_chunks_from_a_peer(
    service: ServiceProcess, peer_a: PeerServer, tmp_path: Path
) -> None:
    model = make_model(tmp_path / "model", 2_000_000)
    manifest = await upload_version(service.url, TOKEN, "fan", 1, model)
    total = sum(f["size"] for f in manifest["files"])
    before = bytes_served(service.url)
    await pull_version(service.url, TOKEN, "fan", 1, tmp_path / "a", serve=peer_a)
    assert bytes_served(service.url) - before == total  # the first instance: all from the service
    for _ in range(100):  # the peer registers in the background
        if await list_peers(service.url, TOKEN, "fan", 1) == [peer_a.url]:
            break
        await asyncio.sleep(0.05)
    assert await list_peers(service.url, TOKEN, "fan", 1) == [peer_a.url]

    before = bytes_served(service.url)
    out = await pull_version(service.url, TOKEN, "fan", 1, tmp_path / "b", peers=True)
    assert_same_files(model, out)
    from_service = bytes_served(service.url) - before
    assert from_service <= total // 4, from_service  # the rest came from the peer
    assert peer_a.bytes_served >= total - from_service


async def test_a_peer_that_claims_chunks_and_never_delivers_delays_a_joiner_only_briefly(
    service: ServiceProcess, peer_a: PeerServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(weights_plan, "CLAIM_MAX_S", 1.5)
    model = make_model(tmp_path / "model", 1_000_000)
    manifest = await upload_version(service.url, TOKEN, "stall", 1, model)
    total = sum(f["size"] for f in manifest["files"])
    every = list(range(sum(len(f["chunks"]) for f in manifest["files"])))
    # A joiner stuck mid-pull: it says it is fetching every chunk and holds none.
    (tmp_path / "stuck").mkdir()
    peer_a.offer("stall", 1, manifest, tmp_path / "stuck", set(), lambda: every)
    peer_a.advertise(service.url, "stall", 1)
    while await list_peers(service.url, TOKEN, "stall", 1) != [peer_a.url]:
        await asyncio.sleep(0.05)
    before, started = bytes_served(service.url), time.monotonic()
    out = await asyncio.wait_for(  # claims that never lapse would hold it back for good
        pull_version(service.url, TOKEN, "stall", 1, tmp_path / "b", peers=True), 20)
    elapsed = time.monotonic() - started
    assert_same_files(model, out)
    assert bytes_served(service.url) - before == total  # all of it from the service, once
    assert 1.2 <= elapsed < 10, elapsed  # it waited for the claims, and only until they lapsed


async def test_a_peer_bound_to_every_address_announces_one_its_neighbours_can_reach(
    service: ServiceProcess, tmp_path: Path
) -> None:
    model = make_model(tmp_path / "model", 1_000_000)
    await upload_version(service.url, TOKEN, "wild", 1, model)
    peer = PeerServer.from_env(tmp_path / "a", TOKEN, {"RLBOOST_PEER_ADDR": "0.0.0.0"})
    peer.start()
    try:
        own = f"http://127.0.0.1:{peer.server.port}"  # the route to a service on loopback
        assert peer.url_for(service.url) == own
        await pull_version(service.url, TOKEN, "wild", 1, tmp_path / "a", serve=peer)
        while await list_peers(service.url, TOKEN, "wild", 1) != [own]:
            await asyncio.sleep(0.05)
        before = bytes_served(service.url)
        out = await pull_version(service.url, TOKEN, "wild", 1, tmp_path / "b", peers=True)
        assert_same_files(model, out)
        assert bytes_served(service.url) - before <= 1_000_000 // 4  # the rest from the peer
    finally:
        peer.close()


def test_where_a_peer_is_announced(tmp_path: Path) -> None:
    local = PeerServer(tmp_path / "a", TOKEN)  # 127.0.0.1
    try:
        assert local.url_for("http://127.0.0.1:8001") == local.url
        # Loopback means nothing to a service (and its joiners) on another machine: stay quiet.
        assert local.url_for("http://10.20.30.40:8001") is None
    finally:
        local.close()
    env = {"RLBOOST_PEER_ADDR": "0.0.0.0", "RLBOOST_PEER_URL": "http://spot-7.example:8003"}
    published = PeerServer.from_env(tmp_path / "b", TOKEN, env)
    try:
        assert published.url_for("http://10.20.30.40:8001") == "http://spot-7.example:8003"
    finally:
        published.close()
    # What the weight service would refuse at every registration is refused at start-up.
    for bad in ["ftp://x:1", "http://x", "http://x:1/path", "http://x:99999", "x:1",
                "http://x:8003/", "http://spot_7:8003", "http://x:0", "http://[::1]:8003"]:
        with pytest.raises(ConfigError, match="RLBOOST_PEER_URL"):
            PeerServer.from_env(tmp_path / "c", TOKEN, {"RLBOOST_PEER_URL": bad})


async def test_peer_with_bad_bytes_is_dropped(
    service: ServiceProcess, peer_a: PeerServer, tmp_path: Path
) -> None:
    model = make_model(tmp_path / "model", 1_000_000)
    await upload_version(service.url, TOKEN, "rot", 1, model)
    held = await pull_version(service.url, TOKEN, "rot", 1, tmp_path / "a", serve=peer_a)
    with (held / "model.safetensors").open("r+b") as f:  # the peer's copy rots after its pull
        f.write(b"\x00" * 1_000_000)
    while await list_peers(service.url, TOKEN, "rot", 1) != [peer_a.url]:
        await asyncio.sleep(0.05)
    before = bytes_served(service.url)
    out = await pull_version(service.url, TOKEN, "rot", 1, tmp_path / "b", peers=True)
    assert_same_files(model, out)  # every bad chunk was refetched from the service
    assert peer_a.bytes_served > 0  # the peer was asked, and its bytes were refused
    assert bytes_served(service.url) - before >= 1_000_000 // 2


async def test_peer_server_serves_only_verified_ranges(
    service: ServiceProcess, peer_a: PeerServer, tmp_path: Path
) -> None:
    model = make_model(tmp_path / "model", 300_000)
    manifest = await upload_version(service.url, TOKEN, "ps", 1, model)
    await pull_version(service.url, TOKEN, "ps", 1, tmp_path / "a", serve=peer_a)
    data = (model / "model.safetensors").read_bytes()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    url = f"{peer_a.url}/v1/peer/ps/1/files/model.safetensors"
    r = httpx.get(url, headers={**auth, "Range": "bytes=10-99"})
    assert r.status_code == 206 and r.content == data[10:100]
    assert httpx.get(url, headers={"Range": "bytes=10-99"}).status_code == 401
    assert httpx.get(f"{peer_a.url}/v1/peer/ps/1/have", headers=auth).json()["complete"] is True
    assert httpx.get(f"{peer_a.url}/v1/peer/ps/2/have", headers=auth).status_code == 404

    # A pull in progress offers exactly its verified chunks.
    chunks = manifest["files"][1]["chunks"]
    done = {1}  # chunk 0 is config.json; 1 is the first chunk of the weights
    peer_a.offer("ps", 3, {**manifest, "version": 3}, tmp_path / "a" / "ps" / "1", done)
    first = chunks[0]
    ok = f"bytes={first['offset']}-{first['offset'] + first['size'] - 1}"
    r = httpx.get(f"{peer_a.url}/v1/peer/ps/3/files/model.safetensors",
                  headers={**auth, "Range": ok})
    assert r.status_code == 206
    second = chunks[1]
    other = f"bytes={second['offset']}-{second['offset'] + second['size'] - 1}"
    r = httpx.get(f"{peer_a.url}/v1/peer/ps/3/files/model.safetensors",
                  headers={**auth, "Range": other})
    assert r.status_code == 404 and r.json()["detail"]
    assert httpx.get(f"{peer_a.url}/v1/peer/ps/3/have", headers=auth).json()["chunks"] == [1]
    host, port = peer_a.url.removeprefix("http://").split(":")
    for path in ["/v1/peer/ps/1/files/..%2f..%2fx", "/v1/peer/../1/files/x",
                 "/v1/peer/ps/1/files/.hidden", "/v1/peer/ps/1/files/manifest.json"]:
        conn = http.client.HTTPConnection(host, int(port), timeout=5)
        conn.request("GET", path, headers=auth)
        resp = conn.getresponse()
        assert 400 <= resp.status < 500 and b"detail" in resp.read(), path
        conn.close()


async def test_newest_two_versions_are_never_collected(serve: Serve) -> None:  # noqa: F811
    url = await serve(keep=1)
    async with httpx.AsyncClient(base_url=url) as c:
        for v in (1, 2, 3):
            await publish(c, "keep", v, {"w": bytes([v])})
        assert (await c.get("/v1/weights/keep")).json()["versions"] == [2, 3]
    await pin_version(url, None, "keep", 2)
    async with httpx.AsyncClient(base_url=url) as c:
        await publish(c, "keep", 4, {"w": b"4"})
        await publish(c, "keep", 5, {"w": b"5"})
        assert (await c.get("/v1/weights/keep")).json()["versions"] == [2, 4, 5]


PULLER = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from shared.weights import pull_version
    asyncio.run(pull_version(sys.argv[1], sys.argv[2], "crash", 1, Path(sys.argv[3]), parallel=1))
""")


async def test_puller_sigkilled_mid_pull_leaves_no_version(
    service: ServiceProcess, tmp_path: Path
) -> None:
    model = make_model(tmp_path / "model", 8 << 20)
    await upload_version(service.url, TOKEN, "crash", 1, model)
    dest = tmp_path / "dest"
    sidecar = dest / "crash" / ".partial-1" / ".chunks-done"
    proc = subprocess.Popen([sys.executable, "-c", PULLER, service.url, TOKEN, str(dest)],
                            cwd=REPO)
    try:
        while not sidecar.exists() or len(sidecar.read_text().splitlines()) < 10:
            assert proc.poll() is None, "the puller finished before it could be killed"
            await asyncio.sleep(0.005)
    finally:
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    assert not (dest / "crash" / "1").exists()  # nothing an engine could load
    out = await pull_version(service.url, TOKEN, "crash", 1, dest)
    assert_same_files(model, out)
    assert sorted(p.name for p in (dest / "crash").iterdir()) == ["1"]
