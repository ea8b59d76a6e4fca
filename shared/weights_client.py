"""Client of the weight service, and the wire format both ends share.

Contract:
- :func:`upload_version` streams every file of a flat HF model directory to the service (never
  whole in memory), then commits; it returns the manifest. Idempotent: uploading a version that is
  already published with the same content returns its manifest; different content is an error.
- :func:`pull_version` makes ``dest_root/<run_id>/<version>/`` hold exactly the version's files,
  each chunk and each file verified by sha256. The final directory appears by one rename, so a
  crash leaves at most ``.partial-<version>/``, which the next pull resumes (chunks it lists as
  done are re-hashed, not re-downloaded). Versions are immutable, so an existing final directory
  whose manifest matches is returned without asking the service. One pull of a given version
  into a given ``dest_root`` at a time.
- :func:`wait_for_version` polls until a version is published.

Every failure is a :class:`WeightsError`; ``retryable`` is False where retrying cannot help (a bad
name, conflicting content, a chunk corrupt at the source, a rejected token).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import TracebackType
from typing import TypedDict

import httpx

from shared.errors import WeightsError

log = logging.getLogger(__name__)

RUN_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")  # never starts with '.'
MAX_VERSION = 10**9
MANIFEST_NAME = "manifest.json"  # sits beside the files in a version directory: reserved
CHUNK_TRIES = 4  # one download and three refetches before a chunk is declared corrupt
_IO_BLOCK = 1 << 20


class ChunkEntry(TypedDict):
    offset: int  # byte offset of the chunk in its file
    size: int  # bytes; every chunk but a file's last is exactly chunk_bytes
    sha256: str  # hex digest of the chunk's bytes


class FileEntry(TypedDict):
    name: str  # flat file name inside the version directory
    size: int  # bytes
    sha256: str  # hex digest of the whole file
    chunks: list[ChunkEntry]  # ascending, contiguous, covering the file


class Manifest(TypedDict):
    run_id: str
    version: int
    chunk_bytes: int  # chunk size the service used when it committed the version
    files: list[FileEntry]  # sorted by name


def valid_run_id(run_id: str) -> bool:
    return RUN_ID_RE.fullmatch(run_id) is not None


def valid_version(version: int) -> bool:
    return 0 <= version <= MAX_VERSION


def valid_name(name: str) -> bool:
    return NAME_RE.fullmatch(name) is not None and name != MANIFEST_NAME


def _check_ids(run_id: str, version: int) -> None:
    if not valid_run_id(run_id):
        raise WeightsError(f"invalid run id {run_id!r}", retryable=False)
    if not valid_version(version):
        raise WeightsError(f"invalid version {version!r}: 0..{MAX_VERSION}", retryable=False)


def _detail(resp: httpx.Response) -> str:
    try:
        return str(resp.json().get("detail", resp.text))
    except (ValueError, AttributeError):
        return resp.text[:200]


class _Session:
    """One HTTP connection pool plus the retry policy: transport errors and 5xx are retried with
    backoff, either a fixed number of times or until ``patience_s`` pass without progress."""

    def __init__(
        self,
        base_url: str,
        token: str | None,
        timeout_s: float,
        *,
        max_attempts: int | None = None,
        patience_s: float | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout_s)
        self._base_url = base_url
        self._max_attempts = max_attempts
        self._patience_s = patience_s
        self._progress_at = time.monotonic()

    async def __aenter__(self) -> _Session:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._client.aclose()

    def progress(self) -> None:
        self._progress_at = time.monotonic()

    def _exhausted(self, attempt: int) -> bool:
        if self._max_attempts is not None and attempt >= self._max_attempts:
            return True
        idle = time.monotonic() - self._progress_at
        return self._patience_s is not None and idle > self._patience_s

    async def send(
        self,
        method: str,
        path: str,
        *,
        expect: tuple[int, ...] = (200,),
        headers: dict[str, str] | None = None,
        body: Callable[[], AsyncIterator[bytes]] | None = None,
    ) -> httpx.Response:
        attempt = 0
        while True:
            attempt += 1
            try:
                content = body() if body is not None else None
                req = self._client.build_request(method, path, headers=headers, content=content)
                resp = await self._client.send(req)
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            else:
                if resp.status_code in expect:
                    return resp
                if resp.status_code < 500:
                    raise self._rejected(method, path, resp)
                problem = f"HTTP {resp.status_code}: {_detail(resp)}"
            if self._exhausted(attempt):
                raise WeightsError(
                    f"{method} {self._base_url}{path}: gave up after {attempt} attempts: {problem}"
                )
            delay = min(0.1 * 2 ** (attempt - 1), 2.0)
            log.info("weights %s %s failed (%s); retrying in %.1fs", method, path, problem, delay)
            await asyncio.sleep(delay)

    def _rejected(self, method: str, path: str, resp: httpx.Response) -> WeightsError:
        where = f"{method} {self._base_url}{path}"
        if resp.status_code == 401:
            hint = "check RLBOOST_WEIGHTS_TOKEN / RLBOOST_API_TOKEN"
            return WeightsError(f"{where}: unauthorized ({hint})", retryable=False)
        return WeightsError(f"{where}: HTTP {resp.status_code}: {_detail(resp)}", retryable=False)

    async def manifest(self, run_id: str, version: int) -> Manifest | None:
        resp = await self.send("GET", f"/v1/weights/{run_id}/{version}/manifest", expect=(200, 404))
        if resp.status_code == 404:
            return None
        manifest: Manifest = resp.json()
        return manifest


# --- upload -----------------------------------------------------------------------------------


def _model_files(model_dir: Path) -> list[Path]:
    if not model_dir.is_dir():
        raise WeightsError(f"{model_dir} is not a directory", retryable=False)
    files = []
    for path in sorted(model_dir.iterdir()):
        if path.name.startswith("."):
            continue  # editor and VCS leftovers are not part of a checkpoint
        if not path.is_file() or not valid_name(path.name):
            raise WeightsError(f"{path}: only flat files with plain names can be uploaded", False)
        files.append(path)
    if not files:
        raise WeightsError(f"{model_dir} holds no files to upload", retryable=False)
    return files


async def _file_body(path: Path) -> AsyncIterator[bytes]:
    with path.open("rb") as f:
        while block := await asyncio.to_thread(f.read, _IO_BLOCK):
            yield block


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_IO_BLOCK):
            h.update(block)
    return h.hexdigest()


async def _same_content(manifest: Manifest, files: list[Path]) -> bool:
    remote = {f["name"]: (f["size"], f["sha256"]) for f in manifest["files"]}
    if set(remote) != {p.name for p in files}:
        return False
    if any(remote[p.name][0] != p.stat().st_size for p in files):
        return False
    for p in files:
        if await asyncio.to_thread(_sha256_file, p) != remote[p.name][1]:
            return False
    return True


async def upload_version(
    base_url: str,
    token: str | None,
    run_id: str,
    version: int,
    model_dir: Path,
    timeout_s: float = 60,
) -> Manifest:
    """Upload and publish ``model_dir`` as (run_id, version); returns the manifest.

    ``timeout_s`` bounds each network operation (connect, each read or write), not the whole
    upload: a multi-GB checkpoint may rightly take longer.
    """
    _check_ids(run_id, version)
    files = _model_files(model_dir)
    async with _Session(base_url, token, timeout_s, max_attempts=5) as session:
        existing = await session.manifest(run_id, version)
        if existing is not None:
            if await _same_content(existing, files):
                return existing
            raise WeightsError(
                f"{run_id}/{version} is already published with different content", False
            )
        for path in files:
            size = path.stat().st_size
            await session.send(
                "PUT",
                f"/v1/weights/{run_id}/{version}/files/{path.name}",
                headers={"Content-Length": str(size)},
                body=functools.partial(_file_body, path),
            )
        resp = await session.send("POST", f"/v1/weights/{run_id}/{version}/commit")
        manifest: Manifest = resp.json()
        return manifest


# --- pull -------------------------------------------------------------------------------------

_SIDECAR = ".chunks-done"  # "<name> <offset>" per verified chunk; dot name: never a model file


def _check_manifest(manifest: Manifest, run_id: str, version: int) -> None:
    """Refuse a manifest that could write outside the directory or leave holes in a file."""
    if manifest.get("run_id") != run_id or manifest.get("version") != version:
        raise WeightsError(f"manifest is for another version: {manifest!r:.200}", False)
    for f in manifest["files"]:
        if not valid_name(f["name"]):
            raise WeightsError(f"manifest names an invalid file {f['name']!r}", False)
        offset = 0
        for c in f["chunks"]:
            if c["offset"] != offset or c["size"] <= 0:
                raise WeightsError(f"manifest chunks of {f['name']} are not contiguous", False)
            offset += c["size"]
        if offset != f["size"]:
            raise WeightsError(f"manifest chunks of {f['name']} do not cover the file", False)


def _local_manifest(final: Path, run_id: str, version: int) -> Manifest | None:
    try:
        manifest: Manifest = json.loads((final / MANIFEST_NAME).read_text())
        _check_manifest(manifest, run_id, version)
        if all((final / f["name"]).stat().st_size == f["size"] for f in manifest["files"]):
            return manifest
    except (OSError, ValueError, KeyError, TypeError, WeightsError):
        pass
    return None


def _chunk_ok(fd: int, chunk: ChunkEntry) -> bool:
    data = os.pread(fd, chunk["size"], chunk["offset"])
    return hashlib.sha256(data).hexdigest() == chunk["sha256"]


class _Partial:
    """The ``.partial-<version>`` directory: pre-sized files, the manifest, the sidecar."""

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest
        self.fds: dict[str, int] = {}
        self.done: set[tuple[str, int]] = set()
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
        self.sidecar = (path / _SIDECAR).open("a")

    def _reverify(self) -> None:
        # The sidecar may claim chunks whose bytes never reached the disk: trust only hashes.
        chunks = {(f["name"], c["offset"]): c for f in self.manifest["files"] for c in f["chunks"]}
        try:
            lines = (self.path / _SIDECAR).read_text().splitlines()
        except OSError:
            lines = []
        for line in lines:
            name, _, offset = line.partition(" ")
            key = (name, int(offset)) if offset.isdigit() else None
            if key is not None and key in chunks and _chunk_ok(self.fds[name], chunks[key]):
                self.done.add(key)
        log.info("resuming pull in %s: %d chunks already verified", self.path, len(self.done))

    def record(self, name: str, offset: int) -> None:
        self.sidecar.write(f"{name} {offset}\n")
        self.sidecar.flush()  # in the OS once flushed: a SIGKILL of this process cannot lose it

    def close(self) -> None:
        self.sidecar.close()
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def publish(self, final: Path) -> None:
        for f in self.manifest["files"]:
            fd = self.fds[f["name"]]
            h = hashlib.sha256()
            offset = 0
            while block := os.pread(fd, _IO_BLOCK, offset):
                h.update(block)
                offset += len(block)
            if h.hexdigest() != f["sha256"]:
                raise WeightsError(f"{f['name']}: whole-file sha256 mismatch", retryable=False)
            os.fsync(fd)
        self.close()
        (self.path / _SIDECAR).unlink()
        _fsync_dir(self.path)
        if final.exists():  # someone else published it meanwhile; versions are immutable
            shutil.rmtree(self.path)
            return
        os.rename(self.path, final)
        _fsync_dir(final.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_verified(fd: int, data: bytes, chunk: ChunkEntry) -> bool:
    if len(data) != chunk["size"] or hashlib.sha256(data).hexdigest() != chunk["sha256"]:
        return False
    os.pwrite(fd, data, chunk["offset"])
    return True


async def _fetch_chunk(
    session: _Session, partial: _Partial, url: str, name: str, chunk: ChunkEntry
) -> None:
    first, last = chunk["offset"], chunk["offset"] + chunk["size"] - 1
    for attempt in range(1, CHUNK_TRIES + 1):
        resp = await session.send(
            "GET", url, expect=(206,), headers={"Range": f"bytes={first}-{last}"}
        )
        if await asyncio.to_thread(_write_verified, partial.fds[name], resp.content, chunk):
            session.progress()
            partial.record(name, first)
            return
        log.warning(
            "%s chunk at %d failed its sha256 (try %d/%d)", url, first, attempt, CHUNK_TRIES
        )
    raise WeightsError(
        f"{url} chunk at offset {first}: sha256 mismatch on {CHUNK_TRIES} downloads;"
        " the service's copy is corrupt",
        retryable=False,
    )


async def _download_all(
    session: _Session, partial: _Partial, run_id: str, version: int, parallel: int
) -> None:
    """Fetch every chunk not yet verified, ``parallel`` in flight; the first failure cancels the
    rest (their verified chunks stay recorded for the next pull)."""
    todo: asyncio.Queue[tuple[str, ChunkEntry]] = asyncio.Queue()
    for f in partial.manifest["files"]:
        for c in f["chunks"]:
            if (f["name"], c["offset"]) not in partial.done:
                todo.put_nowait((f["name"], c))

    async def worker() -> None:
        while not todo.empty():
            name, chunk = todo.get_nowait()
            url = f"/v1/weights/{run_id}/{version}/files/{name}"
            await _fetch_chunk(session, partial, url, name, chunk)

    try:
        async with asyncio.TaskGroup() as tg:
            for _ in range(min(parallel, todo.qsize())):
                tg.create_task(worker())
    except BaseExceptionGroup as group:
        # Callers get one named error, not a group: the first WeightsError, else the first cause.
        first = next((e for e in group.exceptions if isinstance(e, WeightsError)), None)
        if first is not None:
            raise first from None
        raise group.exceptions[0] from None


async def pull_version(
    base_url: str,
    token: str | None,
    run_id: str,
    version: int,
    dest_root: Path,
    parallel: int = 4,
    timeout_s: float = 60,
) -> Path:
    """Download and verify (run_id, version) into ``dest_root/<run_id>/<version>/``; returns it.

    ``timeout_s`` is the patience for an unreachable service: failed requests are retried with
    backoff until ``timeout_s`` pass without a verified chunk, so a service restart mid-pull is
    ridden out and a large pull is not cut short merely for being large.
    """
    _check_ids(run_id, version)
    if parallel < 1:
        raise WeightsError(f"parallel must be >= 1, got {parallel}", retryable=False)
    final = dest_root / run_id / str(version)
    if _local_manifest(final, run_id, version) is not None:
        return final
    if final.exists():  # damaged by hand or by something outside this module: pull it afresh
        await asyncio.to_thread(shutil.rmtree, final, True)
    async with _Session(base_url, token, timeout_s, patience_s=timeout_s) as session:
        manifest = await session.manifest(run_id, version)
        if manifest is None:
            raise WeightsError(f"{run_id}/{version} is not published on {base_url} (yet or now)")
        _check_manifest(manifest, run_id, version)
        partial_dir = dest_root / run_id / f".partial-{version}"
        try:
            partial = await asyncio.to_thread(_Partial, partial_dir, manifest)
        except OSError as exc:
            raise WeightsError(f"cannot prepare {partial_dir}: {exc}", retryable=False) from exc
        try:
            await _download_all(session, partial, run_id, version, parallel)
            await asyncio.to_thread(partial.publish, final)
        except OSError as exc:
            raise WeightsError(f"writing {partial_dir}: {exc}", retryable=False) from exc
        finally:
            partial.close()
    return final


async def wait_for_version(
    base_url: str, token: str | None, run_id: str, version: int, timeout_s: float
) -> Manifest:
    """Poll until (run_id, version) is published; its manifest, or WeightsError after timeout_s."""
    _check_ids(run_id, version)
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    async with _Session(base_url, token, max(timeout_s, 1.0), patience_s=timeout_s) as session:
        while True:
            try:
                manifest = await session.manifest(run_id, version)
            except WeightsError as exc:
                if not exc.retryable:
                    raise
                manifest = None
            if manifest is not None:
                return manifest
            if time.monotonic() + delay > deadline:
                raise WeightsError(f"{run_id}/{version} not published within {timeout_s:.1f}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
