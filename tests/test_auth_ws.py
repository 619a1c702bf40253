"""Auth middleware on HTTP requests and WebSocket handshakes, the WebSocket
session-rejection helper, and the one mapping of errors to wire errors."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from omni_rt.specs import SessionsSpec
from protocols.auth import KeyRing, auth_middleware, principal_of
from protocols.errors import error_body, error_event
from protocols.http import error_middleware, json_response
from protocols.ws import accept, reject
from sessions import SessionLimit, SessionManager, StoreUnavailable

KEYS = KeyRing([("k-alice-000001", "alice", False), ("k-admin-000001", "ops", True)])


def app_with(keys: KeyRing, manager: SessionManager | None = None) -> web.Application:
    app = web.Application(middlewares=[error_middleware, auth_middleware(keys)])

    async def whoami(request: web.Request) -> web.Response:
        p = principal_of(request)
        return json_response({"principal": p.name, "admin": p.admin})

    async def health(request: web.Request) -> web.Response:
        return json_response({"ok": True})

    async def ws(request: web.Request) -> web.StreamResponse:
        assert manager is not None
        try:
            session = await manager.open("realtime", principal=principal_of(request).name)
        except (SessionLimit, StoreUnavailable) as exc:
            return await reject(request, exc)
        sock = await accept(request)
        await sock.send_json({"type": "session.created", "session": {"id": session.id}})
        await sock.receive()
        await manager.close(session.id)
        await sock.close()
        return sock.ws

    app.router.add_get("/whoami", whoami)
    app.router.add_get("/health", health)
    app.router.add_get("/ws", ws)
    return app


async def client_for(app: web.Application) -> TestClient:
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


async def test_http_principal_from_bearer_or_api_key():
    c = await client_for(app_with(KEYS))
    try:
        r = await c.get("/whoami", headers={"authorization": "Bearer k-alice-000001"})
        assert await r.json() == {"principal": "alice", "admin": False}
        r = await c.get("/whoami", headers={"authorization": "Api-Key k-admin-000001"})
        assert await r.json() == {"principal": "ops", "admin": True}
        r = await c.get("/whoami", headers={"authorization": "Bearer nope"})
        assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
        assert (await c.get("/health")).status == 200
    finally:
        await c.close()


async def test_without_keys_everyone_is_the_anonymous_admin():
    c = await client_for(app_with(KeyRing()))
    try:
        assert await (await c.get("/whoami")).json() == {"principal": "anonymous", "admin": True}
    finally:
        await c.close()


def test_duplicate_key_is_refused():
    with pytest.raises(ValueError, match="listed twice"):
        KeyRing([("same-key-0001", "a", False), ("same-key-0001", "b", False)])


async def test_websocket_without_key_is_refused_with_401_before_any_session():
    m = SessionManager(SessionsSpec(max_total=1))
    c = await client_for(app_with(KEYS, m))
    try:
        with pytest.raises(aiohttp.WSServerHandshakeError) as exc:
            await c.ws_connect("/ws", headers={"authorization": "Bearer wrong"})
        assert exc.value.status == 401
        # the same answer as a plain request: the OpenAI error body
        r = await c.get("/ws", headers={"authorization": "Bearer wrong", "upgrade": "websocket", "connection": "upgrade"})
        assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        assert m.stats["admitted"] == 0
    finally:
        await c.close()


async def test_websocket_over_cap_gets_an_error_event_then_close_1013():
    m = SessionManager(SessionsSpec(max_total=1))
    c = await client_for(app_with(KEYS, m))
    auth = {"authorization": "Bearer k-alice-000001"}
    try:
        first = await c.ws_connect("/ws", headers=auth)
        assert (await first.receive_json())["type"] == "session.created"
        second = await c.ws_connect("/ws", headers=auth)
        ev = await second.receive_json()
        assert ev["type"] == "error"
        assert ev["error"]["code"] == "session_limit" and "at most 1 sessions in total" in ev["error"]["message"]
        msg = await second.receive()
        assert msg.type is aiohttp.WSMsgType.CLOSE and msg.data == 1013 and msg.extra == "session_limit"
        await first.send_str("bye")
        assert (await first.receive()).type is aiohttp.WSMsgType.CLOSE
        # the first session closed and returned its slot: a new one is admitted
        third = await c.ws_connect("/ws", headers=auth)
        assert (await third.receive_json())["type"] == "session.created"
        await third.send_str("bye")
        await third.receive()
    finally:
        await c.close()


def test_every_error_maps_to_its_status_code_and_close_code():
    from omni_rt.errors import EngineDead, InternalError, StageError
    from sessions import (
        IllegalTransition,
        InvalidResumeToken,
        SessionElsewhere,
        SessionGone,
        SessionNotFound,
        StaleFence,
    )

    cases = [
        (SessionLimit("kind", "realtime", 3, 7), 429, "session_limit", {"retry-after": "7"}, 1013),
        (StoreUnavailable("Redis is gone"), 503, "session_store_unavailable", {"retry-after": "5"}, 1013),
        (SessionNotFound("s1"), 404, "session_not_found", {}, 1008),
        (SessionGone("s1", "idle_timeout"), 410, "session_gone", {}, 1008),
        (InvalidResumeToken("s1"), 403, "invalid_resume_token", {}, 1008),
        (SessionElsewhere("s1", "node-b", "http://b:8000"), 409, "session_elsewhere", {"location": "http://b:8000"}, 1008),
        (IllegalTransition("s1", "closed", "resume"), 409, "invalid_session_state", {}, 1008),
        (StaleFence("old epoch"), 409, "stale_fence", {}, 1008),
        (EngineDead("engine thinker is gone"), 503, "engine_unavailable", {"retry-after": "5"}, 1013),
        (StageError("bad observation"), 500, "generation_failed", {}, 1011),
    ]
    for exc, status, code, headers, close in cases:
        assert (exc.http_status, exc.code, exc.headers, exc.ws_close) == (status, code, headers, close), exc
        assert error_body(exc)["error"]["message"] == exc.message
        assert error_event(exc, "ev_1")["error"] == {**exc.wire(), "event_id": "ev_1"}
    # a fault of ours: the client hears a generic message, never the details
    hidden = InternalError("KeyError: 'secret' in frame 3")
    assert error_body(hidden)["error"] == {"message": "internal error", "type": "server_error", "param": None, "code": "internal_error"}


def test_core_errors_are_not_runtime_errors():
    """Adapters must never mistake an engine or stage failure for a client that left."""
    from omni_rt.errors import ConnectorError, EngineError, OmniError, OrchestratorError, RequestAborted, StageError
    from sessions import SessionError

    for cls in (EngineError, ConnectorError, OrchestratorError, StageError, RequestAborted, SessionError):
        assert issubclass(cls, OmniError) and not issubclass(cls, RuntimeError), cls
