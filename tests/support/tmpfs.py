"""A small tmpfs for disk-full tests: ``mount -t tmpfs`` needs root (CI runs as root); where it
is refused the test skips and says why."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """``where`` (created if missing) on a tmpfs of ``size`` (``1m``, ``256k``) until exit."""
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {where}: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
