"""Delta versions: a version's files as their bitwise XOR with the version before, compressed.

Contract (the service builds a delta at commit, a puller holding the base applies it):
- The delta of version n against base b = n-1 is one file of version n's directory, named
  :func:`~shared.weights.manifest.delta_name` (``rlboost-delta-<b>``; a reserved name, never
  uploaded), described by the manifest's ``delta`` entry: ``base``, ``file`` (the blob's own
  entry: size, sha256 and chunks, so it is fetched, verified and resumed like any file) and one
  ``section`` per file of version n, in manifest order. A section is one zstd frame: mode
  ``xor``, the file XOR the base's file of the same name and size (a bf16 or fp32 word that did
  not change is zero, and runs of zeros cost next to nothing); mode ``raw``, the file itself
  (the base has no file of that name and size).
- :func:`build_delta` writes the blob and returns its sections; the service keeps it only when
  it is at most ``DELTA_MAX_FRACTION`` of the version's bytes.
- :func:`apply_delta` rebuilds each file into the pull's pre-sized files, chunk by chunk, and
  hashes every chunk and every whole file against version n's manifest: a chunk is reported
  (and so may be recorded as done) only when its sha256 matches; a file whose bytes, whole
  sha256 or frame length are wrong is named in the result, and its unverified chunks are left
  to a full fetch. Nothing here trusts the base or the blob: a damaged base, a blob built from
  another base or a corrupt frame each end as chunks that fail their hash.

Memory stays bounded whatever the file size: both directions stream ``BLOCK`` bytes at a time.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Collection
from pathlib import Path
from typing import IO, BinaryIO, cast

import numpy as np
import zstandard

from shared.errors import WeightsError
from shared.weights.manifest import (
    MAX_VERSION,
    Chunk,
    DeltaEntry,
    DeltaSection,
    Manifest,
    check_file,
    chunks_of,
    delta_name,
)

BLOCK = 4 << 20  # read, XOR, compress, hash and write unit
LEVEL = 3  # zstd's default: ~1.5x level 1's ratio on fp32 low bits, still hundreds of MB/s
# Applying a delta costs a puller about a verified full pull's CPU (every byte is read from the
# base, decompressed, XORed, hashed and written); what it saves is transfer. At half the bytes
# it still halves the transfer over the links joiners use (1-10 Gb/s, often across regions);
# above that the saving is small against the service's extra disk and build time.
DELTA_MAX_FRACTION = 0.5


def check_delta(manifest: Manifest) -> DeltaEntry:
    """The manifest's delta entry, refused unless it is well formed: a valid blob entry under
    the reserved name for its base, and one in-bounds section per file in manifest order."""
    delta = manifest.get("delta")
    if delta is None:
        raise WeightsError(f"{manifest['run_id']}/{manifest['version']} has no delta", False)
    base, blob = delta["base"], delta["file"]
    if not (isinstance(base, int) and 0 <= base < manifest["version"] <= MAX_VERSION):
        raise WeightsError(f"delta base {base!r} is not an older version", False)
    check_file(blob)
    if blob["name"] != delta_name(base):
        raise WeightsError(f"delta blob named {blob['name']!r}, not {delta_name(base)!r}", False)
    names = [s["name"] for s in delta["sections"]]
    if names != [f["name"] for f in manifest["files"]]:
        raise WeightsError("delta sections do not match the version's files", False)
    for s in delta["sections"]:
        if s["mode"] not in ("xor", "raw") or s["offset"] < 0 or s["size"] <= 0 or \
                s["offset"] + s["size"] > blob["size"]:
            raise WeightsError(f"delta section of {s['name']} is out of bounds", False)
    return delta


def _xor(a: bytes, b: bytes) -> bytes:
    # A short ``b`` (a base truncated under the puller) is padded: the result's hash then fails.
    b = b.ljust(len(a), b"\0")
    return np.bitwise_xor(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)).tobytes()


def build_delta(base_dir: Path, new_dir: Path, names: list[str], out: Path,
                threads: int = 0) -> list[DeltaSection]:
    """Write the blob of ``new_dir``'s files ``names`` against ``base_dir`` to ``out`` (fsynced);
    its sections. ``threads``: zstd worker threads (0: compress on the calling thread)."""
    cctx = zstandard.ZstdCompressor(level=LEVEL, threads=threads)
    sections: list[DeltaSection] = []
    with out.open("wb") as f:
        for name in names:
            new, base = new_dir / name, base_dir / name
            size = new.stat().st_size
            xor = base.is_file() and base.stat().st_size == size
            start = f.tell()
            comp = cctx.compressobj(size=size)
            with new.open("rb") as src, (base.open("rb") if xor else open(os.devnull, "rb")) as b:
                while block := src.read(BLOCK):
                    f.write(comp.compress(_xor(block, b.read(len(block))) if xor else block))
            f.write(comp.flush())
            sections.append({"name": name, "mode": "xor" if xor else "raw", "offset": start,
                             "size": f.tell() - start})
        f.flush()
        os.fsync(f.fileno())
    return sections


class _Frame:
    """Exactly one section's frame of the blob, read as a file: zstd sees no byte past it."""

    def __init__(self, f: BinaryIO, offset: int, size: int) -> None:
        self._f, self._pos, self._end = f, offset, offset + size

    def read(self, n: int = -1) -> bytes:
        n = self._end - self._pos if n < 0 else min(n, self._end - self._pos)
        data = os.pread(self._f.fileno(), n, self._pos) if n > 0 else b""
        self._pos += len(data)
        return data


