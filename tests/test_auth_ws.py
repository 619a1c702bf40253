"""Auth middleware on HTTP and WebSocket scopes, and the WebSocket session-rejection helper."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request, WebSocket
from starlette.testclient import TestClient, WebSocketDenialResponse
from starlette.websockets import WebSocketDisconnect

from protocols.auth import AuthMiddleware, KeyRing
from protocols.sessions_api import principal_of, reject_websocket
from sessions import SessionLimit, SessionManager, StoreUnavailable
from omni_rt.specs import SessionsSpec


def app_with(keys: KeyRing, manager: SessionManager | None = None) -> FastAPI:
    app = FastAPI()
    app.add_middleware(AuthMiddleware, keys=keys)

    @app.get("/whoami")
    async def whoami(request: Request) -> dict:
        p = principal_of(request)
        return {"principal": p.name, "admin": p.admin}

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    @app.websocket("/ws")
    async def ws(websocket: WebSocket) -> None:
        assert manager is not None
        try:
            session = await manager.open("realtime", principal=principal_of(websocket).name)
        except (SessionLimit, StoreUnavailable) as exc:
            await reject_websocket(websocket, exc)
            return
        await websocket.accept()
        await websocket.send_json({"type": "session.created", "session": {"id": session.id}})
        await websocket.receive_text()
        await manager.close(session.id)

    return app


KEYS = KeyRing([("k-alice-000001", "alice", False), ("k-admin-000001", "ops", True)])


def test_http_principal_from_bearer_or_api_key():
    c = TestClient(app_with(KEYS))
    assert c.get("/whoami", headers={"authorization": "Bearer k-alice-000001"}).json() == {"principal": "alice", "admin": False}
    assert c.get("/whoami", headers={"authorization": "Api-Key k-admin-000001"}).json() == {"principal": "ops", "admin": True}
    r = c.get("/whoami", headers={"authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert c.get("/health").status_code == 200


def test_without_keys_everyone_is_the_anonymous_admin():
    c = TestClient(app_with(KeyRing()))
    assert c.get("/whoami").json() == {"principal": "anonymous", "admin": True}


def test_duplicate_key_is_refused():
    with pytest.raises(ValueError, match="listed twice"):
        KeyRing([("same-key-0001", "a", False), ("same-key-0001", "b", False)])


def test_websocket_without_key_is_refused_before_any_session():
    m = SessionManager(SessionsSpec(max_total=1))
    c = TestClient(app_with(KEYS, m))
    # servers with the handshake-response extension answer a plain HTTP 401
    with pytest.raises(WebSocketDenialResponse) as exc:
        with c.websocket_connect("/ws", headers={"authorization": "Bearer wrong"}):
            pass
    assert exc.value.status_code == 401 and exc.value.json()["error"]["code"] == "invalid_api_key"
    assert m.stats["admitted"] == 0


async def test_websocket_without_handshake_extension_is_closed_1008():
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "websocket.connect"}

    async def send(msg: dict) -> None:
        sent.append(msg)

    async def app(scope, receive, send):  # pragma: no cover - must not be reached
        raise AssertionError("unauthenticated socket reached the app")

    scope = {"type": "websocket", "path": "/ws", "headers": [], "extensions": {}}
    await AuthMiddleware(app, KEYS)(scope, receive, send)
    assert sent == [{"type": "websocket.close", "code": 1008, "reason": "invalid API key"}]


def test_websocket_over_cap_gets_an_error_event_then_close_1013():
    m = SessionManager(SessionsSpec(max_total=1))
    c = TestClient(app_with(KEYS, m))
    auth = {"authorization": "Bearer k-alice-000001"}
    with c.websocket_connect("/ws", headers=auth) as first:
        assert first.receive_json()["type"] == "session.created"
        with c.websocket_connect("/ws", headers=auth) as second:
            ev = second.receive_json()
            assert ev["type"] == "error"
            assert ev["error"]["code"] == "session_limit" and "at most 1 sessions in total" in ev["error"]["message"]
            with pytest.raises(WebSocketDisconnect) as exc:
                second.receive_json()
            assert exc.value.code == 1013
        first.send_text("bye")
    # the first session closed and returned its slot: a new one is admitted
    with c.websocket_connect("/ws", headers=auth) as third:
        assert third.receive_json()["type"] == "session.created"
        third.send_text("bye")


def test_session_errors_map_to_http_statuses_and_codes():
    from protocols.openai_http import session_api_error
    from sessions import (
        IllegalTransition,
        InvalidResumeToken,
        SessionElsewhere,
        SessionGone,
        SessionNotFound,
        StaleFence,
    )

    cases = [
        (SessionLimit("kind", "realtime", 3, 7), 429, "session_limit", {"retry-after": "7"}),
        (StoreUnavailable("Redis is gone"), 503, "session_store_unavailable", {"retry-after": "5"}),
        (SessionNotFound("s1"), 404, "session_not_found", {}),
        (SessionGone("s1", "idle_timeout"), 410, "session_gone", {}),
        (InvalidResumeToken("s1"), 403, "invalid_resume_token", {}),
        (SessionElsewhere("s1", "node-b", "http://b:8000"), 409, "session_elsewhere", {"location": "http://b:8000"}),
        (IllegalTransition("s1", "closed", "resume"), 409, "invalid_session_state", {}),
        (StaleFence("old epoch"), 409, "stale_fence", {}),
    ]
    for exc, status, code, headers in cases:
        err = session_api_error(exc)
        assert (err.status, err.code, err.headers) == (status, code, headers), exc
        assert err.message == exc.message
