"""Adapter-only versions against a real `python -m weight_svc`: what a commit accepts (and the
422 it answers otherwise), collection sparing the base, and pullers that pull the base once
and then adapters only, including after a restart with the base on disk and with a base on
disk that is not the one named, and a base pre-seeded in the instance's image."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shared.weights import PullStats, pull_version, upload_adapter_version, upload_version
from shared.weights import pull as pull_module
from shared.weights.manifest import ADAPTER_BASE_NAME, ADAPTER_FILES, ADAPTER_SUFFIX
from tests.integration.test_weight_svc import ServiceProcess
from tests.integration.test_weights_client import TOKEN, assert_same_files, make_model

BASE_BYTES = 300_000


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    svc = ServiceProcess(tmp_path_factory.mktemp("svc"), token=TOKEN, RLBOOST_WEIGHTS_KEEP="2")
    svc.start()
    yield svc
    svc.stop()


def lora_version(root: Path, seed: int) -> Path:
    """A version directory as a LoRA trainer writes it: the merged model and the adapter's
    files under the hidden suffix."""
    model = make_model(root, BASE_BYTES)
    (model / (ADAPTER_FILES[0] + ADAPTER_SUFFIX)).write_bytes(os.urandom(3000 + seed))
    (model / (ADAPTER_FILES[1] + ADAPTER_SUFFIX)).write_text(json.dumps({"r": 4, "seed": seed}))
    return model


def adapter_dir(root: Path, seed: int) -> Path:
    """An adapter version's files as they are uploaded, before the reference is added."""
    root.mkdir(parents=True)
    (root / ADAPTER_FILES[0]).write_bytes(os.urandom(3000 + seed))
    (root / ADAPTER_FILES[1]).write_text(json.dumps({"r": 4, "seed": seed}))
    return root


def commit_with(url: str, run: str, version: int, files: dict[str, bytes]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=url, headers=headers) as client:
        for name, body in files.items():
            client.put(f"/v1/weights/{run}/{version}/files/{name}", content=body
                       ).raise_for_status()
        return client.post(f"/v1/weights/{run}/{version}/commit")


async def test_commit_checks_the_reference(service: ServiceProcess, tmp_path: Path) -> None:
    base = await upload_version(service.url, TOKEN, "chk", 0, make_model(tmp_path / "m", 1000))
    full = await upload_version(service.url, TOKEN, "chk", 1, make_model(tmp_path / "n", 999))
    ok = await upload_adapter_version(service.url, TOKEN, "chk", 2,
                                      lora_version(tmp_path / "l", 1), base=0)
    assert ok["adapter"]["base"] == 0 and "delta" not in ok
    assert sorted(f["name"] for f in ok["files"]) == sorted([*ADAPTER_FILES, ADAPTER_BASE_NAME])
    good = json.loads((service.data_dir / "weights" / "chk" / "2" / ADAPTER_BASE_NAME
                       ).read_text())
    adapter = {n: b"x" for n in ADAPTER_FILES}
    cases = [
        (b"not json", "rlboost-base.json"),
        (json.dumps({"base": 0}).encode(), "base_sha256"),
        (json.dumps({**good, "base": 7}).encode(), "not an older version"),
        (json.dumps({**good, "base": 1}).encode(), "not the content hash"),
        (json.dumps({**good, "base": 2}).encode(), "adapter itself"),
        (json.dumps({**good, "note": "x" * 5000}).encode(), "larger than"),
    ]
    for ref, detail in cases:
        resp = commit_with(service.url, "chk", 5, {**adapter, ADAPTER_BASE_NAME: ref})
        assert resp.status_code == 422 and detail in resp.json()["detail"], resp.text
    resp = commit_with(service.url, "chk", 5, {ADAPTER_FILES[0]: b"x",
                                               ADAPTER_BASE_NAME: json.dumps(good).encode()})
    assert resp.status_code == 422 and "lacks" in resp.json()["detail"], resp.text
    resp = commit_with(service.url, "other", 1, {**adapter,
                                                 ADAPTER_BASE_NAME: json.dumps(good).encode()})
    assert resp.status_code == 422 and "not published" in resp.json()["detail"], resp.text
    assert base["files"] and full["files"]


