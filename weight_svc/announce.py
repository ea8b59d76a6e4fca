"""Best-effort announcements of new versions on NATS.

Contract: the weight service works with no NATS at all. The connection is made in the background
(start-up never waits for it) and retried forever by nats-py; an unreachable server is logged
once, not per attempt. :meth:`Announcer.announce` never raises and never blocks for long: a lost
announcement costs a rollout instance one poll interval, nothing more, because instances also
poll the manifest endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from typing import Any

import nats
from nats.aio.client import Client

from shared.names import WEIGHTS_ANNOUNCE
from shared.protocol import WeightsAnnounce, encode
from shared.settings import mask_url, split_urls

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 1.0
PUBLISH_TIMEOUT_S = 1.0
CLOSE_TIMEOUT_S = 2.0


class Announcer:
    def __init__(self, nats_url: str, tls: ssl.SSLContext | None = None) -> None:
        self._url = nats_url
        # TLS first, as shared.bus connects: no password before the handshake.
        self._tls: dict[str, Any] = {"tls": tls, "tls_handshake_first": True} if tls else {}
        self._shown = mask_url(nats_url)  # what the log may say: its password masked
        self._nc: Client | None = None
        self._task: asyncio.Task[None] | None = None
        self._warned = False

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._connect(), name="weights-nats-connect")

    async def _on_error(self, exc: Exception) -> None:
        # nats-py calls this on every failed attempt; one warning says all there is to say.
        if not self._warned:
            self._warned = True
            log.warning("NATS at %s unreachable (%s); announcements wait for it", self._shown, exc)

    async def _on_reconnect(self) -> None:
        log.info("NATS at %s connected again", self._shown)

    async def _connect(self) -> None:
        try:
            self._nc = await nats.connect(
                servers=split_urls(self._url),  # every node of a cluster, or one server
                name="rlboost-weight-svc",
                connect_timeout=CONNECT_TIMEOUT_S,
                allow_reconnect=True,
                max_reconnect_attempts=-1,  # the first connect too: keep trying in the background
                reconnect_time_wait=2.0,
                error_cb=self._on_error,
                **self._tls,
                reconnected_cb=self._on_reconnect,
            )
            log.info("NATS at %s connected; announcing new versions", self._shown)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # e.g. a TLS or auth refusal: announcements stay off
            log.warning("NATS at %s refused (%s); announcements are off", self._shown, exc)

    async def announce(self, run_id: str, version: int) -> bool:
        """Publish one WeightsAnnounce; True if it was handed to NATS."""
        nc = self._nc
        if nc is None or not nc.is_connected:
            return False
        msg = encode(WeightsAnnounce(run_id=run_id, weight_version=version))
        try:
            await asyncio.wait_for(nc.publish(WEIGHTS_ANNOUNCE, msg), PUBLISH_TIMEOUT_S)
            await asyncio.wait_for(nc.flush(), PUBLISH_TIMEOUT_S)
        except Exception as exc:
            log.info("announcing %s/%d failed: %s", run_id, version, exc)
            return False
        return True

    async def close(self) -> None:
        """Idempotent: stop connecting, then close the connection if there is one."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        nc, self._nc = self._nc, None
        if nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), CLOSE_TIMEOUT_S)
