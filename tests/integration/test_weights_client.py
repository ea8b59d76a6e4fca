"""shared.weights (upload, wait, pull) against a real `python -m weight_svc` (64 KiB chunks)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shared.errors import WeightsError
from shared.weights import pull_version, upload_version, wait_for_version
from tests.integration.test_weight_svc import CHUNK, ServiceProcess

TOKEN = "tok"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    svc = ServiceProcess(tmp_path_factory.mktemp("svc"), token=TOKEN)
    svc.start()
    yield svc
    svc.stop()


def make_model(root: Path, weights_bytes: int) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "tiny"}')
    (root / "tokenizer.json").write_text('{"vocab": {}}')
    (root / "model.safetensors").write_bytes(os.urandom(weights_bytes))
    return root


def assert_same_files(model: Path, pulled: Path) -> None:
    for src in model.iterdir():
        assert (pulled / src.name).read_bytes() == src.read_bytes(), src.name


def bytes_served(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("rlboost_weights_bytes_served_total "):
            return float(line.split()[1])
    raise AssertionError("no bytes_served metric")


async def test_round_trip_multi_chunk(service: ServiceProcess, tmp_path: Path) -> None:
    model = make_model(tmp_path / "model", 1_000_003)
    manifest = await upload_version(service.url, TOKEN, "rt", 1, model)
    weights = next(f for f in manifest["files"] if f["name"] == "model.safetensors")
    assert len(weights["chunks"]) == -(-1_000_003 // CHUNK) > 1

    dest = tmp_path / "dest"
    out = await pull_version(service.url, TOKEN, "rt", 1, dest, parallel=4)
    assert out == dest / "rt" / "1"
    assert_same_files(model, out)
    assert sorted(p.name for p in (dest / "rt").iterdir()) == ["1"]  # no .partial left behind

    # Versions are immutable: a second pull answers from disk, without the service.
    started = time.monotonic()
    assert await pull_version("http://127.0.0.1:9", TOKEN, "rt", 1, dest) == out
    assert time.monotonic() - started < 0.1

    # Re-uploading is idempotent; different bytes under the same version are refused.
    assert await upload_version(service.url, TOKEN, "rt", 1, model) == manifest
    (model / "config.json").write_text('{"model_type": "other"}')
    with pytest.raises(WeightsError, match="different content") as exc:
        await upload_version(service.url, TOKEN, "rt", 1, model)
    assert exc.value.retryable is False


async def test_corrupt_chunk_at_source_fails_without_final_dir(
    service: ServiceProcess, tmp_path: Path
) -> None:
    model = make_model(tmp_path / "model", 400_000)
    await upload_version(service.url, TOKEN, "bad", 2, model)
    stored = service.data_dir / "weights" / "bad" / "2" / "model.safetensors"
    with stored.open("r+b") as f:  # rot one chunk in place after the commit
        f.seek(CHUNK + 10)
        f.write(b"\xff" * 16)

    dest = tmp_path / "dest"
    with pytest.raises(WeightsError, match="sha256 mismatch") as exc:
        await pull_version(service.url, TOKEN, "bad", 2, dest, parallel=2)
    assert exc.value.retryable is False
    assert not (dest / "bad" / "2").exists()


async def test_errors_are_weights_errors(service: ServiceProcess, tmp_path: Path) -> None:
    model = make_model(tmp_path / "model", 10)
    with pytest.raises(WeightsError, match="unauthorized") as exc:
        await upload_version(service.url, "wrong", "auth", 1, model)
    assert exc.value.retryable is False
    with pytest.raises(WeightsError, match="not published"):
        await pull_version(service.url, TOKEN, "auth", 1, tmp_path / "dest")
    with pytest.raises(WeightsError, match="invalid run id"):
        await pull_version(service.url, TOKEN, "../x", 1, tmp_path / "dest")
    with pytest.raises(WeightsError, match="gave up"):
        await pull_version("http://127.0.0.1:9", TOKEN, "auth", 1, tmp_path / "d", timeout_s=0.3)


async def test_wait_for_version(service: ServiceProcess, tmp_path: Path) -> None:
    model = make_model(tmp_path / "model", 1000)
    waiter = asyncio.create_task(wait_for_version(service.url, TOKEN, "wait", 4, timeout_s=20))
    await asyncio.sleep(0.3)
    assert not waiter.done()
    manifest = await upload_version(service.url, TOKEN, "wait", 4, model)
    assert await waiter == manifest
    with pytest.raises(WeightsError, match="not published within"):
        await wait_for_version(service.url, TOKEN, "wait", 5, timeout_s=0.5)


async def test_interrupted_pull_resumes_from_verified_chunks(
    service: ServiceProcess, tmp_path: Path
) -> None:
    size = 4 << 20
    model = make_model(tmp_path / "model", size)
    manifest = await upload_version(service.url, TOKEN, "resume", 1, model)
    dest = tmp_path / "dest"
    sidecar = dest / "resume" / ".partial-1" / ".chunks-done"
    pull = asyncio.create_task(pull_version(service.url, TOKEN, "resume", 1, dest, parallel=1))
    while not sidecar.exists() or len(sidecar.read_text().splitlines()) < 20:
        assert not pull.done()
        await asyncio.sleep(0.005)
    pull.cancel()  # the client "crashes" mid-pull
    with pytest.raises(asyncio.CancelledError):
        await pull
    assert not (dest / "resume" / "1").exists()

    sizes = {
        f"{f['name']} {c['offset']}": c["size"] for f in manifest["files"] for c in f["chunks"]
    }
    verified = sum(sizes[line] for line in sidecar.read_text().splitlines())
    total = sum(f["size"] for f in manifest["files"])
    await asyncio.sleep(0.2)  # let the server finish sending the chunk cut off by the cancel
    before = bytes_served(service.url)
    out = await pull_version(service.url, TOKEN, "resume", 1, dest)
    assert_same_files(model, out)
    assert bytes_served(service.url) - before == total - verified  # resumed


async def test_service_killed_mid_pull_then_restarted(
    service: ServiceProcess, tmp_path: Path
) -> None:
    size = 4 << 20
    model = make_model(tmp_path / "model", size)
    await upload_version(service.url, TOKEN, "kill", 3, model)
    dest = tmp_path / "dest"
    sidecar = dest / "kill" / ".partial-3" / ".chunks-done"
    pull = asyncio.create_task(
        pull_version(service.url, TOKEN, "kill", 3, dest, parallel=1, timeout_s=30)
    )
    while not sidecar.exists() or len(sidecar.read_text().splitlines()) < 10:
        assert not pull.done()
        await asyncio.sleep(0.005)
    await asyncio.to_thread(service.kill)  # SIGKILL: no goodbye
    await asyncio.sleep(0.5)
    assert not pull.done()  # riding out the outage
    await asyncio.to_thread(service.start)  # same port, same data dir
    out = await asyncio.wait_for(pull, 30)
    assert_same_files(model, out)
    assert bytes_served(service.url) < size  # the new process served only what was missing
