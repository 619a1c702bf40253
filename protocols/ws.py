"""The WebSocket transport kit every socket adapter is built on (aiohttp's server).

- `accept(request)`: the handshake, with the server's frame limit and heartbeats.
- `Socket`: send text / bytes / JSON, read the next message (or learn that the client
  left, or that something else the adapter waits on finished first), close tolerantly.
- `DISCONNECTED`: the transport's own disconnect errors. Adapters catch these, and
  only these, as "the client left"; everything else is a fault (see `protocols.errors`).
- `write_events(socket, session, frame)`: a session's event stream onto the socket,
  with the last fence check before the wire; `numbered_json` renders events as JSON
  with a per-connection `event_id`.
- `reject(request, exc, frame)`: refuse a session on a socket in the protocol's own
  error shape, then close with the error's close code (1013 for capacity).
- `serve_events(...)`: the whole life of a JSON event socket (writer, reader, the
  fault path) for the wires built the same way (realtime, world, live video).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import WSMsgType, web

from omni_rt import metrics
from omni_rt.errors import WS_INTERNAL_ERROR, WS_NORMAL, WS_POLICY_VIOLATION, WS_SERVICE_RESTART, OmniError
from protocols.errors import close_reason, error_event, to_omni
from sessions import END_EVENTS, RESTART_REASONS, Session, SessionEvent, SessionManager

# Frames up to this size reach the protocols, which answer oversized ones in their own
# error shape (a realtime append over 15 MiB of audio, an OpenPI observation over 64
# MiB); the transport closes bigger ones with 1009.
MAX_FRAME_BYTES = 128 * 1024 * 1024
# Transport keepalive: a ping this often; a client that does not answer within half of
# it is gone.
HEARTBEAT_S = 20.0

# A send on a socket whose peer is gone raises aiohttp's ClientConnectionResetError
# (a ConnectionResetError); a peer that vanished mid-write, an OSError of the family.
DISCONNECTED: tuple[type[BaseException], ...] = (ConnectionError,)


class Socket:
    """One accepted WebSocket."""

    def __init__(self, ws: web.WebSocketResponse, request: web.Request) -> None:
        self.ws = ws
        self.request = request
        self.client_close_code: int | None = None  # the code of the client's close frame, if it sent one

    @property
    def closed_normally(self) -> bool:
        """The client ended the connection on purpose (a close frame with 1000), as
        opposed to dropping it (no close frame, 1001 going away, an error code)."""
        return self.client_close_code == WS_NORMAL

    @property
    def closed(self) -> bool:
        return self.ws.closed

    async def send(self, data: str | bytes) -> None:
        if isinstance(data, bytes):
            await self.ws.send_bytes(data)
        else:
            await self.ws.send_str(data)

    async def send_json(self, obj: Mapping[str, Any]) -> None:
        await self.ws.send_str(json.dumps(obj))

    async def receive(self, *others: asyncio.Future[Any]) -> str | bytes | None:
        """The next text or binary message; None when the client left or one of
        `others` (e.g. the event writer) finished first."""
        if not others:
            return self._data(await self.ws.receive())
        receive = asyncio.ensure_future(self.ws.receive())
        done, _ = await asyncio.wait({receive, *others}, return_when=asyncio.FIRST_COMPLETED)
        if receive not in done:
            receive.cancel()
            await asyncio.gather(receive, return_exceptions=True)
            return None
        return self._data(receive.result())

    async def receive_by(self, deadline: float) -> str | bytes | None:
        """The next message before the loop's clock reaches `deadline` (a handshake's
        first messages): None when the client left; asyncio.TimeoutError past it."""
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(self.receive(), max(0.01, deadline - loop.time()))
        except DISCONNECTED:
            return None

    def _data(self, msg: Any) -> str | bytes | None:
        if msg.type is WSMsgType.CLOSE:
            self.client_close_code = self.ws.close_code
        return _data(msg)

    async def close(self, code: int = WS_NORMAL, reason: str = "") -> None:
        """Close with `code` unless the socket is already closed (the client left)."""
        if not self.ws.closed:
            try:
                await self.ws.close(code=code, message=reason.encode()[:123])
            except DISCONNECTED:
                pass


def _data(msg: Any) -> str | bytes | None:
    if msg.type is WSMsgType.TEXT:
        return str(msg.data)
    if msg.type is WSMsgType.BINARY:
        return bytes(msg.data)
    return None  # CLOSE, CLOSING, CLOSED, ERROR: the client is gone


# The kernel's send buffer of a WebSocket: what a client has not read yet waits here, so
# a bound keeps a client that stops reading from hiding seconds of audio in the kernel
# (autotuned, it grows to megabytes): its sends wait soon, and it is told it is slow.
SEND_BUFFER_BYTES = 64 * 1024


def _bound_send_buffer(request: web.Request) -> None:
    import socket

    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        except OSError:
            pass


async def accept(request: web.Request, *, max_frame: int = MAX_FRAME_BYTES, heartbeat: float | None = HEARTBEAT_S) -> Socket:
    # "realtime": the subprotocol OpenAI's browser clients offer (with their key, see protocols.auth).
    # No permessage-deflate: what these sockets carry is mostly audio, which deflate barely
    # shrinks, and compressing and inflating every 20 ms frame runs on the event loop
    # that paces them (measured holding it 50-75 ms on a busy 2-core machine).
    ws = web.WebSocketResponse(max_msg_size=max_frame, heartbeat=heartbeat, protocols=("realtime",), compress=False)
    await ws.prepare(request)
    _bound_send_buffer(request)
    return Socket(ws, request)


async def reject(
    request: web.Request,
    exc: OmniError,
    frame: Callable[[OmniError], Mapping[str, Any] | str | bytes] = error_event,
) -> web.WebSocketResponse:
    """Tell a WebSocket client why its session was refused (in its protocol's shape),
    then close with the error's close code."""
    sock = await accept(request, heartbeat=None)
    msg = frame(exc)
    try:
        if isinstance(msg, Mapping):
            await sock.send_json(msg)
        else:
            await sock.send(msg)
    except DISCONNECTED:
        pass
    await sock.close(exc.ws_close, close_reason(exc))
    return sock.ws


async def write_events(sock: Socket, session: Session, frame: Callable[[SessionEvent], str | bytes | None]) -> None:
    """Write the session's events to the socket until this attachment ends. The last
    fence check before the wire: nothing of a cancelled turn goes out. `frame` renders
    an event (text or binary; None skips it)."""
    async for ev in session.events():
        if ev.fence is not None and ev.fence.is_stale_against(session.fence):
            metrics.DROPPED_STALE.labels(hop="adapter").inc()
            continue
        out = frame(ev)
        if out is not None:
            await sock.send(out)
        if ev.type in END_EVENTS:
            break


def numbered_json(render: Callable[[Mapping[str, Any]], Mapping[str, Any]] = lambda data: data) -> Callable[[SessionEvent], str]:
    """A `write_events` frame function: each event as JSON with a per-connection
    `event_id` (`event_000001`, …) and its data rendered by `render`."""
    count = 0

    def frame(ev: SessionEvent) -> str:
        nonlocal count
        count += 1
        return json.dumps({"type": ev.type, "event_id": f"event_{count:06d}", **render(ev.data)})

    return frame


WRITER_DRAIN_S = 0.5  # how long the writer may take to send what the end of an attachment produced


async def serve_events(
    sock: Socket,
    session: Session,
    frame: Callable[[SessionEvent], str | bytes | None],
    on_message: Callable[[str | bytes], Awaitable[bool]],
    on_exit: Callable[[str], Awaitable[None]],
) -> str:
    """Run one attachment of a JSON event socket: the session's events go out as they
    come, client messages go to `on_message` (False: the client asked to close).
    `on_exit(why)` runs before the writer stops, so what it says (`session.closed`)
    still goes out. Returns why it stopped: "client_left", "client_closed",
    "session_ended" (the server ended the session, or the writer stopped), or
    "server_error" (a fault of ours: the client got an `error` event; the caller
    closes with 1011)."""
    writer = asyncio.get_running_loop().create_task(write_events(sock, session, frame))
    ended = asyncio.ensure_future(session.closed.wait())
    why = "client_left"
    try:
        while (data := await sock.receive(writer, ended)) is not None:
            if data and not await on_message(data):
                why = "client_closed"
                break
        else:
            if writer.done() or ended.done():
                why = "session_ended"
    except DISCONNECTED:
        why = "client_left"
    except Exception as exc:  # noqa: BLE001 - a fault of ours: tell the client
        err = to_omni(exc, f"{session.kind} session {session.id}")
        why = "server_error"
        try:
            await sock.send_json(error_event(err))
        except DISCONNECTED:
            pass
    finally:
        ended.cancel()
        try:
            await on_exit(why)
        finally:
            await asyncio.wait({writer}, timeout=WRITER_DRAIN_S)
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
    return why


async def close_attachment(sock: Socket, session: Session, why: str) -> None:
    """Close a JSON event socket after `serve_events`: 1011 after a fault of ours,
    1008 when the session was ended for not reading its events (`slow_consumer`),
    1012 when it moved to another node or ended for a restart (a drain), else 1000 with the session's close reason."""
    if why == "server_error":
        await sock.close(WS_INTERNAL_ERROR, "internal error")
    elif session.close_reason == "slow_consumer":
        await sock.close(WS_POLICY_VIOLATION, "slow_consumer")
    elif session.close_reason in RESTART_REASONS:  # moved to another node, or ended for a restart
        await sock.close(WS_SERVICE_RESTART, session.close_reason)
    else:
        await sock.close(WS_NORMAL, session.close_reason or "")


async def fail_socket(sock: Socket | None, sessions: SessionManager, session: Session | None, exc: Exception, what: str) -> web.WebSocketResponse:
    """A fault in a session socket's handler: tell the client (an `error` event), end
    the session (it is not left resumable), close 1011. Before the socket was accepted
    the fault is raised on (the HTTP error handling answers it)."""
    err = to_omni(exc, what)
    if sock is not None:
        try:
            await sock.send_json(error_event(err))
        except DISCONNECTED:
            pass
    if session is not None:
        await sessions.end(session, "server_error")
    if sock is None:
        raise exc
    await sock.close(WS_INTERNAL_ERROR, "internal error")
    return sock.ws
