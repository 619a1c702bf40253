"""API keys → principals, for HTTP and WebSocket alike (one aiohttp middleware).

Accepted forms: `Authorization: Bearer <key>` (OpenAI SDKs) and `Authorization:
Api-Key <key>` (openpi-client). The key's principal is what per-principal session caps
count; `principal_of(request)` reads it. With no keys configured every caller is the
admin principal `anonymous`. Without a valid key every route except the open ones
(`/health`, `/healthz`, and a plain GET of the pages `/` and `/demo`) answers 401 in
the OpenAI error shape; a WebSocket handshake gets that 401 before any upgrade.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from aiohttp import web

from omni_rt.errors import ClientError
from protocols.http import error_response

ANONYMOUS = "anonymous"
OPEN_PATHS = frozenset({"/health", "/healthz"})
# Pages anyone may load with a plain GET (they hold no data; what they call needs a key).
OPEN_PAGES = frozenset({"/", "/demo"})



@dataclass(frozen=True)
class Principal:
    name: str
    admin: bool = False


PRINCIPAL = web.RequestKey("principal", Principal)


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


_UNAUTHORIZED = ClientError(
    "Incorrect or missing API key. Send 'Authorization: Bearer <key>' or 'Authorization: Api-Key <key>'.",
    code="invalid_api_key",
    http_status=401,
    headers={"www-authenticate": "Bearer"},
)


def _is_upgrade(request: web.Request) -> bool:
    return request.headers.get("upgrade", "").lower() == "websocket"


def auth_middleware(keys: KeyRing, open_paths: frozenset[str] = OPEN_PATHS) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Every request (WebSocket handshakes included: they are answered with a plain
    HTTP 401 before any upgrade) gets its principal or a 401 in the OpenAI shape."""

    @web.middleware
    async def auth(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        principal = keys.principal_for(request.headers.get("authorization"))
        page = request.method in ("GET", "HEAD") and request.path in OPEN_PAGES and not _is_upgrade(request)
        if principal is None and request.path not in open_paths and not page:
            return error_response(_UNAUTHORIZED)
        request[PRINCIPAL] = principal or Principal(ANONYMOUS)
        return await handler(request)

    return auth
