"""Delta versions against a real `python -m weight_svc`: versions made by real optimizer steps of
a small Qwen2 model (fp32 master weights, published in bf16, as an engine loads them)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from shared.weights import PullStats, pull_version, upload_version
from tests.integration.test_weight_svc import ServiceProcess
from tests.integration.test_weights_client import TOKEN, service

__all__ = ["service"]  # the fixture: one `python -m weight_svc` for this module


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three versions: the initial model, then one AdamW step each (lr 1e-5)."""
    root = tmp_path_factory.mktemp("model")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=1024, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    out = []
    for v in range(3):
        if v:
            ids = torch.randint(0, cfg.vocab_size, (4, 32))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        d = root / f"v{v}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg.to_dict(), sort_keys=True))
        save_file({k: t.detach().to(torch.bfloat16).contiguous()
                   for k, t in model.state_dict().items()}, str(d / "model.safetensors"))
        out.append(d)
    return out


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics").text
    m = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m[1]) if m else 0.0


def same_files(model: Path, pulled: Path) -> None:
    for src in model.iterdir():
        assert (pulled / src.name).read_bytes() == src.read_bytes(), src.name


async def publish(url: str, run: str, versions: list[Path]) -> list[dict]:  # type: ignore[type-arg]
    return [dict(await upload_version(url, TOKEN, run, v + 1, d)) for v, d in enumerate(versions)]


async def test_delta_pull_rebuilds_the_version_bit_for_bit(
        service: ServiceProcess, versions: list[Path], tmp_path: Path) -> None:
    kept = metric(service.url, "rlboost_weights_deltas_total", '{outcome="kept"}')
    m1, m2, m3 = await publish(service.url, "d", versions)
    assert "delta" not in m1  # nothing to be a delta from
    assert metric(service.url, "rlboost_weights_deltas_total", '{outcome="kept"}') == kept + 2
    delta, full = m2["delta"], sum(f["size"] for f in m2["files"])
    assert delta["base"] == 1 and [s["name"] for s in delta["sections"]] == [
        "config.json", "model.safetensors"]
    assert delta["file"]["size"] < full / 4  # one small step leaves most bf16 words as they were
    blob = service.data_dir / "weights" / "d" / "2" / delta["file"]["name"]
    assert blob.stat().st_size == delta["file"]["size"]

    dest = tmp_path / "dest"
    one = PullStats()
    same_files(versions[0], await pull_version(service.url, TOKEN, "d", 1, dest, stats=one))
    assert (one.kind, one.fallback, one.bytes_from_service) == ("full", None, m1["files"][1]["size"]
                                                                + m1["files"][0]["size"])
    served = metric(service.url, "rlboost_weights_bytes_served_total")
    two = PullStats()
    out = await pull_version(service.url, TOKEN, "d", 2, dest, stats=two)
    same_files(versions[1], out)  # the trainer's bytes, bit for bit
    assert (two.kind, two.fallback) == ("delta", None)
    assert (two.delta_bytes, two.bytes_from_service) == (delta["file"]["size"], 0)
    # What crossed the wire is the blob: the manifest's figure, not the version's.
    assert metric(service.url, "rlboost_weights_bytes_served_total") - served == \
        delta["file"]["size"]
    assert sorted(p.name for p in (dest / "d").iterdir()) == ["1", "2"]  # no scratch left
    three = PullStats()
    same_files(versions[2], await pull_version(service.url, TOKEN, "d", 3, dest, stats=three))
    assert three.kind == "delta" and three.delta_bytes == m3["delta"]["file"]["size"]


async def test_puller_without_the_base_pulls_full(
        service: ServiceProcess, versions: list[Path], tmp_path: Path) -> None:
    _, m2, _ = await publish(service.url, "nb", versions)
    stats = PullStats()
    out = await pull_version(service.url, TOKEN, "nb", 2, tmp_path / "dest", stats=stats)
    same_files(versions[1], out)
    assert (stats.kind, stats.fallback, stats.delta_bytes) == ("full", "no_base", 0)
    assert stats.bytes_from_service == sum(f["size"] for f in m2["files"])


async def test_missing_base_file_falls_back_to_full(
        service: ServiceProcess, versions: list[Path], tmp_path: Path) -> None:
    await publish(service.url, "mb", versions)
    dest = tmp_path / "dest"
    await pull_version(service.url, TOKEN, "mb", 1, dest)
    (dest / "mb" / "1" / "model.safetensors").unlink()  # the base is no longer whole
    stats = PullStats()
    same_files(versions[1], await pull_version(service.url, TOKEN, "mb", 2, dest, stats=stats))
    assert (stats.kind, stats.fallback) == ("full", "no_base")


async def test_corrupt_delta_is_detected_and_the_full_pull_used(
        service: ServiceProcess, versions: list[Path], tmp_path: Path) -> None:
    _, m2, _ = await publish(service.url, "cd", versions)
    blob = service.data_dir / "weights" / "cd" / "2" / m2["delta"]["file"]["name"]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x40  # rot one byte of the stored delta
    blob.write_bytes(bytes(data))
    dest = tmp_path / "dest"
    await pull_version(service.url, TOKEN, "cd", 1, dest)
    stats = PullStats()
    same_files(versions[1], await pull_version(service.url, TOKEN, "cd", 2, dest, stats=stats))
    assert (stats.kind, stats.fallback) == ("full", "corrupt")
    assert stats.bytes_from_service == sum(f["size"] for f in m2["files"])
    assert not (dest / "cd" / ".delta-2").exists()


async def test_damaged_base_is_caught_by_the_rebuilds_hashes(
        service: ServiceProcess, versions: list[Path], tmp_path: Path) -> None:
    """The blob is sound but the puller's base is not: only the rebuild's sha256 can tell, and
    only the chunks that fail it are fetched."""
    _, m2, _ = await publish(service.url, "db", versions)
    dest = tmp_path / "dest"
    base = await pull_version(service.url, TOKEN, "db", 1, dest)
    weights = base / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1000] ^= 0x01  # same size: the base still looks whole
    weights.write_bytes(bytes(data))
    stats = PullStats()
    same_files(versions[1], await pull_version(service.url, TOKEN, "db", 2, dest, stats=stats))
    assert (stats.kind, stats.fallback) == ("full", "mismatch")
    assert stats.delta_bytes == m2["delta"]["file"]["size"]
    assert stats.bytes_from_service == m2["files"][1]["chunks"][-1]["size"]  # one chunk refetched


async def test_unrelated_versions_get_no_delta(service: ServiceProcess, tmp_path: Path) -> None:
    too_large = metric(service.url, "rlboost_weights_deltas_total", '{outcome="too_large"}')
    for v in (1, 2):
        d = tmp_path / f"r{v}"
        d.mkdir()
        (d / "model.safetensors").write_bytes(torch.randn(200_000).numpy().tobytes())
        manifest = await upload_version(service.url, TOKEN, "un", v, d)
    assert "delta" not in manifest  # random bytes XOR random bytes: nothing to gain
    assert metric(service.url, "rlboost_weights_deltas_total",
                  '{outcome="too_large"}') == too_large + 1
    assert sorted(p.name for p in (service.data_dir / "weights" / "un" / "2").iterdir()) == [
        "manifest.json", "model.safetensors"]


async def test_reserved_delta_name_cannot_be_uploaded(
        service: ServiceProcess, tmp_path: Path) -> None:
    async with httpx.AsyncClient(base_url=service.url,
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        r = await c.put("/v1/weights/rs/1/files/rlboost-delta-0", content=b"x")
    assert r.status_code == 422 and "reserved" in r.json()["detail"]
