"""Fixtures of the system tier: the whole stack as real processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rlboost.launcher import Cluster
from rlboost.stack import Stack
from tests.support.cluster import HA, start_cluster
from tests.support.links import Links


@pytest.fixture
def cluster(brokers: Stack, tmp_path: Path) -> Iterator[Cluster]:
    """The default small cluster: 2 spot and 1 reserved rollout instances, torch engine.
    Test modules that need another shape define their own ``cluster``."""
    c = start_cluster(tmp_path, brokers, spot=2, reserved=1)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def links() -> Iterator[Links]:
    """Fault proxies for each process's links (tests.support.links), closed after the test."""
    if HA:
        pytest.skip("RLBOOST_TEST_BROKERS=ha: a link proxy stands for one server's port, and a "
                    "client of a cluster reaches every node directly; the clustered campaign "
                    "is tests/system/test_ha_faults.py")
    proxies = Links()
    yield proxies
    proxies.close()
