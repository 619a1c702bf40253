"""API keys → principals, for HTTP and WebSocket alike (one ASGI middleware).

Accepted forms: `Authorization: Bearer <key>` (OpenAI SDKs) and `Authorization:
Api-Key <key>` (openpi-client). The key's principal is what per-principal session caps
count; it lands in `scope["state"]["principal"]` (`request.state.principal`). With no
keys configured every caller is the admin principal `anonymous`. Without a valid key
every route except the open ones (`/health`, `/healthz`, and a plain GET of the pages `/` and `/demo`) answers 401 in the OpenAI
error shape; a WebSocket handshake is refused with 401 where the server supports
handshake responses, else closed with 1008 (policy violation).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable

ANONYMOUS = "anonymous"
OPEN_PATHS = frozenset({"/health", "/healthz"})
# Pages anyone may load with a plain GET (they hold no data; what they call needs a key).
OPEN_PAGES = frozenset({"/", "/demo"})

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


@dataclass(frozen=True)
class Principal:
    name: str
    admin: bool = False


def principal_of(conn: Any) -> Principal:
    """The caller of a request or WebSocket (set by AuthMiddleware; without it, the
    anonymous admin)."""
    return getattr(conn.state, "principal", None) or Principal(ANONYMOUS, admin=True)


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


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v.decode("latin-1")
    return None


_UNAUTHORIZED = json.dumps(
    {
        "error": {
            "message": "Incorrect or missing API key. Send 'Authorization: Bearer <key>' or 'Authorization: Api-Key <key>'.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
).encode()


class AuthMiddleware:
    def __init__(self, app: ASGIApp, keys: KeyRing, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        principal = self.keys.principal_for(_header(scope, b"authorization"))
        path = scope.get("path")
        page = scope["type"] == "http" and scope.get("method") in ("GET", "HEAD") and path in OPEN_PAGES
        if principal is None and path not in self.open_paths and not page:
            if scope["type"] == "http":
                await _send_401(send, "http.response")
            elif "websocket.http.response" in scope.get("extensions", {}):
                await receive()  # websocket.connect
                await _send_401(send, "websocket.http.response")
            else:
                await receive()
                await send({"type": "websocket.close", "code": 1008, "reason": "invalid API key"})
            return
        scope.setdefault("state", {})["principal"] = principal or Principal(ANONYMOUS)
        await self.app(scope, receive, send)


async def _send_401(send: Callable[[Any], Awaitable[None]], prefix: str) -> None:
    await send(
        {
            "type": f"{prefix}.start",
            "status": 401,
            "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
        }
    )
    await send({"type": f"{prefix}.body", "body": _UNAUTHORIZED})
