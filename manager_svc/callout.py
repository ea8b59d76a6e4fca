"""The NATS auth callout: who may log in as a rollout instance, and what that instance may touch.

Contract: with RLBOOST_NATS_ISSUER_SEED set, the manager answers the NATS server's
authorization requests (``$SYS.REQ.USER.AUTH``, a queue group, so manager replicas share them).
Every login that is not one of the config's static users (manager, trainer) arrives here. It is
granted only if (1) it carries a rollout password (as nats-py's token or as user ``rollout``'s
password): NATS_ROLLOUT_PASSWORD makes it a spot instance, NATS_ROLLOUT_RESERVED_PASSWORD a
reserved one, (2) its connection name is a valid instance id, (3) it sent a public user nkey
and that key's signature of the server's nonce checks out, (4) no other key holds that instance
id, and (5) its credential holds fewer live ids than the cap. The id is bound to the key and
the credential's kind in Redis (``Keys.identity``) for as long as the instance lives (each
heartbeat renews it; a release or silence ends it), so a second process cannot claim a live
instance's id (a takeover is refused, not granted by cutting the older connection: the callout
has no system account to cut connections with, and granting would let any rollout credential
cut any instance off), and the registry takes the kind from it rather than from heartbeats.
The user JWT it issues allows exactly the subjects of :func:`shared.names.rollout_permissions`
for that one id and that key's fingerprint, with bounded payload, subscriptions and data. A
binding lapses with its instance (declared dead, its work revoked), and the dead process may
still be connected: a newer process then logs in under the id with a key of its own, and the
older connection, allowed its own key's subjects only, reads none of the newer one's
assignments and speaks in none of its beats, releases or chunks (cutting it off would take a
system account). A refusal is answered with the reason (the server logs it; the client sees an
authorization violation), counted and logged rate-limited; nothing about a credential is
logged.
"""

from __future__ import annotations

import hmac
import logging

import redis.asyncio as aioredis
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg as NatsMsg
from redis.exceptions import RedisError

from manager_svc.metrics import ManagerMetrics
from manager_svc.scripts import register
from shared import identity, names
from shared.logs import Throttled
from shared.names import Keys

log = logging.getLogger("manager")
ROLLOUT_USER = "rollout"
QUEUE = "rlb-auth-callout"
# Bind the id to the key this long before the first heartbeat renews it: connecting, then the
# first beat, take well under this.
BIND_TTL_MS = 10_000


class AuthCallout:
    def __init__(self, nc: Nats, redis: aioredis.Redis, issuer_seed: str,
                 passwords: dict[str, str], metrics: ManagerMetrics,
                 max_instances: int = 1024) -> None:
        """``passwords``: instance kind -> the rollout password that logs in as that kind."""
        self.nc = nc
        self.redis = redis
        self._seed = issuer_seed
        self._passwords = {kind: pw.encode() for kind, pw in passwords.items() if pw}
        self.max_instances = max_instances
        self.metrics = metrics
        self._bind = register(redis, "bind_identity.lua")
        self._refusals = Throttled(log)

    async def start(self) -> None:
        await self.nc.subscribe(names.AUTH_CALLOUT, queue=QUEUE, cb=self._on_request)
        log.info("auth callout for rollout instances on (issuer %s)",
                 identity.public_key(self._seed))

    async def _on_request(self, msg: NatsMsg) -> None:
        try:
            request = identity.decode_request(msg.data.decode(errors="replace"))
        except identity.IdentityError as exc:
            self.metrics.logins.labels("malformed").inc()
            log.warning("dropped an authorization request: %s", exc)
            return  # unanswered: the server times the login out, i.e. refuses it
        try:
            refusal = await self.check(request)
        except RedisError as exc:
            refusal = "state store unavailable, try again"
            log.warning("auth callout: %s", exc)
        if refusal is None:
            publish, subscribe = names.rollout_permissions(request.name,
                                                           names.fingerprint(request.nkey))
            user = identity.user_jwt(self._seed, request.user_nkey, request.name, publish,
                                     subscribe)
            reply = identity.authorization_response(self._seed, request, user)
            self.metrics.logins.labels("granted").inc()
            log.info("instance %s logged in to NATS", request.name)
        else:
            reply = identity.authorization_response(self._seed, request, None, refusal)
            self.metrics.logins.labels("refused").inc()
            self._refusals.warning("NATS login as %r refused: %s", request.name[:80], refusal)
        await msg.respond(reply.encode())

    async def check(self, request: identity.AuthRequest) -> str | None:
        """Why this login is refused, or None to grant it."""
        given = (request.token or (request.password if request.user == ROLLOUT_USER else "")
                 ).encode()
        # Every password compared, so the time taken says nothing about which one matched.
        kinds = [kind for kind, pw in self._passwords.items() if hmac.compare_digest(given, pw)]
        if not kinds:
            return "wrong or missing rollout credentials"
        if not names.valid_instance_id(request.name):
            return "the connection name must be the instance id"
        if not request.nkey or not identity.nonce_signed_by(request.nkey, request.nonce,
                                                             request.signature):
            return "no valid nkey signature of the nonce"
        bound = await self._bind(
            keys=[Keys.identity(request.name), Keys.credential_ids(kinds[0])],
            args=[f"{kinds[0]}:{request.nkey}", BIND_TTL_MS, self.max_instances, request.name,
                  Keys.identity("")])
        if bound == 0:
            return f"instance id {request.name} is held by another process"
        if bound == -1:
            return f"this credential holds {self.max_instances} live instances already"
        return None
