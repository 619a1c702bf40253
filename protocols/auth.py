"""API keys → principals, for HTTP and WebSocket alike (one aiohttp middleware).

Accepted forms: `Authorization: Bearer <key>` (OpenAI SDKs) and `Authorization:
Api-Key <key>` (openpi-client). The key's principal is what per-principal session caps
count; `principal_of(request)` reads it. With no keys configured every caller is the
admin principal `anonymous`. Without a valid key every route except the open ones
(`/health`, `/healthz`, and a plain GET of the pages — `/`, `/demo`, `/demo/world`,
`/demo/video`, `/dashboard` — and of `/static/…`) answers 401 in
the OpenAI error shape; a WebSocket handshake gets that 401 before any upgrade.

Client secrets (`POST /v1/realtime/client_secrets`, OpenAI's browser flow) are
short-lived keys `ek_…` that stand for the principal that asked for them, for one
Realtime call (`/v1/realtime`, `/v1/realtime/calls`, `/offer`) until they expire; the
call starts with the session configuration the secret was made with.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from omni_rt.errors import ClientError
from protocols.http import error_response

ANONYMOUS = "anonymous"
# /v1/telephony/twilio and /telnyx: the carriers send no headers of ours (Twilio strips
# query strings too); the call authenticates in its stream's start message
# (protocols.telephony.twilio)
OPEN_PATHS = frozenset({"/health", "/healthz", "/livez", "/readyz", "/v1/telephony/twilio", "/v1/telephony/telnyx"})
# Pages anyone may load with a plain GET (they hold no data; what they call needs a key).
OPEN_PAGES = frozenset({"/", "/demo", "/demo/world", "/demo/video", "/dashboard"})
OPEN_PREFIX = "/static/"


@dataclass(frozen=True)
class Principal:
    name: str
    admin: bool = False


PRINCIPAL = web.RequestKey("principal", Principal)


@dataclass
class ClientSecret:
    principal: Principal
    expires_at: float  # unix time
    session: Mapping[str, Any] | None  # the session.update body the call starts with
    model: str | None = None
    used: bool = False


class ClientSecrets:
    """The live client secrets (kept as digests, like API keys)."""

    PREFIX = "ek_"
    SCOPE = frozenset({"/v1/realtime", "/v1/realtime/calls", "/offer"})
    MAX_LIVE = 10_000

    def __init__(self, now: Callable[[], float] = time.time) -> None:
        self.now = now
        self._live: dict[bytes, ClientSecret] = {}

    def issue(self, principal: Principal, ttl_s: float, session: Mapping[str, Any] | None, model: str | None = None) -> tuple[str, int]:
        """A new secret for `principal`: (its value, when it expires, unix seconds)."""
        now = self.now()
        self._live = {d: s for d, s in self._live.items() if s.expires_at > now and not s.used}
        if len(self._live) >= self.MAX_LIVE:
            raise ClientError("Too many client secrets are live; use or let some expire first.", code="rate_limit_exceeded", http_status=429)
        value = self.PREFIX + secrets.token_urlsafe(24)
        expires_at = int(now + ttl_s)
        self._live[_digest(value)] = ClientSecret(principal, expires_at, session, model)
        return value, expires_at

    def redeem(self, value: str, path: str) -> ClientSecret:
        """The secret `value` spent on one call to `path` (a ClientError when it cannot be)."""
        secret = self._live.get(_digest(value))
        if secret is None or secret.used:
            raise _unauthorized("This client secret is unknown or was used already; ask for a new one.")
        if secret.expires_at <= self.now():
            del self._live[_digest(value)]
            raise _unauthorized("This client secret has expired; ask for a new one.")
        if path not in self.SCOPE:
            raise _unauthorized("A client secret is only good for one Realtime call (/v1/realtime or /v1/realtime/calls).")
        secret.used = True
        return secret


CLIENT_SECRET = web.RequestKey("client_secret", ClientSecret)
CLIENT_SECRETS = web.AppKey("client_secrets", ClientSecrets)


def client_secret_of(request: web.Request) -> ClientSecret | None:
    """The client secret this request was authorised with, if any."""
    return request.get(CLIENT_SECRET)


def principal_of(request: web.Request) -> Principal:
    """The caller of a request or WebSocket handshake (set by the auth middleware;
    without it, the anonymous admin)."""
    return request.get(PRINCIPAL) or Principal(ANONYMOUS, admin=True)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """Keys are kept only as SHA-256 digests; lookup is by digest."""

    def __init__(self, entries: Iterable[tuple[str, str, bool]] = ()) -> None:
        self._keys: dict[bytes, Principal] = {}
        for key, principal, admin in entries:
            d = _digest(key)
            if d in self._keys:
                raise ValueError(f"API key for principal {principal!r} is listed twice")
            self._keys[d] = Principal(principal, admin)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def principal_for(self, authorization: str | None) -> Principal | None:
        if not self.enabled:
            return Principal(ANONYMOUS, admin=True)
        if not authorization:
            return None
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() not in ("bearer", "api-key") or not key.strip():
            return None
        return self._keys.get(_digest(key.strip()))


KEYS = web.AppKey("keys", KeyRing)  # the server's API keys (wires that authenticate in-band read them)


def _unauthorized(message: str) -> ClientError:
    return ClientError(message, code="invalid_api_key", http_status=401, headers={"www-authenticate": "Bearer"})


_UNAUTHORIZED = _unauthorized("Incorrect or missing API key. Send 'Authorization: Bearer <key>' or 'Authorization: Api-Key <key>'.")


def _bearer(authorization: str | None) -> str | None:
    scheme, _, key = (authorization or "").strip().partition(" ")
    return key.strip() if scheme.lower() == "bearer" else None


BROWSER_KEY_PROTOCOL = "openai-insecure-api-key."


def authorization_of(request: web.Request) -> str | None:
    """The request's credentials: its Authorization header, or for a browser's
    WebSocket (which cannot set headers) the key in its subprotocols, as OpenAI's
    browser clients send it: `Sec-WebSocket-Protocol: realtime, openai-insecure-api-key.<key>`."""
    header = request.headers.get("authorization")
    if header or not _is_upgrade(request):
        return header
    for proto in request.headers.get("sec-websocket-protocol", "").split(","):
        proto = proto.strip()
        if proto.startswith(BROWSER_KEY_PROTOCOL):
            return "Bearer " + proto[len(BROWSER_KEY_PROTOCOL) :]
    return None


def _is_upgrade(request: web.Request) -> bool:
    return request.headers.get("upgrade", "").lower() == "websocket"


def auth_middleware(
    keys: KeyRing, client_secrets: ClientSecrets | None = None, open_paths: frozenset[str] = OPEN_PATHS
) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Every request (WebSocket handshakes included: they are answered with a plain
    HTTP 401 before any upgrade) gets its principal or a 401 in the OpenAI shape."""

    @web.middleware
    async def auth(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        authorization = authorization_of(request)
        bearer = _bearer(authorization)
        if client_secrets is not None and bearer is not None and bearer.startswith(ClientSecrets.PREFIX):
            try:
                secret = client_secrets.redeem(bearer, request.path)
            except ClientError as err:
                if keys.enabled:
                    return error_response(err)
            else:
                request[PRINCIPAL] = secret.principal
                request[CLIENT_SECRET] = secret
                return await handler(request)
        principal = keys.principal_for(authorization)
        page = (request.method in ("GET", "HEAD") and (request.path in OPEN_PAGES or request.path.startswith(OPEN_PREFIX))
                and not _is_upgrade(request))
        if principal is None and request.path not in open_paths and not page:
            return error_response(_UNAUTHORIZED)
        request[PRINCIPAL] = principal or Principal(ANONYMOUS)
        return await handler(request)

    return auth
