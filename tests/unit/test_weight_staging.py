"""Staged weight files that can never be published are removed (weight_svc.store).

On the store alone (files only, no server): a refused commit (409: the version is published
with other content), an upload abandoned when a newer version was published (a trainer that
died mid-upload), and a retried commit's leftovers all leave no staging directory behind, at
the next commit or at start-up; a staging directory of a newer version is kept.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from weight_svc.store import Store, StoreError, StoreLimits

RUN = "run-1"


def stage(store: Store, version: int, content: bytes) -> None:
    upload = store.open_upload(RUN, version, "model.bin")
    upload.write(content)
    upload.finish()


def staging_dirs(store: Store) -> list[str]:
    return sorted(p.name for p in (store.root / RUN).iterdir() if p.name.startswith(".staging-"))


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path, StoreLimits(chunk_bytes=16, max_file_bytes=1 << 20))


def test_refused_commit_leaves_no_staging(store: Store) -> None:
    stage(store, 0, b"weights v0")
    store.commit(RUN, 0)
    stage(store, 0, b"other weights")
    with pytest.raises(StoreError) as refused:
        store.commit(RUN, 0)
    assert refused.value.status == 409
    assert staging_dirs(store) == []


def test_abandoned_older_upload_is_collected_at_the_next_commit(store: Store) -> None:
    stage(store, 0, b"weights v0")
    store.commit(RUN, 0)
    stage(store, 1, b"half of v1")  # the trainer dies here; its successor publishes v2
    stage(store, 3, b"v3, still being uploaded")
    stage(store, 2, b"weights v2")
    store.commit(RUN, 2)
    store.collect(RUN, keep_last=5, protect=2)
    assert staging_dirs(store) == [".staging-3"]  # newer: it may still be committed
    assert store.versions(RUN) == [0, 2]


def test_startup_sweep_collects_stale_staging(tmp_path: Path, store: Store) -> None:
    stage(store, 0, b"weights v0")
    store.commit(RUN, 0)
    stage(store, 0, b"weights v0")  # a retried upload of a published version
    stage(store, 1, b"weights v1")
    store.commit(RUN, 1)
    stage(store, 1, b"a leftover")
    restarted = Store(tmp_path, StoreLimits(chunk_bytes=16, max_file_bytes=1 << 20))
    restarted.sweep()
    assert staging_dirs(restarted) == []
    assert restarted.versions(RUN) == [0, 1]
