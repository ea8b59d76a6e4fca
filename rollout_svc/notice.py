"""Cloud preemption notices, turned into the same path as SIGTERM.

AWS posts a spot interruption notice about two minutes ahead at instance metadata
``/latest/meta-data/spot/instance-action`` (404 until then; IMDSv2 needs a session token from
``PUT /latest/api/token``). GCP sets ``/computeMetadata/v1/instance/preempted`` to ``TRUE``
(header ``Metadata-Flavor: Google``) about 30 s before power-off. The poller asks every
``interval_s`` and calls ``on_notice`` once; a metadata server that cannot be reached is logged
once and retried, never fatal (the instance still has SIGTERM).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Literal

import httpx

log = logging.getLogger("rollout.notice")

Provider = Literal["aws", "gcp"]
DEFAULT_URLS: dict[str, str] = {
    "aws": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
}
AWS_TOKEN_TTL_S = 21600


class NoticePoller:
    def __init__(self, provider: Provider, base_url: str | None = None,
                 interval_s: float = 5.0) -> None:
        self.provider = provider
        self.base_url = (base_url or DEFAULT_URLS[provider]).rstrip("/")
        self.interval_s = interval_s
        self._token: str | None = None
        self._warned = False

    async def _aws(self, client: httpx.AsyncClient) -> bool:
        if self._token is None:
            resp = await client.put(f"{self.base_url}/latest/api/token", headers={
                "X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)})
            resp.raise_for_status()
            self._token = resp.text
        resp = await client.get(f"{self.base_url}/latest/meta-data/spot/instance-action",
                                headers={"X-aws-ec2-metadata-token": self._token})
        if resp.status_code == 401:
            self._token = None  # expired session token: get a new one next time
            return False
        return resp.status_code == 200

    async def _gcp(self, client: httpx.AsyncClient) -> bool:
        resp = await client.get(f"{self.base_url}/computeMetadata/v1/instance/preempted",
                                headers={"Metadata-Flavor": "Google"})
        return resp.status_code == 200 and resp.text.strip().upper() == "TRUE"

    async def check(self, client: httpx.AsyncClient) -> bool:
        """One poll: True when the cloud has announced this machine's preemption."""
        try:
            return await (self._aws(client) if self.provider == "aws" else self._gcp(client))
        except httpx.HTTPError as exc:
            if not self._warned:
                log.warning("metadata server %s unreachable: %s", self.base_url, exc)
                self._warned = True
            return False

    async def run(self, on_notice: Callable[[], None]) -> None:
        async with httpx.AsyncClient(timeout=2.0) as client:
            while not await self.check(client):
                await asyncio.sleep(self.interval_s)
        log.warning("%s announced a preemption of this machine", self.provider)
        on_notice()
