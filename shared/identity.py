"""NATS identities: nkey pairs, and the JWTs of the auth callout, built here from their claims.

Contract: a rollout process proves who it is with an ephemeral *user* nkey pair it makes at start
(:func:`new_user_seed`), signing the server's nonce (nats-py does the signing given the seed).
The manager answers the NATS server's authorization requests (``$SYS.REQ.USER.AUTH``) as the
holder of an *account* nkey, the issuer named in the server's config: :func:`decode_request`
reads the request JWT the server signed, :func:`nonce_signed_by` checks the client's nonce
signature (the server leaves that to the callout), and :func:`authorization_response` signs the
reply: a user JWT with the permissions granted, wrapped in a response JWT, both signed by the
issuer. The claims follow nats-io/jwt v2 (``typ JWT``, ``alg ed25519-nkey``, base64url without
padding, ``jti`` = base32 of the SHA-512/256 of the claims). ``python -m shared.identity``
prints a fresh issuer seed and its public key for a deployment's ``.env``.

Nothing here logs, and no seed is ever part of a string this module returns, except the
seed :func:`new_account_seed` / :func:`new_user_seed` hand to their caller.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import nacl.exceptions
import nacl.signing
import nkeys

USER_PREFIX = nkeys.PREFIX_BYTE_USER
ACCOUNT_PREFIX = nkeys.PREFIX_BYTE_ACCOUNT
SERVER_PREFIX = nkeys.PREFIX_BYTE_SERVER
_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
GLOBAL_ACCOUNT = "$G"  # where a config-mode server places callout users


class IdentityError(ValueError):
    """A key, signature or token that does not check out."""


def _new_seed(prefix: int) -> str:
    return bytes(nkeys.encode_seed(os.urandom(32), prefix)).decode()


def new_user_seed() -> str:
    """A fresh user nkey seed: a rollout process's identity for the life of the process."""
    return _new_seed(USER_PREFIX)


def new_account_seed() -> str:
    """A fresh account nkey seed: the issuer of callout users (RLBOOST_NATS_ISSUER_SEED)."""
    return _new_seed(ACCOUNT_PREFIX)


def _keypair(seed: str) -> nkeys.KeyPair:
    try:
        return nkeys.from_seed(bytearray(seed.strip().encode()))
    except (nkeys.NkeysError, binascii.Error, ValueError) as exc:
        raise IdentityError("not an nkey seed") from exc


def public_key(seed: str) -> str:
    return bytes(_keypair(seed).public_key).decode()


def _verify_key(public: str, prefix: int) -> nacl.signing.VerifyKey:
    """The ed25519 key inside an encoded public nkey of role ``prefix``."""
    try:
        raw = base64.b32decode(public + "=" * (-len(public) % 8))
    except (binascii.Error, ValueError) as exc:
        raise IdentityError("public key is not base32") from exc
    if len(raw) != 35 or raw[0] != prefix:
        raise IdentityError("public key of the wrong kind or length")
    if nkeys.crc16_checksum(raw[:33]) != raw[33:]:
        raise IdentityError("public key checksum mismatch")
    return nacl.signing.VerifyKey(raw[1:33])


def _b64decode(text: str) -> bytes:
    """base64, URL-safe or standard, padded or not (Go clients send one, nats-py the other)."""
    padded = text + "=" * (-len(text) % 4)
    try:
        return base64.urlsafe_b64decode(padded.replace("+", "-").replace("/", "_"))
    except (binascii.Error, ValueError) as exc:
        raise IdentityError("not base64") from exc


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def nonce_signed_by(public: str, nonce: str, signature: str) -> bool:
    """Whether ``signature`` is the user key ``public``'s signature of ``nonce``."""
    try:
        _verify_key(public, USER_PREFIX).verify(nonce.encode(), _b64decode(signature))
    except (IdentityError, nacl.exceptions.BadSignatureError, ValueError):
        return False
    return True


def _encode(claims: dict[str, Any], seed: str) -> str:
    claims = dict(claims)
    claims["jti"] = ""
    digest = hashlib.new("sha512_256", json.dumps(claims, separators=(",", ":")).encode())
    claims["jti"] = base64.b32encode(digest.digest()).rstrip(b"=").decode()
    head = _b64(json.dumps(_HEADER, separators=(",", ":")).encode())
    body = _b64(json.dumps(claims, separators=(",", ":")).encode())
    signature = _keypair(seed).sign(f"{head}.{body}".encode())
    return f"{head}.{body}.{_b64(signature)}"


