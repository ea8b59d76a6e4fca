"""A rollout instance leaves when the metadata server announces its preemption.

Real brokers and processes: the manager and one rollout instance polling the stand-in of the
AWS metadata server (tests/support/metadata.py); it must exit cleanly and deregister.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest

from rlboost.launcher import Child
from rlboost.stack import Stack
from shared.ports import free_port
from tests.support.metadata import Metadata

pytestmark = pytest.mark.slow


def test_instance_leaves_on_notice(brokers: Stack, metadata: Metadata, tmp_path: Path) -> None:
    port = free_port()
    env = {**brokers.env(), "RLBOOST_MANAGER_URL": f"http://127.0.0.1:{port}",
           "RLBOOST_DATA_DIR": str(tmp_path / "data")}
    manager = Child("manager", [sys.executable, "-m", "manager_svc"], env, tmp_path / "m.log")
    manager.start()
    instance = Child("spot-n", [sys.executable, "-m", "rollout_svc"], {
        **env, "RLBOOST_ENGINE": "emu", "RLBOOST_INSTANCE_ID": "spot-n",
        "RLBOOST_PREEMPTION_NOTICE": "aws", "RLBOOST_NOTICE_POLL_S": "0.1",
        "RLBOOST_METADATA_URL": f"http://127.0.0.1:{metadata.server_port}",
        "RLBOOST_GRACE_S": "5"}, tmp_path / "i.log")
    instance.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            for _ in range(200):
                try:
                    if any(i["id"] == "spot-n" for i in client.get("/v1/instances").json()):
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            else:
                pytest.fail(f"instance never registered:\n{instance.tail()}")
            metadata.preempted = True
            assert instance.proc is not None
            assert instance.proc.wait(timeout=10) == 0
            assert "announced a preemption" in instance.tail(40)
            # It deregistered on its way out rather than waiting to be reaped.
            assert all(i["id"] != "spot-n" for i in client.get("/v1/instances").json())
    finally:
        for child in (instance, manager):
            child.signal(9)
