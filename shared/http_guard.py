"""The front door of the REST services: bearer tokens and body limits, before any body is read.

Contract: :class:`Guard` is a pure ASGI middleware around a service's app. For each request it
asks the service's :data:`Rule` what the route needs (:class:`Access`: a token scope or none,
and the largest body it takes), then, from the headers alone: a missing or unknown bearer token
is 401, a valid token of another scope (the weights read token on an upload) is 403, a declared
``Content-Length`` over the limit is 413; and a body that streams past the limit without one is
cut off with 413 as well. Only then does the app see the request, so an unauthenticated client
can make a service read nothing. A scope with no token configured is open (local development).
Tokens are compared in constant time. :func:`document` writes the same rules into the service's
OpenAPI document: the bearer scheme on every guarded route, and each route's error responses.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.errors import ConfigError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
# Paths that say how a service is doing or how to call it: open or guarded by RLBOOST_EXPOSE.
INFO_PATHS = ("/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")
ERROR_SCHEMA = {"type": "object", "required": ["detail"], "properties": {"detail": {}}}
_REASONS = {400: "Bad request", 401: "Missing or wrong bearer token",
            403: "The token is valid but not for this route", 404: "No such resource",
            409: "Conflicts with the resource's state", 413: "Request body too large",
            416: "Range not satisfiable", 422: "Invalid parameters or body",
            429: "Too many; try again later", 503: "A broker or store is unavailable; retry",
            507: "The store's disk failed"}


@dataclass(frozen=True, slots=True)
class Access:
    scope: str | None  # the token scope the route needs; None = open
    max_body: int  # bytes


Rule = Callable[[str, str], Access]  # (method, path) -> what the route needs


def refuse_open_bind(service: str, bind_host: str, token: object | None, setting: str) -> None:
    """A service bound beyond loopback with no token for ``setting`` would take anyone's
    requests: it exits before it listens, naming the setting (no traceback)."""
    if token is None and bind_host not in LOOPBACK:
        problem = ConfigError(setting, f"unset, but the {service} would listen on {bind_host}, "
                              "beyond this machine: set it, or use a loopback URL")
        raise SystemExit(f"{service}: {problem}")


def refuse_plain_bind(service: str, bind_host: str, serving_tls: bool, allowed: bool) -> None:
    """A service bound beyond loopback without TLS would carry its tokens and what it serves
    in clear: it exits before it listens, unless RLBOOST_ALLOW_PLAINTEXT says TLS ends in
    front of it (a proxy)."""
    if not serving_tls and not allowed and bind_host not in LOOPBACK:
        problem = ConfigError("RLBOOST_TLS_CERT_FILE", f"unset, but the {service} would serve "
                              f"plain HTTP on {bind_host}, beyond this machine: set it and "
                              "RLBOOST_TLS_KEY_FILE (rlboost certs DIR makes them), use a "
                              "loopback URL, or set RLBOOST_ALLOW_PLAINTEXT=true behind a TLS "
                              "proxy")
        raise SystemExit(f"{service}: {problem}")


def info_open(expose: str, bind_host: str) -> bool:
    """RLBOOST_EXPOSE: are /metrics and the docs open on a service bound to ``bind_host``?"""
    return expose == "open" or (expose == "auto" and bind_host in LOOPBACK)


class _TooLarge(Exception):
    pass


class Guard:
    def __init__(self, app: ASGIApp, rule: Rule, tokens: Mapping[str, Sequence[str]]) -> None:
        """``tokens``: per scope, the tokens it accepts; a scope absent or empty is open."""
        self.app = app
        self.rule = rule
        self.tokens = {scope: [t.encode() for t in accepted] for scope, accepted in
                       tokens.items() if accepted}
        self.every = [t for accepted in self.tokens.values() for t in accepted]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        access = self.rule(scope["method"], scope["path"])
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        refusal = self._refusal(access, headers)
        if refusal is not None:
            await _reply(send, *refusal)
            return
        seen, started = 0, False

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > access.max_body:
                    raise _TooLarge
            return message

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded, watch)
        except _TooLarge:
            if not started:
                await _reply(send, 413, f"request body over {access.max_body} bytes")

    def _refusal(self, access: Access, headers: dict[str, str]
                 ) -> tuple[int, str, dict[str, str]] | None:
        accepted = self.tokens.get(access.scope or "")
        if access.scope is not None and (accepted or self.every):
            scheme, _, given = headers.get("authorization", "").partition(" ")
            token = given.strip().encode() if scheme.lower() == "bearer" else b""
            if not token or not any(hmac.compare_digest(token, t) for t in self.every):
                return 401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"}
            if not any(hmac.compare_digest(token, t) for t in accepted or ()):
                return 403, f"this token does not grant {access.scope} access", {}
        declared = headers.get("content-length", "")
        if declared and (not declared.isdigit() or len(declared) > 19):
            return 400, "invalid Content-Length", {}
        if declared and int(declared) > access.max_body:
            return 413, f"request body over {access.max_body} bytes", {}
        return None


async def _reply(send: Send, status: int, detail: str,
                 headers: Mapping[str, str] | None = None) -> None:
    body = json.dumps({"detail": detail}, ensure_ascii=False, separators=(",", ":")).encode()
    raw = [(b"content-type", b"application/json"),
           (b"content-length", str(len(body)).encode()),
           *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items())]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def document(doc: dict[str, Any], rule: Rule, errors: Callable[[str, str], set[int]],
             scopes: Mapping[str, str]) -> dict[str, Any]:
    """Declare in ``doc`` the bearer scheme where ``rule`` needs a token and, per operation,
    the error statuses ``errors(method, path)`` names plus the guard's own (401/403/413)."""
    components = doc.setdefault("components", {})
    components.setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    components.setdefault("securitySchemes", {}).update({
        name: {"type": "http", "scheme": "bearer", "description": text}
        for name, text in scopes.items()})
    for path, operations in doc.get("paths", {}).items():
        for method, op in operations.items():
            access = rule(method.upper(), path)
            codes = errors(method.upper(), path) | {413}
            if access.scope is not None:
                op["security"] = [{access.scope: []}]
                codes |= {401, 403} if access.scope == "write" else {401}
            responses = op.setdefault("responses", {})
            responses.pop("default", None)
            if path == "/metrics":
                responses["200"] = {"description": "Prometheus text format", "content": {
                    "text/plain": {"schema": {"type": "string"}}}}
            for code in sorted(codes):
                responses[str(code)] = {
                    "description": _REASONS.get(code, "Error"),
                    "content": {"application/json": {
                        "schema": {"$ref": "#/components/schemas/Error"}}}}
    return doc