async def test_base_once_then_adapters_only(service: ServiceProcess, tmp_path: Path) -> None:
    run, dest = "lora", tmp_path / "inst"
    base = await upload_version(service.url, TOKEN, run, 0, lora_version(tmp_path / "v0", 0))
    full_bytes = sum(f["size"] for f in base["files"])
    manifests = [await upload_adapter_version(service.url, TOKEN, run, v,
                                              lora_version(tmp_path / f"v{v}", v), base=0)
                 for v in range(1, 5)]
    # Collection keeps the newest two and the base they name, though RLBOOST_WEIGHTS_KEEP=2.
    versions = httpx.get(f"{service.url}/v1/weights/{run}",
                         headers={"Authorization": f"Bearer {TOKEN}"}).json()["versions"]
    assert versions == [0, 3, 4]
    for m in manifests:
        size = sum(f["size"] for f in m["files"])
        assert size <= 0.05 * full_bytes, (size, full_bytes)

    first = PullStats()
    pulled = await pull_version(service.url, TOKEN, run, 3, dest, stats=first)
    assert (first.kind, first.base_source) == ("adapter", "pulled")
    assert first.base is not None and first.base.kind == "full"
    assert first.base.bytes_from_service == full_bytes
    assert first.base_dir == dest / run / "0"
    assert_same_files(tmp_path / "v0", first.base_dir)
    assert first.bytes_from_service == sum(f["size"] for f in manifests[2]["files"])
    assert sorted(p.name for p in pulled.iterdir() if p.name != "manifest.json") == sorted(
        [*ADAPTER_FILES, ADAPTER_BASE_NAME])

    second = PullStats()
    await pull_version(service.url, TOKEN, run, 4, dest, stats=second)
    assert (second.kind, second.base_source, second.base) == ("adapter", "disk", None)
    assert second.bytes_from_service == sum(f["size"] for f in manifests[3]["files"])

    # A restarted instance (a new process: nothing verified yet) with the base on disk.
    pull_module._verified_bases.clear()
    again = PullStats()
    await pull_version(service.url, TOKEN, run, 4, dest, stats=again)
    assert (again.kind, again.base_source) == ("local", "disk")
    await upload_adapter_version(service.url, TOKEN, run, 5, lora_version(tmp_path / "v5", 5),
                                 base=0)
    pull_module._verified_bases.clear()
    restarted = PullStats()
    await pull_version(service.url, TOKEN, run, 5, dest, stats=restarted)
    assert (restarted.kind, restarted.base_source) == ("adapter", "disk")


async def test_a_base_on_disk_that_is_not_it_is_pulled_again(
        service: ServiceProcess, tmp_path: Path) -> None:
    run, dest = "swap", tmp_path / "inst"
    await upload_version(service.url, TOKEN, run, 0, lora_version(tmp_path / "v0", 0))
    await upload_adapter_version(service.url, TOKEN, run, 1, lora_version(tmp_path / "v1", 1),
                                 base=0)
    await upload_adapter_version(service.url, TOKEN, run, 2, lora_version(tmp_path / "v2", 2),
                                 base=0)
    await pull_version(service.url, TOKEN, run, 1, dest)
    weights = dest / run / "0" / "model.safetensors"
    damaged = bytearray(weights.read_bytes())
    damaged[100] ^= 0xFF  # same size: only the bytes' hash can tell
    weights.write_bytes(bytes(damaged))
    pull_module._verified_bases.clear()  # as after a restart: the disk is trusted by hash only
    stats = PullStats()
    await pull_version(service.url, TOKEN, run, 2, dest, stats=stats)
    assert (stats.kind, stats.base_source) == ("adapter", "replaced")
    assert stats.base is not None and stats.base.kind == "full"
    assert_same_files(tmp_path / "v0", dest / run / "0")

    # A base gone from disk (deleted by hand, a fresh disk): pulled, not trusted to exist.
    (dest / run / "0" / "manifest.json").unlink()
    stats = PullStats()
    await pull_version(service.url, TOKEN, run, 2, dest, stats=stats)
    assert (stats.kind, stats.base_source) == ("local", "pulled")
    assert_same_files(tmp_path / "v0", dest / run / "0")


async def test_a_pre_seeded_base_is_used_when_its_files_match(
        service: ServiceProcess, tmp_path: Path) -> None:
    """RLBOOST_SEEDED_BASES_DIR: a base baked into the image (its model files, without the
    run's initial adapter) is used in place of a pull, once its files hash to the reference."""
    run, dest, seeded = "seed", tmp_path / "inst", tmp_path / "image"
    source = lora_version(tmp_path / "v0", 0)
    await upload_version(service.url, TOKEN, run, 0, source)
    m1 = await upload_adapter_version(service.url, TOKEN, run, 1,
                                      lora_version(tmp_path / "v1", 1), base=0)
    image = seeded / m1["adapter"]["base_sha256"]
    image.mkdir(parents=True)
    for path in source.iterdir():
        if not path.name.endswith(ADAPTER_SUFFIX):
            (image / path.name).write_bytes(path.read_bytes())
    stats = PullStats()
    await pull_version(service.url, TOKEN, run, 1, dest, stats=stats, seeded=seeded)
    assert (stats.kind, stats.base_source, stats.base_dir, stats.base) == (
        "adapter", "seeded", image, None)
    assert not (dest / run / "0").exists()
    assert stats.bytes_from_service == sum(f["size"] for f in m1["files"])

    # An image whose files are not the base's (one byte changed) is not used: pulled instead.
    other = tmp_path / "other"
    weights = (image / "model.safetensors").read_bytes()
    shutil.copytree(image, other / image.name)
    (other / image.name / "model.safetensors").write_bytes(bytes([weights[0] ^ 1]) + weights[1:])
    stats = PullStats()
    await pull_version(service.url, TOKEN, run, 1, tmp_path / "inst2", stats=stats,
                       seeded=other)
    assert stats.base_source == "pulled" and stats.base_dir == tmp_path / "inst2" / run / "0"