def decode(token: str, issuer_prefix: int) -> dict[str, Any]:
    """The claims of a JWT whose signature by its own ``iss`` (of role ``issuer_prefix``)
    checks out; IdentityError otherwise."""
    try:
        head, body, signature = token.strip().split(".")
        claims = json.loads(_b64decode(body))
        key = _verify_key(str(claims["iss"]), issuer_prefix)
        key.verify(f"{head}.{body}".encode(), _b64decode(signature))
    except (ValueError, KeyError, TypeError, nacl.exceptions.BadSignatureError) as exc:
        raise IdentityError(f"not a valid JWT: {type(exc).__name__}") from exc
    if not isinstance(claims, dict) or not isinstance(claims.get("nats"), dict):
        raise IdentityError("JWT without nats claims")
    return claims


@dataclass(frozen=True, slots=True)
class AuthRequest:
    """What a NATS server asks about one connecting client (nats-io/jwt AuthorizationRequest)."""

    server_id: str  # the response's audience
    user_nkey: str  # the key the server made for this connection: the user JWT's subject
    user: str
    password: str
    token: str
    nkey: str  # the client's own public nkey, if it sent one
    signature: str  # its signature of the nonce
    nonce: str
    name: str  # the client's connection name


def decode_request(token: str) -> AuthRequest:
    claims = decode(token, SERVER_PREFIX)
    nats = claims["nats"]
    connect = nats.get("connect_opts") or {}
    client = nats.get("client_info") or {}
    server = nats.get("server_id") or {}
    if claims.get("aud") != "nats-authorization-request" or not nats.get("user_nkey"):
        raise IdentityError("not an authorization request")

    def text(d: dict[str, Any], key: str) -> str:
        value = d.get(key)
        return value if isinstance(value, str) else ""

    return AuthRequest(
        server_id=text(server, "id"), user_nkey=text(nats, "user_nkey"),
        user=text(connect, "user"), password=text(connect, "pass"),
        token=text(connect, "auth_token"), nkey=text(connect, "nkey"),
        signature=text(connect, "sig"), nonce=text(client, "nonce"), name=text(connect, "name"),
    )


# What one callout user may send and hold: a rollout process's largest message is a token
# frame, and it subscribes to its assignments, its inbox and the announcements (plus nats-py's
# request inbox). Claimed in its JWT as nats-io/jwt defines them; nats-server 2.15 does not
# apply a callout user's own limits, so the server-wide max_payload and max_subscriptions
# (compose/nats.conf) are what bounds a connection there.
USER_MAX_PAYLOAD = 4 << 20
USER_MAX_SUBS = 16


def user_jwt(issuer_seed: str, user_nkey: str, name: str, publish: list[str],
             subscribe: list[str], max_payload: int = USER_MAX_PAYLOAD,
             max_subs: int = USER_MAX_SUBS) -> str:
    """A user of the global account allowed exactly ``publish`` and ``subscribe``, messages
    of at most ``max_payload`` bytes and at most ``max_subs`` subscriptions."""
    return _encode({
        "iat": int(time.time()), "iss": public_key(issuer_seed), "sub": user_nkey,
        "aud": GLOBAL_ACCOUNT, "name": name,
        "nats": {"pub": {"allow": publish}, "sub": {"allow": subscribe}, "subs": max_subs,
                 "data": -1, "payload": max_payload, "type": "user", "version": 2},
    }, issuer_seed)


def authorization_response(issuer_seed: str, request: AuthRequest, user: str | None,
                           error: str = "") -> str:
    """The callout's reply: ``user`` (a user JWT) on success, else ``error``."""
    nats: dict[str, Any] = {"type": "authorization_response", "version": 2}
    if user is not None:
        nats["jwt"] = user
    else:
        nats["error"] = error or "not authorized"
    return _encode({"iat": int(time.time()), "iss": public_key(issuer_seed),
                    "sub": request.user_nkey, "aud": request.server_id, "nats": nats},
                   issuer_seed)


def main() -> None:
    """Print a fresh issuer: the seed for the manager, the public key for nats.conf."""
    seed = new_account_seed()
    print(f"RLBOOST_NATS_ISSUER_SEED={seed}\nNATS_ISSUER={public_key(seed)}")


if __name__ == "__main__":
    main()
