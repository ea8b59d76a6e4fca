"""The on-disk checkpoint store: the only code that touches the weight files.

Layout under ``<RLBOOST_DATA_DIR>/weights``::

    <run_id>/<version>/manifest.json + files    a published version, complete by construction
    <run_id>/<version>/rlboost-delta-<base>      its delta from <base> = <version> - 1, when
                                                one was built and paid off (shared.weights.delta)
    <run_id>/.staging-<version>/<name>          uploaded files waiting for the commit (removed
                                                once they cannot be: refused, or not newer
                                                than the newest published version)
    <run_id>/.staging-<version>/.up-<name>-<x>  a file still being received (never committed)
    <run_id>/.pins/<version>                    a pin: the version is never collected
    <run_id>/.trash-<version>-<x>               a version being collected (invisible already)

Contract: every run id, version and file name is validated before it becomes part of a path
(the patterns forbid '/', '..' and leading dots, so nothing escapes the run directory). A version
becomes visible by one directory rename after its files and manifest are fsynced: readers see a
whole version or none. It disappears by one rename too. Methods block (file I/O, hashing); the app
runs them in worker threads and serializes commits and collection per run.

A commit builds the version's delta from the version before when that one is published, inside
the version before its rename: the version appears with its delta or without one, never
before it. The delta is kept only when it is at most ``DELTA_MAX_FRACTION`` of the version's
bytes; a failed build costs the delta, never the commit. ``on_delta`` hears each outcome
(``kept``, ``too_large``, ``failed``) for the service's counter. With ``StoreLimits.deltas`` off
no delta is built: every pull is a full one.

A commit whose staged files include ``rlboost-base.json`` publishes an adapter-only version
(:data:`~shared.weights.manifest.ADAPTER_BASE_NAME`): the reference must be well formed and
bounded, name a published older version of the run whose content hash it states, and the
version must hold PEFT's two adapter files; otherwise the commit is refused with 422 and the
reason, and what was staged for the version is dropped. Such a version gets no delta (its
files are small and every one changes each step). Collection never removes a version that a
kept adapter version names as its base.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shared.config import WeightsConfig
from shared.errors import WeightsError
from shared.weights.delta import DELTA_MAX_FRACTION, build_delta
from shared.weights.manifest import (
    ADAPTER_BASE_NAME,
    ADAPTER_FILES,
    MANIFEST_NAME,
    MAX_ADAPTER_BASE_BYTES,
    MAX_VERSION,
    AdapterEntry,
    ChunkEntry,
    DeltaEntry,
    FileEntry,
    Manifest,
    check_adapter,
    content_sha256,
    delta_name,
    is_delta_name,
    valid_name,
    valid_run_id,
)

log = logging.getLogger("weight_svc.app")

# The newest two versions are never collected, whatever K: the step being rolled out uses the
# newest or (while the trainer publishes the next) the one before, and an instance that joins
# mid-step must still find it. Anything held longer is pinned by its user.
MIN_KEEP = 2


class StoreError(WeightsError):
    """A request the store refuses; ``status`` is the HTTP status the app answers with."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail, retryable=False)
        self.status = status
        self.detail = detail


@dataclass(frozen=True, slots=True)
class StoreLimits:
    """The store's sizes; the service takes them from WeightsConfig, tests choose their own."""

    chunk_bytes: int  # the unit of download, verification and resume
    max_file_bytes: int  # a larger upload is refused with 413
    deltas: bool = True  # build a version's delta at commit (RLBOOST_WEIGHTS_DELTAS)

    @classmethod
    def of(cls, cfg: WeightsConfig) -> StoreLimits:
        return cls(chunk_bytes=cfg.chunk_bytes, max_file_bytes=cfg.max_file_bytes,
                   deltas=cfg.deltas)


def check_ids(run_id: str, version: int | None = None, name: str | None = None) -> None:
    if not valid_run_id(run_id):
        raise StoreError(422, f"invalid run id {run_id[:80]!r}: [A-Za-z0-9_-]{{1,64}}")
    if version is not None and not 0 <= version <= MAX_VERSION:
        raise StoreError(422, f"invalid version {version}: 0..{MAX_VERSION}")
    if name is not None and not valid_name(name):
        raise StoreError(
            422, f"invalid file name {name[:80]!r}: [A-Za-z0-9._-]{{1,128}}, no leading '.'"
        )


