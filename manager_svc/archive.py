"""A run's archive in the data dir: what stays of a run once its Redis keys are gone.

Contract: Redis holds a run's working state; once a step completes, its samples and record are
written here, and once the run ends, its record, step records (fault counters final), warnings
and instance events too; then its Redis keys expire (RLBOOST_RETENTION_S). The REST API serves a
run from Redis while its keys live and from here after, the same bytes either way: the texts
are stored exactly as Redis held them and read back with the same decoder.

Layout, one directory per run under ``<data dir>/archive/``::

    step-000042.json.gz   {"record": <record JSON text>, "samples": <samples JSON text>}
    run.json.gz           {"run": ..., "records": [...], "warnings": [...], "events": [...]}
    record.json.gz        the run's record alone (GET /v1/runs/{id}, listings)

and ``<data dir>/archive/index``, a line ``<created_at> <run id>`` per archived run (appended
each time a run ends; the last line of a run wins): once a run's keys expire it leaves Redis's
runs index, and listings find it here.

Every file is gzip-compressed JSON written atomically (a temporary file in the same directory,
fsynced, renamed over the name, the directory fsynced), so a reader or a manager killed mid-write
sees the old file or the new one, never a torn one. File work runs in a worker thread: a step's
samples can be megabytes, and the event loop serves heartbeats meanwhile.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

_RUN_ID = re.compile(r"^run-[0-9a-f]{1,64}$")  # RunStore's ids: nothing else becomes a path
LEVEL = 6  # gzip level: token-id JSON compresses ~4x; higher levels gain little, cost much


class Archive:
    def __init__(self, data_dir: Path) -> None:
        self.root = data_dir / "archive"

    def run_dir(self, run_id: str) -> Path | None:
        return self.root / run_id if _RUN_ID.match(run_id) else None

    def step_path(self, run_id: str, step: int) -> Path | None:
        folder = self.run_dir(run_id)
        return None if folder is None or step < 0 else folder / f"step-{step:06d}.json.gz"

    async def write_step(self, run_id: str, step: int, record: str, samples: str) -> None:
        path = self.step_path(run_id, step)
        if path is not None:
            await asyncio.to_thread(_write, path, {"record": record, "samples": samples})

    async def step(self, run_id: str, step: int) -> dict[str, str] | None:
        """{"record", "samples"} of an archived step, as JSON texts; None if not archived."""
        path = self.step_path(run_id, step)
        return None if path is None else await asyncio.to_thread(_read, path)

    async def write_run(self, run_id: str, data: dict[str, Any]) -> None:
        folder = self.run_dir(run_id)
        if folder is not None:
            await asyncio.to_thread(_write, folder / "run.json.gz", data)
            await asyncio.to_thread(_write, folder / "record.json.gz", data["run"])
            await asyncio.to_thread(self._index, run_id, float(data["run"]["created_at"]))

    async def record(self, run_id: str) -> dict[str, Any] | None:
        """An archived run's record, without reading its steps and events."""
        folder = self.run_dir(run_id)
        return None if folder is None else await asyncio.to_thread(_record, folder)

    async def listed(self, before: float | None, count: int) -> list[tuple[str, float]]:
        """(run id, created_at) of the newest ``count`` archived runs created before
        ``before``, newest first."""
        return await asyncio.to_thread(self._listed, before, count)

    def _listed(self, before: float | None, count: int) -> list[tuple[str, float]]:
        try:
            lines = (self.root / "index").read_text().splitlines()
        except FileNotFoundError:
            return []
        found: dict[str, float] = {}
        for line in lines:
            created, _, run_id = line.partition(" ")
            try:
                at = float(created)
            except ValueError:
                continue  # a line torn by a host crash
            if _RUN_ID.match(run_id) and (before is None or at < before):
                found[run_id] = at
        return sorted(found.items(), key=lambda kv: kv[1], reverse=True)[:count]

    def _index(self, run_id: str, created_at: float) -> None:
        fd = os.open(self.root / "index", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{created_at!r} {run_id}\n".encode())  # one write: never interleaved
            os.fsync(fd)
        finally:
            os.close(fd)

    async def run(self, run_id: str) -> dict[str, Any] | None:
        folder = self.run_dir(run_id)
        return None if folder is None else await asyncio.to_thread(_read, folder / "run.json.gz")


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb",
                                                       compresslevel=LEVEL, mtime=0) as out:
            out.write(json.dumps(data).encode())
            out.close()  # the gzip trailer before the fsync
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename itself survives a host crash
    finally:
        os.close(folder)


def _record(folder: Path) -> Any:
    found = _read(folder / "record.json.gz")
    if found is None:  # archived before record files were written
        whole = _read(folder / "run.json.gz")
        found = None if whole is None else whole["run"]
    return found


def _read(path: Path) -> Any:
    try:
        with gzip.open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None
