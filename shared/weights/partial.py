"""A version being pulled: the ``.partial-<version>`` directory and its verified-chunk record.

Contract: the directory holds the manifest, the files pre-sized (sparse) and ``.chunks-done``, one
``<name> <offset>`` line per chunk whose sha256 matched when it was written. A line is appended
only after the chunk's bytes are in the file, so a SIGKILL at any moment leaves a record that
claims nothing unverified; on resume the listed chunks are re-hashed anyway (the disk is trusted
only through hashes) and the rest fetched again. :meth:`Partial.publish` fsyncs and renames the
directory to ``<version>``: readers see a whole version or none.

Why no whole-file hash at publish: every byte of every file lies in exactly one chunk (the
manifest check enforces contiguous chunks that cover each file) and every chunk was verified as
it was written, so a second pass over the whole checkpoint would check nothing new and would
cost as much CPU as the transfer itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
from pathlib import Path

from shared.errors import WeightsError
from shared.weights.fetch import start_writeback
from shared.weights.manifest import MANIFEST_NAME, Chunk, Manifest, check_manifest, chunks_of

log = logging.getLogger(__name__)

SIDECAR = ".chunks-done"  # dot name: never a model file
_IO_BLOCK = 1 << 20


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def local_manifest(final: Path, run_id: str, version: int) -> Manifest | None:
    """The manifest of a complete pulled version at ``final``, or None."""
    try:
        manifest: Manifest = json.loads((final / MANIFEST_NAME).read_text())
        check_manifest(manifest, run_id, version)
        if all((final / f["name"]).stat().st_size == f["size"] for f in manifest["files"]):
            return manifest
    except (OSError, ValueError, KeyError, TypeError, WeightsError):
        pass
    return None


def _chunk_ok(fd: int, chunk: Chunk) -> bool:
    h = hashlib.sha256()
    offset, end = chunk.offset, chunk.offset + chunk.size
    while offset < end and (block := os.pread(fd, min(_IO_BLOCK, end - offset), offset)):
        h.update(block)
        offset += len(block)
    return offset == end and h.hexdigest() == chunk.sha256


class Partial:
    """Pre-sized files plus the record; :meth:`record` may be called from any thread."""

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest
        self.chunks = chunks_of(manifest)
        self.fds: dict[str, int] = {}
        self.done: set[int] = set()  # global chunk indices verified on disk
        self._lock = threading.Lock()
        saved = path / MANIFEST_NAME
        try:
            resumable = json.loads(saved.read_text()) == manifest
        except (OSError, ValueError):
            resumable = False
        if not resumable:
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            saved.write_text(json.dumps(manifest))
        for f in manifest["files"]:
            fd = os.open(path / f["name"], os.O_RDWR | os.O_CREAT, 0o644)
            self.fds[f["name"]] = fd
            os.ftruncate(fd, f["size"])  # sparse, so pre-sizing costs nothing
        if resumable:
            self._reverify()
        self.sidecar = (path / SIDECAR).open("a")

    def _reverify(self) -> None:
        by_key = {(c.name, c.offset): c for c in self.chunks}
        try:
            lines = (self.path / SIDECAR).read_text().splitlines()
        except OSError:
            lines = []
        for line in lines:
            name, _, offset = line.partition(" ")
            chunk = by_key.get((name, int(offset))) if offset.isdigit() else None
            if chunk is not None and _chunk_ok(self.fds[name], chunk):
                self.done.add(chunk.number)
        log.info("resuming pull in %s: %d chunks already verified", self.path, len(self.done))

    def record(self, chunk: Chunk) -> None:
        start_writeback(self.fds[chunk.name], chunk.offset, chunk.size)
        with self._lock:
            self.sidecar.write(f"{chunk.name} {chunk.offset}\n")
            self.sidecar.flush()  # in the OS once flushed: a SIGKILL of this process cannot lose it
            self.done.add(chunk.number)

    def close(self) -> None:
        if not self.sidecar.closed:
            self.sidecar.close()
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def publish(self, final: Path) -> None:
        missing = len(self.chunks) - len(self.done)
        if missing:
            raise WeightsError(f"{self.path}: {missing} chunks not verified", retryable=False)
        for fd in self.fds.values():
            os.fsync(fd)  # durable before visible: a machine crash must not expose holes
        self.close()
        (self.path / SIDECAR).unlink()
        fsync_dir(self.path)
        if final.exists():  # someone else published it meanwhile; versions are immutable
            shutil.rmtree(self.path)
            return
        os.rename(self.path, final)
        fsync_dir(final.parent)
