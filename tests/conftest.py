"""Fixtures every tier may use: real brokers on free ports, a metadata-server stand-in.

No fakes: ``brokers`` starts ``nats-server -js`` and ``redis-server`` from the venv for each
test that asks (about 0.2 s), so fault tests may kill and restart them freely. The tiers:
``unit/`` starts no process and no broker; ``integration/`` real brokers and at most one of the
services; ``system/`` several services up to the whole stack, with faults (marked ``slow``).
Helpers the tiers share live in ``support/``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlboost.ha_stack import HaStack
from rlboost.stack import Stack
from tests.support.cluster import HA, running
from tests.support.metadata import Handler, Metadata


@pytest.fixture
def brokers(tmp_path: Path) -> Iterator[Stack | HaStack]:
    """The embedded brokers; with RLBOOST_TEST_BROKERS=ha (make test-ha) the clustered ones."""
    if HA:
        yield from running(HaStack.create(tmp_path / "brokers"))
    else:
        yield from running(Stack.create(tmp_path / "brokers"))


@pytest.fixture
def locked(tmp_path: Path) -> Iterator[Stack]:
    """nats-server from the shipped compose/nats.conf (its roles' credentials in the server's
    environment, as compose passes them, rollout logins through the manager's auth callout),
    Redis with a password."""
    yield from running(Stack.create(tmp_path / "locked", locked=True))


@pytest.fixture
def metadata() -> Iterator[Metadata]:
    server = Metadata(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
