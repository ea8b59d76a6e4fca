"""The weight wire format both ends share: manifest types, name rules, manifest checks.

Contract: a version is a flat set of files; each file is cut into contiguous chunks that carry
their own sha256, and a chunk is the unit of download, verification, resume and peer exchange.
Chunks are numbered globally in manifest order (files sorted by name, chunks ascending), so a
peer can say which chunks it holds with a list of small integers. Every name that will become
part of a path on either side passes :func:`valid_name` / :func:`valid_run_id` first: the
patterns forbid '/', '..' and leading dots, so nothing escapes a run's directory.

A manifest may carry a ``delta`` entry: the same version as a delta from an older one that a
puller holding that one reconstructs instead of downloading every file (format and checks:
:mod:`shared.weights.delta`). The delta's blob is a file of the version directory under a
reserved name (:func:`is_delta_name`) that is never uploaded and never among ``files``.

A manifest may carry an ``adapter`` entry instead: the version is a LoRA adapter over a base
version (a full one), named by number and identified by :func:`content_sha256` of its manifest,
so a puller that holds the base pulls the adapter's files alone (:mod:`shared.weights.pull`).
The trainer asks for it by uploading :data:`ADAPTER_BASE_NAME`; the service checks the
reference against the base it holds before it publishes (:func:`check_adapter`).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Literal, NamedTuple, NotRequired, TypedDict

from shared.errors import WeightsError

RUN_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")  # never starts with '.'
MAX_VERSION = 10**9
MANIFEST_NAME = "manifest.json"  # sits beside the files in a version directory: reserved
DELTA_PREFIX = "rlboost-delta-"  # reserved: the delta blob of a version, built by the service
# A LoRA run's version also carries PEFT's adapter files, each under its name plus this suffix:
# no loader that globs "*.safetensors" or looks for "adapter_config.json" sees them, so every
# engine loads the merged model beside them (trainer_svc.learn.lora, rlboost export).
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
ADAPTER_SUFFIX = ".lora"
# An adapter-only version carries PEFT's files under their own names and this small reference to
# its base ({"base": <version>, "base_sha256": <content_sha256 of its manifest>}).
ADAPTER_BASE_NAME = "rlboost-base.json"
MAX_ADAPTER_BASE_BYTES = 4096
SHA256_RE = re.compile(r"[0-9a-f]{64}")
MAX_CHUNKS = 1 << 20  # a manifest naming more chunks than this is refused (bounded memory)


class ChunkEntry(TypedDict):
    offset: int  # byte offset of the chunk in its file
    size: int  # bytes; every chunk but a file's last is exactly chunk_bytes
    sha256: str  # hex digest of the chunk's bytes


class FileEntry(TypedDict):
    name: str  # flat file name inside the version directory
    size: int  # bytes
    sha256: str  # hex digest of the whole file
    chunks: list[ChunkEntry]  # ascending, contiguous, covering the file


class DeltaSection(TypedDict):
    name: str  # the version's file this section rebuilds
    mode: Literal["xor", "raw"]  # xor: the file XOR the base's same-named file; raw: the file
    offset: int  # byte offset of the section's zstd frame in the blob
    size: int  # bytes of the frame


class DeltaEntry(TypedDict):
    base: int  # the version the XOR sections apply to (the one before)
    file: FileEntry  # the blob: a file of this version's directory, chunked like any other
    sections: list[DeltaSection]  # one per file of the version, in manifest order


class AdapterEntry(TypedDict):
    base: int  # the full version the adapter applies to (an older one of the same run)
    base_sha256: str  # content_sha256 of the base's manifest: which bytes, whoever holds them


class Manifest(TypedDict):
    run_id: str
    version: int
    chunk_bytes: int  # chunk size the service used when it committed the version
    files: list[FileEntry]  # sorted by name
    delta: NotRequired[DeltaEntry]  # when the service built a delta that pays off
    adapter: NotRequired[AdapterEntry]  # an adapter-only version: its files need this base


class Chunk(NamedTuple):
    """One chunk with everything a fetch needs; ``number`` is its global index."""

    number: int
    name: str
    offset: int
    size: int
    sha256: str


def valid_run_id(run_id: str) -> bool:
    return RUN_ID_RE.fullmatch(run_id) is not None


def valid_version(version: int) -> bool:
    return 0 <= version <= MAX_VERSION


def valid_name(name: str) -> bool:
    return NAME_RE.fullmatch(name) is not None and name != MANIFEST_NAME


def is_delta_name(name: str) -> bool:
    return name.startswith(DELTA_PREFIX)


def delta_name(base: int) -> str:
    """The blob's name in the directory of the version it rebuilds from ``base``."""
    return f"{DELTA_PREFIX}{base}"


