"""Calls on the weight service other than pulling (that is :mod:`shared.weights.pull`).

Trainers and rollout instances import these through :mod:`shared.weights`. Contract:
- :func:`upload_version` streams every file of a flat HF model directory to the service (never
  whole in memory: the body is read 1 MiB at a time as the socket takes it), then commits; it
  returns the manifest. Idempotent: uploading a version that is already published with the same
  content returns its manifest; different content is an error.
- Its three parts, for a directory that several processes upload in parallel (the ranks of a
  sharded trainer, each sending the files it wrote): :func:`published` (the manifest when the
  version is already there with this content), :func:`upload_files` (files only, into the
  version's staging area, where uploads from any number of connections meet) and
  :func:`commit_version` (one caller, once every part is in).
- :func:`upload_adapter_version` publishes a LoRA version as its adapter alone, over a full
  base version of the run that is published already (:mod:`shared.weights.manifest`).
- :func:`wait_for_version` polls until a version is published.
- :func:`pin_version` / :func:`unpin_version`: a pinned version is never collected. The service
  already keeps the newest two (the step being rolled out and the one being published); a caller
  that needs an older one for longer pins it for as long as it does.
- :func:`list_peers` names the peers that serve a version (see :mod:`shared.weights.peer`).
- :func:`list_versions` names the versions of a run the service holds, and the pinned ones.

Every failure is a :class:`WeightsError`; ``retryable`` is False where retrying cannot help (a bad
name, conflicting content, a chunk corrupt at the source, a rejected token).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import shutil
import ssl
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

from shared.errors import WeightsError
from shared.tls import Tls
from shared.weights.manifest import (
    ADAPTER_BASE_NAME,
    ADAPTER_FILES,
    ADAPTER_SUFFIX,
    Manifest,
    check_ids,
    content_sha256,
    file_sha256,
    valid_name,
)
from shared.weights.session import Session

log = logging.getLogger(__name__)

_IO_BLOCK = 1 << 20


# --- upload -----------------------------------------------------------------------------------


def _verify(tls: Tls | None) -> ssl.SSLContext | bool:
    """Every call's ``tls``: the CA the service is verified with (None: plain or system CAs)."""
    return tls.verify() if tls is not None else True


def model_files(model_dir: Path) -> list[Path]:
    """What uploading ``model_dir`` sends: its flat files in name order, dot-files left out."""
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


async def _same_content(manifest: Manifest, files: list[Path]) -> bool:
    remote = {f["name"]: (f["size"], f["sha256"]) for f in manifest["files"]}
    if set(remote) != {p.name for p in files}:
        return False
    if any(remote[p.name][0] != p.stat().st_size for p in files):
        return False
    for p in files:
        if await asyncio.to_thread(file_sha256, p) != remote[p.name][1]:
            return False
    return True


async def published(base_url: str, token: str | None, run_id: str, version: int,
                    files: list[Path], timeout_s: float = 60, *, tls: Tls | None = None
                    ) -> Manifest | None:
    """The manifest when (run_id, version) is published with exactly ``files``; None when it
    is not published; a non-retryable WeightsError when it is, with other content."""
    check_ids(run_id, version)
    async with Session(base_url, token, timeout_s, max_attempts=5,
                       verify=_verify(tls)) as session:
        existing = await session.manifest(run_id, version)
    if existing is None:
        return None
    if await _same_content(existing, files):
        return existing
    raise WeightsError(f"{run_id}/{version} is already published with different content", False)


async def upload_files(base_url: str, token: str | None, run_id: str, version: int,
                       files: list[Path], timeout_s: float = 60, *, tls: Tls | None = None
                       ) -> None:
    """Stream ``files`` into the version's staging area; nothing is published until a commit.

    ``timeout_s`` bounds each network operation (connect, each read or write), not the whole
    upload: a multi-GB checkpoint may rightly take longer.
    """
    check_ids(run_id, version)
    for path in files:
        if not path.is_file() or not valid_name(path.name):
            raise WeightsError(f"{path}: only flat files with plain names can be uploaded", False)
    async with Session(base_url, token, timeout_s, max_attempts=5,
                       verify=_verify(tls)) as session:
        for path in files:
            size = path.stat().st_size
            await session.send(
                "PUT",
                f"/v1/weights/{run_id}/{version}/files/{path.name}",
                headers={"Content-Length": str(size)},
                body=functools.partial(_file_body, path),
            )


