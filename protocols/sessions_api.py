"""Session errors on the wire, the WebSocket rejection helper, and the operator API.

- `api_error(exc)`: a SessionError as an HTTP error in the OpenAI shape (429 with
  `retry-after` and code `session_limit` for a full cap, 503 when the store is lost…).
- `reject_websocket(ws, exc, frame)`: the WebSocket form: the protocol's own error
  frame, then close 1013 (try again later) for capacity, 1008 otherwise. Adapters
  pass a function that renders the error in their protocol's shape.
- `GET /v1/sessions`, `GET /v1/sessions/{id}`, `DELETE /v1/sessions/{id}`: admins
  see and close every session; other principals see their own, and close one only
  with its resume token (`x-session-token` header).
"""

from __future__ import annotations

from typing import Any, Callable

from fastapi import APIRouter, Request
from starlette.websockets import WebSocket, WebSocketState

from protocols.auth import principal_of
from protocols.openai_http import session_api_error as api_error
from sessions import SessionError, SessionLimit, SessionManager, SessionNotFound, StoreUnavailable

# WebSocket close codes (RFC 6455): 1013 try again later, 1008 policy violation.
WS_TRY_AGAIN_LATER = 1013
WS_POLICY_VIOLATION = 1008


def ws_close_code(exc: SessionError) -> int:
    return WS_TRY_AGAIN_LATER if isinstance(exc, (SessionLimit, StoreUnavailable)) else WS_POLICY_VIOLATION


def realtime_error_event(exc: SessionError) -> dict[str, Any]:
    """The OpenAI-Realtime error event shape (used by /v1/realtime and /v1/duplex)."""
    err = api_error(exc)
    return {"type": "error", "error": {"type": err.type, "code": err.code, "message": err.message, "param": None}}


async def reject_websocket(
    ws: WebSocket,
    exc: SessionError,
    frame: Callable[[SessionError], dict[str, Any] | str | bytes] = realtime_error_event,
) -> None:
    """Tell a WebSocket client why its session was refused, then close it."""
    if ws.application_state == WebSocketState.CONNECTING:
        await ws.accept()
    msg = frame(exc)
    try:
        if isinstance(msg, dict):
            await ws.send_json(msg)
        elif isinstance(msg, bytes):
            await ws.send_bytes(msg)
        else:
            await ws.send_text(msg)
        await ws.close(code=ws_close_code(exc), reason=exc.code)
    except (RuntimeError, ConnectionError):
        pass  # the client is already gone


def build_sessions_router(manager: SessionManager) -> APIRouter:
    router = APIRouter()

    def visible(request: Request, session_id: str) -> Any:
        principal = principal_of(request)
        try:
            s = manager.get(session_id)
        except SessionError as exc:
            raise api_error(exc) from None
        if not principal.admin and s.principal != principal.name:
            raise api_error(SessionNotFound(session_id))  # do not reveal others' sessions
        return s

    @router.get("/v1/sessions")
    async def list_sessions(request: Request) -> dict[str, Any]:
        principal = principal_of(request)
        sessions = manager.sessions(None if principal.admin else principal.name)
        try:
            counts = await manager.counts()
        except StoreUnavailable as exc:
            counts = {"error": exc.message}
        return {"object": "list", "data": [s.info() for s in sessions], "cluster": counts, "node": manager.node_id}

    @router.get("/v1/sessions/{session_id}")
    async def get_session(request: Request, session_id: str) -> dict[str, Any]:
        return visible(request, session_id).info()

    @router.delete("/v1/sessions/{session_id}")
    async def delete_session(request: Request, session_id: str) -> dict[str, Any]:
        principal = principal_of(request)
        s = visible(request, session_id)
        token = request.headers.get("x-session-token")
        try:
            if principal.admin:
                await manager.close(s.id, reason="operator")
            else:
                await manager.close(s.id, token=token, require_token=True, reason="closed")
        except SessionError as exc:
            raise api_error(exc) from None
        return {"id": s.id, "object": "session.deleted", "deleted": True}

    return router


__all__ = [
    "api_error",
    "build_sessions_router",
    "principal_of",
    "realtime_error_event",
    "reject_websocket",
    "ws_close_code",
]