def _model_file(name: str) -> bool:
    """A staged name that is part of the version (not a cut-off upload, not a delta)."""
    return valid_name(name) and not is_delta_name(name)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Upload:
    """One file being received: bytes go to a private temp name, renamed into place at the end,
    so a cut-off upload can never be committed."""

    def __init__(self, staging: Path, name: str, max_bytes: int) -> None:
        staging.mkdir(parents=True, exist_ok=True)
        self.target = staging / name
        self.tmp = staging / f".up-{name}-{uuid.uuid4().hex[:8]}"
        self.max_bytes = max_bytes
        self.size = 0
        self._f = self.tmp.open("wb")

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.max_bytes:
            raise StoreError(413, f"{self.target.name}: larger than {self.max_bytes} bytes")
        self._f.write(data)

    def finish(self) -> None:
        self._f.close()
        try:
            os.replace(self.tmp, self.target)
        except FileNotFoundError:  # the staging directory was committed under our feet
            raise StoreError(409, f"{self.target.name}: version committed during upload") from None

    def abort(self) -> None:
        self._f.close()
        self.tmp.unlink(missing_ok=True)


class Store:
    def __init__(self, data_dir: Path, limits: StoreLimits,
                 on_delta: Callable[[str], None] = lambda outcome: None) -> None:
        self.root = data_dir / "weights"
        self.limits = limits
        self.on_delta = on_delta
        self.delta_threads = min(os.cpu_count() or 1, 8)  # zstd workers for a delta build
        self.root.mkdir(parents=True, exist_ok=True)

    # --- paths (only ever built from validated parts) ----------------------------------------

    def _run(self, run_id: str) -> Path:
        return self.root / run_id

    def _version(self, run_id: str, version: int) -> Path:
        return self._run(run_id) / str(version)

    def _staging(self, run_id: str, version: int) -> Path:
        return self._run(run_id) / f".staging-{version}"

    def _pin(self, run_id: str, version: int) -> Path:
        return self._run(run_id) / ".pins" / str(version)

    # --- reads --------------------------------------------------------------------------------

    def runs(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if valid_run_id(p.name) and p.is_dir())

    def versions(self, run_id: str) -> list[int]:
        check_ids(run_id)
        run = self._run(run_id)
        if not run.is_dir():
            return []
        found = []
        for p in run.iterdir():
            if p.name.isdigit() and (p / MANIFEST_NAME).is_file():
                found.append(int(p.name))
        return sorted(found)

    def manifest(self, run_id: str, version: int) -> Manifest:
        check_ids(run_id, version)
        try:
            text = (self._version(run_id, version) / MANIFEST_NAME).read_text()
        except FileNotFoundError:
            raise StoreError(404, f"version {run_id}/{version} is not published") from None
        manifest: Manifest = json.loads(text)
        return manifest

    def latest(self, run_id: str) -> Manifest:
        versions = self.versions(run_id)
        if not versions:
            raise StoreError(404, f"run {run_id} has no published version")
        return self.manifest(run_id, versions[-1])

    def file_path(self, run_id: str, version: int, name: str) -> Path:
        check_ids(run_id, version, name)
        path = self._version(run_id, version) / name
        if not (self._version(run_id, version) / MANIFEST_NAME).is_file():
            raise StoreError(404, f"version {run_id}/{version} is not published")
        if not path.is_file():
            raise StoreError(404, f"version {run_id}/{version} has no file {name!r}")
        return path

    def pins(self, run_id: str) -> list[int]:
        pins = self._run(run_id) / ".pins"
        if not pins.is_dir():
            return []
        return sorted(int(p.name) for p in pins.iterdir() if p.name.isdigit())

    # --- writes -------------------------------------------------------------------------------

    def open_upload(self, run_id: str, version: int, name: str) -> Upload:
        check_ids(run_id, version, name)
        if is_delta_name(name):
            raise StoreError(422, f"file name {name!r}: the prefix is reserved for deltas")
        return Upload(self._staging(run_id, version), name, self.limits.max_file_bytes)

    def _describe(self, path: Path) -> FileEntry:
        """Hash a file chunk by chunk and fsync it: the manifest then vouches for bytes on disk."""
        whole = hashlib.sha256()
        chunks: list[ChunkEntry] = []
        offset = 0
        with path.open("rb") as f:
            while block := f.read(self.limits.chunk_bytes):
                whole.update(block)
                digest = hashlib.sha256(block).hexdigest()
                chunks.append({"offset": offset, "size": len(block), "sha256": digest})
                offset += len(block)
            os.fsync(f.fileno())
        return {"name": path.name, "size": offset, "sha256": whole.hexdigest(), "chunks": chunks}

    def commit(self, run_id: str, version: int) -> tuple[Manifest, bool]:
        """Publish the staged files; returns (manifest, whether this call published it)."""
        check_ids(run_id, version)
        staging, final = self._staging(run_id, version), self._version(run_id, version)
        staged = []
        if staging.is_dir():
            staged = sorted(p for p in staging.iterdir()
                            if _model_file(p.name) and p.is_file())
        published = (final / MANIFEST_NAME).is_file()
        if not staged:
            if published:  # a retried commit whose first answer was lost
                return self.manifest(run_id, version), False
            raise StoreError(409, f"nothing staged for {run_id}/{version}: upload files first")
        manifest: Manifest = {
            "run_id": run_id,
            "version": version,
            "chunk_bytes": self.limits.chunk_bytes,
            "files": [self._describe(p) for p in staged],
        }
        if published:
            existing = self.manifest(run_id, version)
            same = [(f["name"], f["sha256"]) for f in existing["files"]] == [
                (f["name"], f["sha256"]) for f in manifest["files"]
            ]
            if not same:
                # Refused for good: its files can never be published, so they go now.
                shutil.rmtree(staging, ignore_errors=True)
                raise StoreError(409, f"{run_id}/{version} is published with different content")
            shutil.rmtree(staging, ignore_errors=True)
            return existing, False
        names = {f["name"] for f in manifest["files"]}
        if ADAPTER_BASE_NAME in names:
            try:
                manifest["adapter"] = self._adapter_base(run_id, version, staging, names)
            except StoreError:  # refused as staged: the uploader starts this version afresh
                shutil.rmtree(staging, ignore_errors=True)
                raise
        for p in staging.iterdir():
            if not _model_file(p.name):  # cut-off uploads, a killed commit's delta
                p.unlink(missing_ok=True)
        if "adapter" in manifest or not self.limits.deltas:
            pass  # small files that all change every step: a delta cannot pay off; or off
        elif (delta := self._delta(run_id, version, staging, manifest)) is not None:
            manifest["delta"] = delta
        tmp = staging / f".{MANIFEST_NAME}"
        with tmp.open("w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, staging / MANIFEST_NAME)
        _fsync_dir(staging)
        os.rename(staging, final)  # the atomic publish
        _fsync_dir(final.parent)
        return manifest, True

    def _adapter_base(self, run_id: str, version: int, staging: Path, names: set[str]
                      ) -> AdapterEntry:
        """The staged adapter version's checked reference to its base (module doc)."""
        ref = staging / ADAPTER_BASE_NAME
        if ref.stat().st_size > MAX_ADAPTER_BASE_BYTES:
            raise StoreError(422, f"{ADAPTER_BASE_NAME}: larger than {MAX_ADAPTER_BASE_BYTES} B")
        try:
            entry = check_adapter(json.loads(ref.read_bytes()), version)
        except (ValueError, WeightsError) as exc:
            raise StoreError(422, f"{ADAPTER_BASE_NAME}: {exc}") from None
        missing = [n for n in ADAPTER_FILES if n not in names]
        if missing:
            raise StoreError(422, f"adapter version {run_id}/{version} lacks {missing}")
        try:
            base = self.manifest(run_id, entry["base"])
        except StoreError:
            raise StoreError(422, f"{ADAPTER_BASE_NAME}: base {run_id}/{entry['base']} is not "
                                  "published") from None
        if "adapter" in base:
            raise StoreError(422, f"{ADAPTER_BASE_NAME}: base {run_id}/{entry['base']} is an "
                                  "adapter itself, not a full version")
        if content_sha256(base) != entry["base_sha256"]:
            raise StoreError(422, f"{ADAPTER_BASE_NAME}: base_sha256 is not the content hash "
                                  f"of {run_id}/{entry['base']}")
        return entry

    def _delta(self, run_id: str, version: int, staging: Path, manifest: Manifest
               ) -> DeltaEntry | None:
        """Build the staged version's delta from the version before, if that one is published
        and the delta pays off (module doc)."""
        base = version - 1
        if base < 0 or not (self._version(run_id, base) / MANIFEST_NAME).is_file():
            return None
        out = staging / delta_name(base)
        names = [f["name"] for f in manifest["files"]]
        try:
            sections = build_delta(self._version(run_id, base), staging, names, out,
                                   self.delta_threads)
            blob = self._describe(out)
        except Exception as exc:  # the version is whole without it: publish it all the same
            log.warning("no delta for %s/%d: %s", run_id, version, exc)
            out.unlink(missing_ok=True)
            self.on_delta("failed")
            return None
        full = sum(f["size"] for f in manifest["files"])
        if blob["size"] > DELTA_MAX_FRACTION * full:
            out.unlink()
            self.on_delta("too_large")
            return None
        self.on_delta("kept")
        return {"base": base, "file": blob, "sections": sections}

    def pin(self, run_id: str, version: int) -> None:
        self.manifest(run_id, version)  # only a published version can be pinned
        path = self._pin(run_id, version)
        path.parent.mkdir(exist_ok=True)
        path.touch()
        _fsync_dir(path.parent)

    def unpin(self, run_id: str, version: int) -> None:
        check_ids(run_id, version)
        self._pin(run_id, version).unlink(missing_ok=True)

    def collect(self, run_id: str, keep_last: int, protect: int | None = None) -> list[int]:
        """Remove all but the newest max(``keep_last``, MIN_KEEP) versions, sparing pinned ones
        and ``protect`` (a just-committed older version must not vanish before its committer
        sees it)."""
        versions = self.versions(run_id)
        keep = set(versions[-max(keep_last, MIN_KEEP) :]) | set(self.pins(run_id))
        if protect is not None:
            keep.add(protect)
        keep |= self._bases(run_id, keep)
        gone = [v for v in versions if v not in keep]
        for v in gone:
            trash = self._run(run_id) / f".trash-{v}-{uuid.uuid4().hex[:8]}"
            os.rename(self._version(run_id, v), trash)  # invisible at once, then deleted
            shutil.rmtree(trash, ignore_errors=True)
        self.collect_staging(run_id)
        return gone

    def _bases(self, run_id: str, versions: set[int]) -> set[int]:
        """The bases that adapter versions among ``versions`` need: never collected first."""
        bases = set()
        for v in versions:
            try:
                entry = self.manifest(run_id, v).get("adapter")
            except (StoreError, ValueError):
                continue
            if entry is not None:
                bases.add(entry["base"])
        return bases

    def collect_staging(self, run_id: str) -> list[int]:
        """Remove staged files that can never be published: those of a version not newer
        than the newest published one (the trainer publishes versions in order, so an older
        one was abandoned, by a trainer that failed or restarted mid-upload, and one already
        published is a retried commit's leftover). Returns their versions."""
        versions = self.versions(run_id)
        if not versions:
            return []
        gone = []
        for p in self._run(run_id).iterdir():
            number = p.name.removeprefix(".staging-")
            if p.name.startswith(".staging-") and number.isdigit() and \
                    int(number) <= versions[-1] and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
                gone.append(int(number))
        return sorted(gone)

    def sweep(self) -> None:
        """At start-up: finish interrupted collections and drop cut-off uploads (none can be
        in flight before the server accepts requests)."""
        for run in self.runs():
            for p in self._run(run).iterdir():
                if p.name.startswith(".trash-"):
                    shutil.rmtree(p, ignore_errors=True)
                elif p.name.startswith(".staging-") and p.is_dir():
                    for f in p.iterdir():
                        if f.name.startswith(".up-"):
                            f.unlink(missing_ok=True)
            self.collect_staging(run)