def _read_exact(reader: zstandard.ZstdDecompressionReader, n: int) -> bytes:
    parts, got = [], 0
    while got < n and (piece := reader.read(n - got)):
        parts.append(piece)
        got += len(piece)
    return b"".join(parts)


def _apply_file(section: DeltaSection, chunks: list[Chunk], sha256: str, blob: BinaryIO,
                base: Path, fd: int, on_chunk: Callable[[Chunk], None], skip: Collection[int]
                ) -> bool:
    """Rebuild one file into ``fd`` (chunks in ``skip`` are hashed, never rewritten: they are
    verified already, and bad bytes must not replace them); True when all of it matched."""
    whole, ok = hashlib.sha256(), True
    # zstd asks its source for read() alone; _Frame is that much of a file.
    frame = cast(IO[bytes], _Frame(blob, section["offset"], section["size"]))
    with zstandard.ZstdDecompressor().stream_reader(frame, read_across_frames=False) as reader, \
            (base.open("rb") if section["mode"] == "xor" else open(os.devnull, "rb")) as b:
        for chunk in chunks:
            h, pos, end = hashlib.sha256(), chunk.offset, chunk.offset + chunk.size
            while pos < end:
                data = _read_exact(reader, min(BLOCK, end - pos))
                if section["mode"] == "xor":
                    data = _xor(data, b.read(len(data))) if data else data
                if not data:
                    break  # the frame is short: the chunk's hash fails below
                h.update(data)
                whole.update(data)
                if chunk.number not in skip:
                    os.pwrite(fd, data, pos)
                pos += len(data)
            if pos == end and h.hexdigest() == chunk.sha256:
                if chunk.number not in skip:
                    on_chunk(chunk)
            else:
                ok = False
        if reader.read(1):  # longer than the manifest's file: not this version
            ok = False
    return ok and whole.hexdigest() == sha256


def apply_delta(manifest: Manifest, blob: Path, base_dir: Path, fds: dict[str, int],
                on_chunk: Callable[[Chunk], None], skip: Collection[int] = ()) -> list[str]:
    """Rebuild version ``manifest`` from ``blob`` (its verified delta) and ``base_dir`` (the
    base as the puller holds it) into ``fds`` (one pre-sized file per name). ``on_chunk`` gets
    every chunk whose sha256 matched, but those in ``skip`` (verified already: left as they
    are). Returns the names of the files that did not match as a whole."""
    delta = check_delta(manifest)
    by_file: dict[str, list[Chunk]] = {}
    for c in chunks_of(manifest):
        by_file.setdefault(c.name, []).append(c)
    entries = {f["name"]: f for f in manifest["files"]}
    bad = []
    with blob.open("rb") as f:
        for section in delta["sections"]:
            name = section["name"]
            try:
                ok = _apply_file(section, by_file.get(name, []), entries[name]["sha256"], f,
                                 base_dir / name, fds[name], on_chunk, skip)
            except (zstandard.ZstdError, OSError):
                ok = False  # a frame that does not decode, a base file gone: fetched in full
            if not ok:
                bad.append(name)
    return bad
