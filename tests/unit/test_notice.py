"""Preemption notices from a local stand-in for the AWS and GCP metadata servers.

The poller against the stand-in (tests/support/metadata.py) in this process; an instance
leaving on a notice is tests/system/test_notice_leave.py.
"""

from __future__ import annotations

import httpx
import pytest

from rollout_svc.notice import NoticePoller
from shared.ports import free_port
from tests.support.metadata import Metadata


@pytest.mark.parametrize("provider", ["aws", "gcp"])
async def test_poller_sees_the_notice(metadata: Metadata, provider: str) -> None:
    poller = NoticePoller(provider, f"http://127.0.0.1:{metadata.server_port}",  # type: ignore[arg-type]
                          interval_s=0.01)
    async with httpx.AsyncClient() as client:
        assert not await poller.check(client)
        assert not await poller.check(client)
        metadata.preempted = True
        assert await poller.check(client)
    if provider == "aws":
        assert metadata.token_requests == 1  # the session token is reused


async def test_unreachable_metadata_is_not_a_notice() -> None:
    poller = NoticePoller("gcp", f"http://127.0.0.1:{free_port()}", interval_s=0.01)
    async with httpx.AsyncClient() as client:
        assert not await poller.check(client)
