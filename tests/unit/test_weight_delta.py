"""shared.weights.delta on files: build a blob, apply it, and what a bad base or blob costs."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from shared.errors import WeightsError
from shared.weights.delta import apply_delta, build_delta, check_delta
from shared.weights.manifest import Chunk, FileEntry, Manifest, chunks_of, delta_name

CHUNK = 1 << 18


def entry(path: Path, name: str | None = None) -> FileEntry:
    data = path.read_bytes()
    chunks = [{"offset": o, "size": len(data[o:o + CHUNK]),
               "sha256": hashlib.sha256(data[o:o + CHUNK]).hexdigest()}
              for o in range(0, len(data), CHUNK)]
    return {"name": name or path.name, "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(), "chunks": chunks}  # type: ignore[typeddict-item]


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path, Manifest]:
    """A base and a version: weights with 1 % of fp32 words changed, a config that stayed, a
    file only the version has and one whose size changed."""
    base, new = tmp_path / "base", tmp_path / "new"
    base.mkdir()
    new.mkdir()
    w = np.random.default_rng(0).standard_normal(600_000).astype(np.float32)
    (base / "w.bin").write_bytes(w.tobytes())
    w[::100] += 1e-3
    (new / "w.bin").write_bytes(w.tobytes())
    for d in (base, new):
        (d / "config.json").write_text('{"a": 1}')
    (new / "added.txt").write_text("only in the version")
    (base / "grown.txt").write_text("short")
    (new / "grown.txt").write_text("longer than before")
    names = sorted(p.name for p in new.iterdir())
    blob = tmp_path / delta_name(1)
    sections = build_delta(base, new, names, blob)
    manifest: Manifest = {"run_id": "r", "version": 2, "chunk_bytes": CHUNK,
                          "files": [entry(new / n) for n in names],
                          "delta": {"base": 1, "file": entry(blob), "sections": sections}}
    return base, new, manifest


def rebuild(manifest: Manifest, blob: Path, base: Path, out: Path,
            skip: set[int] = set()) -> tuple[list[str], list[Chunk]]:  # noqa: B006
    out.mkdir(exist_ok=True)
    fds = {}
    for f in manifest["files"]:
        fds[f["name"]] = os.open(out / f["name"], os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(fds[f["name"]], f["size"])
    got: list[Chunk] = []
    try:
        return apply_delta(manifest, blob, base, fds, got.append, skip), got
    finally:
        for fd in fds.values():
            os.close(fd)


def test_round_trip_is_bit_for_bit_and_small(pair: tuple[Path, Path, Manifest],
                                             tmp_path: Path) -> None:
    base, new, manifest = pair
    delta = manifest["delta"]
    modes = {s["name"]: s["mode"] for s in delta["sections"]}
    assert modes == {"added.txt": "raw", "config.json": "xor", "grown.txt": "raw", "w.bin": "xor"}
    assert delta["file"]["size"] < (new / "w.bin").stat().st_size / 4
    bad, got = rebuild(manifest, tmp_path / delta["file"]["name"], base, tmp_path / "out")
    assert bad == [] and len(got) == len(chunks_of(manifest))
    for p in new.iterdir():
        assert (tmp_path / "out" / p.name).read_bytes() == p.read_bytes()


def test_damaged_base_fails_only_its_chunk(pair: tuple[Path, Path, Manifest],
                                           tmp_path: Path) -> None:
    base, _, manifest = pair
    data = bytearray((base / "w.bin").read_bytes())
    data[CHUNK + 5] ^= 1  # in the weights' second chunk
    (base / "w.bin").write_bytes(bytes(data))
    bad, got = rebuild(manifest, tmp_path / manifest["delta"]["file"]["name"], base,
                       tmp_path / "out")
    assert bad == ["w.bin"]
    missing = {(c.name, c.offset) for c in chunks_of(manifest)} - {(c.name, c.offset) for c in got}
    assert missing == {("w.bin", CHUNK)}


def test_garbled_blob_reports_its_files(pair: tuple[Path, Path, Manifest], tmp_path: Path) -> None:
    base, _, manifest = pair
    blob = tmp_path / manifest["delta"]["file"]["name"]
    data = bytearray(blob.read_bytes())
    w = next(s for s in manifest["delta"]["sections"] if s["name"] == "w.bin")
    data[w["offset"] + w["size"] // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    bad, got = rebuild(manifest, blob, base, tmp_path / "out")
    assert bad == ["w.bin"]
    assert {c.name for c in got} >= {"added.txt", "config.json", "grown.txt"}


def test_verified_chunks_are_never_rewritten(pair: tuple[Path, Path, Manifest],
                                             tmp_path: Path) -> None:
    base, _, manifest = pair
    out = tmp_path / "out"
    out.mkdir()
    first = next(c for c in chunks_of(manifest) if c.name == "w.bin")
    (out / "w.bin").write_bytes(b"\x07" * first.size)  # stands for bytes verified earlier
    _, got = rebuild(manifest, tmp_path / manifest["delta"]["file"]["name"], base, out,
                     skip={first.number})
    assert first not in got
    assert (out / "w.bin").read_bytes()[:first.size] == b"\x07" * first.size


def test_check_delta_refuses_bad_entries(pair: tuple[Path, Path, Manifest]) -> None:
    _, _, manifest = pair
    check_delta(manifest)
    delta = manifest["delta"]
    for broken in ({**delta, "base": 2}, {**delta, "sections": delta["sections"][1:]},
                   {**delta, "file": {**delta["file"], "name": "../x"}},
                   {**delta, "sections": [{**delta["sections"][0], "size": 1 << 40},
                                          *delta["sections"][1:]]}):
        with pytest.raises(WeightsError):
            check_delta({**manifest, "delta": broken})  # type: ignore[typeddict-item]