def check_ids(run_id: str, version: int) -> None:
    if not valid_run_id(run_id):
        raise WeightsError(f"invalid run id {run_id!r}", retryable=False)
    if not valid_version(version):
        raise WeightsError(f"invalid version {version!r}: 0..{MAX_VERSION}", retryable=False)


def check_manifest(manifest: Manifest, run_id: str, version: int) -> None:
    """Refuse a manifest that could write outside the directory or leave holes in a file."""
    if manifest.get("run_id") != run_id or manifest.get("version") != version:
        raise WeightsError(f"manifest is for another version: {manifest!r:.200}", False)
    count = 0
    for f in manifest["files"]:
        check_file(f)
        count += len(f["chunks"])
    if count > MAX_CHUNKS:
        raise WeightsError(f"manifest has {count} chunks, more than {MAX_CHUNKS}", False)
    if "adapter" in manifest:
        check_adapter(manifest["adapter"], version)


def check_adapter(entry: object, version: int) -> AdapterEntry:
    """Refuse an adapter entry (or the body of :data:`ADAPTER_BASE_NAME`) that is not exactly
    ``{"base": <older version>, "base_sha256": <64 lower-case hex>}``."""
    if not isinstance(entry, dict) or set(entry) != {"base", "base_sha256"}:
        raise WeightsError(f"adapter base must be {{'base', 'base_sha256'}}: {entry!r:.200}",
                           False)
    base, digest = entry["base"], entry["base_sha256"]
    if not (isinstance(base, int) and not isinstance(base, bool) and 0 <= base < version):
        raise WeightsError(f"adapter base {base!r:.40} is not an older version", False)
    if not (isinstance(digest, str) and SHA256_RE.fullmatch(digest)):
        raise WeightsError(f"adapter base_sha256 {digest!r:.80} is not a sha256 hex digest",
                           False)
    return {"base": base, "base_sha256": digest}


def content_sha256(manifest: Manifest) -> str:
    """The identity of a version's bytes: sha256 over its files' names, sizes and sha256s.

    Not the manifest file's own hash: run id, version number, chunk size and a delta entry
    say where and how a version is served, not what it is, and a base pre-seeded in an image
    or published by another run must be recognised by its bytes alone. A LoRA version's
    hidden adapter files (:data:`ADAPTER_SUFFIX`) are left out: they are the run's initial
    adapter (random, per seed), not part of the base any adapter applies to."""
    return files_sha256([(f["name"], f["size"], f["sha256"]) for f in manifest["files"]])


def file_sha256(path: Path) -> str:
    """The sha256 hex digest of a file's bytes, as a manifest's ``sha256`` states it."""
    with path.open("rb") as src:
        return hashlib.file_digest(src, "sha256").hexdigest()


def files_sha256(files: list[tuple[str, int, str]]) -> str:
    """:func:`content_sha256` of files given as (name, size, sha256), in name order."""
    kept = [[n, size, digest] for n, size, digest in files if not n.endswith(ADAPTER_SUFFIX)]
    return hashlib.sha256(json.dumps(kept, separators=(",", ":")).encode()).hexdigest()


def check_file(f: FileEntry) -> None:
    """Refuse a file entry with an invalid name, or chunks that leave holes or overlap."""
    if not valid_name(f["name"]):
        raise WeightsError(f"manifest names an invalid file {f['name']!r}", False)
    offset = 0
    for c in f["chunks"]:
        if c["offset"] != offset or c["size"] <= 0:
            raise WeightsError(f"manifest chunks of {f['name']} are not contiguous", False)
        offset += c["size"]
    if offset != f["size"]:
        raise WeightsError(f"manifest chunks of {f['name']} do not cover the file", False)


def chunks_of(manifest: Manifest) -> list[Chunk]:
    """Every chunk of the version in global order (the numbering peers advertise)."""
    out: list[Chunk] = []
    for f in manifest["files"]:
        for c in f["chunks"]:
            out.append(Chunk(len(out), f["name"], c["offset"], c["size"], c["sha256"]))
    return out
