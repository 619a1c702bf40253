"""One socket lifecycle for the resumable WebSocket wires (both `/v1/duplex` flavours:
the voice pipeline's conversation and a full-duplex model's).

A wire says what is its own in a `ResumableWire` (how a session opens, what state it
keeps, how one message is handled, how its events are written, what `session.created`
and `session.resumed` carry); `serve` runs the rest, the same for every such wire:

- `?session_id=&resume_token=` on the URL re-attaches a session (refused: the wire's
  refusal event, then close 1008); otherwise a session opens (refused by admission:
  the HTTP error before the upgrade) and `session.created` goes out.
- `session.resume` as the first JSON event of a fresh connection re-attaches that
  session instead and ends the fresh one (`replaced_by_resume`); a refused resume may
  be retried.
- While attached: a writer task sends the session's events, a heartbeat event goes out
  every `heartbeat_s`, each message goes to the wire's `handle` (a `ClientError` is
  told to the client in the wire's error shape and the session goes on).
- The client leaving detaches the session (resumable for the manager's
  `disconnect_grace_s`); a fault tells the client, ends the session and closes 1011;
  an ended session closes with its reason (`close_attachment`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from aiohttp import web

from omni_rt.errors import WS_POLICY_VIOLATION, ClientError, OmniError
from protocols.auth import principal_of
from protocols.errors import error_event
from protocols.wire_json import load_json
from protocols.ws import DISCONNECTED, Socket, accept, close_attachment, fail_socket, reject
from sessions import Session, SessionError, SessionGone, SessionManager

__all__ = ["ResumableWire", "refusal"]

C = TypeVar("C")  # the wire's per-session state


def refusal(exc: OmniError, session_id: str) -> dict[str, Any]:
    """What a refused resume is told: `session.expired` for a session that is gone,
    else the error event."""
    if isinstance(exc, SessionGone):
        return {"type": "session.expired", "session_id": session_id, "reason": exc.reason}
    return error_event(exc)


def _is_audio(data: str | bytes) -> bool:
    return isinstance(data, bytes) and data[:1] != b"{"


@dataclass
class ResumableWire(Generic[C]):
    sessions: SessionManager
    what: str  # the sessions' name in errors and logs ("duplex", "full-duplex model")
    path: str  # for the plain-HTTP error
    # open a session for `principal` and `model` (SessionError: refused by admission)
    open: Callable[[str, str], Awaitable[tuple[Session, C]]]
    # the wire's state of a resumed session; None: the session is of another wire
    state_of: Callable[[Session], C | None]
    # one message from the client (ClientError: told to the client, the session goes on)
    handle: Callable[[Session, C, str | bytes], Awaitable[None]]
    # tell the client about its bad message, in the wire's error shape
    error: Callable[[Session, C, ClientError], object]
    # the task that writes the session's events to the socket
    writer: Callable[[Socket, Session, C], Coroutine[Any, Any, Any]]
    created: Callable[[Session, C], Awaitable[None]]  # emit session.created
    resumed: Callable[[Socket, Session, C], Awaitable[None]]  # send session.resumed
    heartbeat_s: Callable[[C], float]
    # messages are not handled while this holds (the session is being handed off)
    paused: Callable[[C], bool] = lambda _c: False

    async def resume(self, sid: Any, token: Any, principal: str) -> tuple[Session, C]:
        if not isinstance(sid, str) or not sid:
            raise ClientError("Missing required parameter: 'session_id'.", code="missing_required_parameter", param="session_id")
        s = await self.sessions.resume(sid, token if isinstance(token, str) else None, principal)
        state = self.state_of(s)
        if state is None:
            raise ClientError(f"Session {sid} is not a {self.what} session.", param="session_id")
        return s, state

    async def _attach(self, sock: Socket, session: Session, state: C, first: bool, principal: str) -> tuple[Session, C] | None:
        """Serve one attachment. Returns the session to switch to when the client
        resumes another one as its first event; None when this connection is over."""
        gen = session.attachment
        loop = asyncio.get_running_loop()
        writer = loop.create_task(self.writer(sock, session, state))
        ended = asyncio.ensure_future(session.closed.wait())
        interval = self.heartbeat_s(state)

        async def heartbeat() -> None:
            while True:
                await asyncio.sleep(interval)
                if session.attached_as(gen):
                    session.emit("heartbeat", {"interval_s": interval})

        beat = loop.create_task(heartbeat())
        switch: tuple[Session, C] | None = None
        left = True  # however this attachment ends (the client left, a fault, a cancel)...
        try:
            while (data := await sock.receive(writer, ended)) is not None:
                if self.paused(state):
                    continue  # handed off: the client hears session.migrated next
                if first and not _is_audio(data):
                    first = False
                    try:
                        ev = load_json(data)
                    except ClientError:
                        ev = None  # the wire reads it again and says why it is not an event
                    if isinstance(ev, dict) and ev.get("type") == "session.resume":
                        try:
                            switch = await self.resume(ev.get("session_id"), ev.get("resume_token"), principal)
                            break
                        except ClientError as err:
                            self.error(session, state, err)
                        except SessionError as exc:
                            told = refusal(exc, str(ev.get("session_id")))
                            session.emit(told.pop("type"), told)
                        first = True  # a refused resume may be retried
                        continue
                try:
                    await self.handle(session, state, data)
                except ClientError as err:
                    self.error(session, state, err)
        except Exception:
            left = False  # a fault: the caller ends the session
            raise
        finally:
            beat.cancel()
            ended.cancel()
            if not session.is_open and not writer.done():
                # the session's last event (closed, expired, migrated) goes out first
                await asyncio.wait({writer}, timeout=1.0)
            writer.cancel()
            await asyncio.gather(writer, beat, return_exceptions=True)
            if left and switch is None and session.attached_as(gen):
                await self.sessions.detach(session.id)  # ...it stays resumable for disconnect_grace_s
        return switch

    async def serve(self, request: web.Request, model: str) -> web.StreamResponse:
        """The WebSocket handler's body (see the module docstring)."""
        if request.headers.get("upgrade", "").lower() != "websocket":
            raise ClientError(f"{self.path} is a WebSocket: connect with 'Upgrade: websocket'.", code="websocket_required")
        principal = principal_of(request).name
        session: Session | None = None
        sock: Socket | None = None
        try:
            if request.query.get("session_id"):
                sock = await accept(request)
                sid = request.query["session_id"]
                try:
                    session, state = await self.resume(sid, request.query.get("resume_token"), principal)
                except (SessionError, ClientError) as exc:
                    await sock.send_json(refusal(exc, sid))
                    await sock.close(WS_POLICY_VIOLATION, "resume refused")
                    return sock.ws
                resumed = True
            else:
                try:
                    session, state = await self.open(principal, model)
                except SessionError as exc:
                    return await reject(request, exc)
                sock = await accept(request)
                await self.created(session, state)
                resumed = False
            first = not resumed
            while True:
                if resumed:
                    await self.resumed(sock, session, state)
                nxt = await self._attach(sock, session, state, first, principal)
                if nxt is None:
                    break
                # the client resumed an older session: the fresh one is not needed
                fresh = session
                session, state = nxt
                await self.sessions.end(fresh, "replaced_by_resume")
                resumed, first = True, False
        except DISCONNECTED:
            if session is not None and session.is_open and session.attached_as(session.attachment):
                await self.sessions.detach(session.id)
        except Exception as exc:  # noqa: BLE001 - a fault: tell the client, end the session, close 1011
            return await fail_socket(sock, self.sessions, session, exc, f"{self.what} session {session.id if session else '-'}")
        assert sock is not None and session is not None
        await close_attachment(sock, session, "ended")  # a detached session has no close reason: 1000
        return sock.ws