async def commit_version(base_url: str, token: str | None, run_id: str, version: int,
                         timeout_s: float = 60, *, tls: Tls | None = None) -> Manifest:
    """Publish what is staged for (run_id, version), atomically; returns the manifest."""
    check_ids(run_id, version)
    async with Session(base_url, token, timeout_s, max_attempts=5,
                       verify=_verify(tls)) as session:
        resp = await session.send("POST", f"/v1/weights/{run_id}/{version}/commit")
    manifest: Manifest = resp.json()
    return manifest


async def upload_version(
    base_url: str,
    token: str | None,
    run_id: str,
    version: int,
    model_dir: Path,
    timeout_s: float = 60,
    *,
    tls: Tls | None = None,
) -> Manifest:
    """Upload and publish ``model_dir`` as (run_id, version); returns the manifest."""
    files = model_files(model_dir)
    existing = await published(base_url, token, run_id, version, files, timeout_s, tls=tls)
    if existing is not None:
        return existing
    await upload_files(base_url, token, run_id, version, files, timeout_s, tls=tls)
    return await commit_version(base_url, token, run_id, version, timeout_s, tls=tls)


async def upload_adapter_version(
    base_url: str, token: str | None, run_id: str, version: int, model_dir: Path, base: int,
    timeout_s: float = 60, *, tls: Tls | None = None,
) -> Manifest:
    """Publish the adapter of LoRA version ``model_dir`` (PEFT's files under
    :data:`ADAPTER_SUFFIX`, beside the merged model) as an adapter-only version over ``base``,
    a full version of the run; idempotent as :func:`upload_version` is."""
    reply = await wait_for_version(base_url, token, run_id, base, timeout_s, tls=tls)
    if "adapter" in reply:
        raise WeightsError(f"{run_id}/{base} is an adapter version, not a base", False)
    ref = {"base": base, "base_sha256": content_sha256(reply)}
    with tempfile.TemporaryDirectory(dir=model_dir.parent, prefix=".adapter-") as scratch:
        out = Path(scratch)
        for name in ADAPTER_FILES:
            shutil.copyfile(model_dir / (name + ADAPTER_SUFFIX), out / name)
        (out / ADAPTER_BASE_NAME).write_text(json.dumps(ref, sort_keys=True))
        return await upload_version(base_url, token, run_id, version, out, timeout_s, tls=tls)


async def wait_for_version(
    base_url: str, token: str | None, run_id: str, version: int, timeout_s: float,
    *, tls: Tls | None = None,
) -> Manifest:
    """Poll until (run_id, version) is published; its manifest, or WeightsError after timeout_s."""
    check_ids(run_id, version)
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    async with Session(base_url, token, max(timeout_s, 1.0), patience_s=timeout_s,
                       verify=_verify(tls)) as session:
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


async def pin_version(
    base_url: str, token: str | None, run_id: str, version: int, timeout_s: float = 30,
    *, tls: Tls | None = None,
) -> None:
    """Never collect (run_id, version) until :func:`unpin_version`; it must be published."""
    check_ids(run_id, version)
    async with Session(base_url, token, timeout_s, max_attempts=5,
                       verify=_verify(tls)) as session:
        await session.send("POST", f"/v1/weights/{run_id}/{version}/pin")


async def unpin_version(
    base_url: str, token: str | None, run_id: str, version: int, timeout_s: float = 30,
    *, tls: Tls | None = None,
) -> None:
    check_ids(run_id, version)
    async with Session(base_url, token, timeout_s, max_attempts=5,
                       verify=_verify(tls)) as session:
        await session.send("DELETE", f"/v1/weights/{run_id}/{version}/pin")


async def list_versions(
    base_url: str, token: str | None, run_id: str, timeout_s: float = 10,
    *, tls: Tls | None = None,
) -> tuple[list[int], list[int]]:
    """The run's published versions and its pinned ones, ascending (both empty: none)."""
    check_ids(run_id, 0)
    async with Session(base_url, token, timeout_s, max_attempts=3,
                       verify=_verify(tls)) as session:
        reply = await session.json("GET", f"/v1/weights/{run_id}")
    return [int(v) for v in reply["versions"]], [int(v) for v in reply["pinned"]]


async def list_peers(
    base_url: str, token: str | None, run_id: str, version: int, timeout_s: float = 10,
    *, tls: Tls | None = None,
) -> list[str]:
    check_ids(run_id, version)
    async with Session(base_url, token, timeout_s, max_attempts=3,
                       verify=_verify(tls)) as session:
        reply = await session.json("GET", f"/v1/weights/{run_id}/{version}/peers")
    return [str(u) for u in reply["peers"]]
