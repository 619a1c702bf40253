"""The operator API over sessions.

`GET /v1/sessions`, `GET /v1/sessions/{id}`, `DELETE /v1/sessions/{id}`: admins see
and close every session; other principals see their own, and close one only with its
resume token (`x-session-token` header).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from protocols.auth import principal_of
from protocols.http import json_response
from protocols.registry import Routes
from sessions import Session, SessionManager, SessionNotFound, StoreUnavailable


def add_routes(routes: Routes, manager: SessionManager) -> None:
    def visible(request: web.Request) -> Session:
        principal = principal_of(request)
        session_id = request.match_info["session_id"]
        s = manager.get(session_id)
        if not principal.admin and s.principal != principal.name:
            raise SessionNotFound(session_id)  # do not reveal others' sessions
        return s

    async def list_sessions(request: web.Request) -> web.Response:
        principal = principal_of(request)
        sessions = manager.sessions(None if principal.admin else principal.name)
        counts: dict[str, Any]
        try:
            counts = await manager.counts()
        except StoreUnavailable as exc:
            counts = {"error": exc.message}
        return json_response({"object": "list", "data": [s.info() for s in sessions], "cluster": counts, "node": manager.node_id})

    async def get_session(request: web.Request) -> web.Response:
        return json_response(visible(request).info())

    async def delete_session(request: web.Request) -> web.Response:
        principal = principal_of(request)
        s = visible(request)
        if principal.admin:
            await manager.close(s.id, reason="operator")
        else:
            await manager.close(s.id, token=request.headers.get("x-session-token"), require_token=True, reason="closed")
        return json_response({"id": s.id, "object": "session.deleted", "deleted": True})

    routes.add("GET", "/v1/sessions", list_sessions, "server")
    routes.add("GET", "/v1/sessions/{session_id}", get_session, "server")
    routes.add("DELETE", "/v1/sessions/{session_id}", delete_session, "server")
    routes.index.append(("GET", "/v1/sessions", "sessions (yours; all for admins)"))
