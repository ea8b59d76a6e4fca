"""The weight store on a full filesystem: a refused upload leaves nothing behind.

A small tmpfs (root only: without ``mount`` the tests skip and say why). An upload that runs
out of space must free what it wrote, or the disk stays full after the refusal and every retry
fails too; a commit that runs out of space must publish nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.tmpfs import tmpfs
from weight_svc.store import Store, StoreError, StoreLimits


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "disk", "256k") as where:
        yield where


def leftovers(store: Store) -> list[str]:
    return sorted(p.name for p in store.root.rglob("*") if p.is_file())


def test_an_upload_that_fills_the_disk_frees_what_it_wrote(disk: Path) -> None:
    store = Store(disk, StoreLimits(chunk_bytes=4096, max_file_bytes=1 << 30))
    upload = store.open_upload("run", 1, "weights.bin")
    with pytest.raises(OSError):
        for _ in range(64):  # 512 KiB into 256 KiB, in the app's write batches
            upload.write(b"w" * (8 << 10))
        upload.finish()
    upload.abort()
    assert leftovers(store) == []
    with pytest.raises(StoreError) as refused:
        store.commit("run", 1)
    assert refused.value.status == 409  # nothing staged: nothing can be published
    # The space is back: the same upload now succeeds and publishes once.
    again = store.open_upload("run", 1, "weights.bin")
    again.write(b"w" * (64 << 10))
    again.finish()
    manifest, created = store.commit("run", 1)
    assert created and manifest["files"][0]["size"] == 64 << 10
    assert store.versions("run") == [1]
