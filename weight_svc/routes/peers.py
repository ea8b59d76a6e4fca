"""Peers: rollout instances that serve a published version's files to others.

Contract: ``POST`` registers ``{"url": "http://host:port"}`` for a published version (it expires
after the registry's TTL, given in the reply); ``GET`` lists the live ones (none with
``RLBOOST_WEIGHTS_PEERS`` off). Both take the read token: an instance that may download a version
may serve it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from weight_svc.peers import check_peer_url
from weight_svc.routes.dependencies import PREFIX, Service
from weight_svc.store import check_ids

router = APIRouter(prefix=PREFIX)


class PeerIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(max_length=300)  # http(s)://host:port of the peer's chunk server


@router.post("/{run_id}/{version}/peers")
async def add_peer(run_id: str, version: int, body: PeerIn, service: Service
                   ) -> dict[str, Any]:
    url = check_peer_url(body.url)
    await asyncio.to_thread(service.store.manifest, run_id, version)  # published versions only
    ttl = service.peers.register(run_id, version, url)
    return {"run_id": run_id, "version": version, "url": url, "ttl_s": ttl}


@router.get("/{run_id}/{version}/peers")
async def list_peers(run_id: str, version: int, service: Service) -> dict[str, Any]:
    check_ids(run_id, version)
    # RLBOOST_WEIGHTS_PEERS off: nobody is listed, so every pull takes the service's link.
    peers = service.peers.peers(run_id, version) if service.cfg.peers else []
    return {"run_id": run_id, "version": version, "peers": peers}
