"""The operator API over sessions.

`GET /v1/sessions`, `GET /v1/sessions/{id}`, `DELETE /v1/sessions/{id}`: admins see
and close every session; other principals see their own, and close one only with its
resume token (`x-session-token` header). `POST /admin/drain {timeout_s?}` (admins):
the node stops admitting and moves its sessions to other nodes (`omni-rt drain`).
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from omni_rt.errors import ClientError
from protocols.auth import principal_of
from protocols.http import json_response, read_json
from protocols.registry import Routes
from sessions import Session, SessionManager, SessionNotFound, StoreUnavailable

log = logging.getLogger("protocols.sessions_api")


def add_routes(routes: Routes, manager: SessionManager, drain_timeout_s: float = 30.0) -> None:
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

    async def drain(request: web.Request) -> web.Response:
        """Admins: stop admitting and move every session off this node (to the session
        store; clients resume on any node). Answers when done, with what moved."""
        if not principal_of(request).admin:
            raise ClientError("Draining a node is for admin keys only.", code="forbidden", http_status=403)
        timeout = drain_timeout_s
        if request.can_read_body:
            body = await read_json(request)
            if not isinstance(body, dict) or set(body) - {"timeout_s"}:
                raise ClientError("The body is {\"timeout_s\": seconds} or empty.", param="timeout_s")
            raw = body.get("timeout_s", timeout)
            if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not 0 <= raw <= 3600:
                raise ClientError("'timeout_s' must be a number of seconds between 0 and 3600.", param="timeout_s")
            timeout = float(raw)
        if manager.store.name == "memory":
            log.warning("draining with the memory store: moved sessions can only resume on this process")
        return json_response({"object": "drain.report", **await manager.drain(timeout)})

    routes.add("GET", "/v1/sessions", list_sessions, "server")
    routes.add("POST", "/admin/drain", drain, "server")
    routes.add("GET", "/v1/sessions/{session_id}", get_session, "server")
    routes.add("DELETE", "/v1/sessions/{session_id}", delete_session, "server")
    routes.index.append(("GET", "/v1/sessions", "sessions (yours; all for admins)"))
