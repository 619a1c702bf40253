"""`/v1/duplex`: full-duplex voice over one WebSocket, on the voice pipeline.

The control plane is the OpenAI Realtime GA protocol (`protocols.realtime`: the same
events, the same conversation, with this wire's transport plugged in:
`protocols.duplex.transport` and its writer), with these extensions:

- The server speaks first: `session.created` carries `session.capabilities`
  (`supports_barge_in`, `supports_session_resume`, `chunk_period_ms`, `input_formats`,
  `output_formats`, `heartbeat_s`, `replay_buffer_events`) and a `resume_token`.
- Audio flows both ways all the time. In: binary frames `[0x01][PCM16 LE mono]` or
  `input_audio_buffer.append` events, at the declared input rate
  (`session.audio.input.format.rate`, one of `RATES`; resampled to the model's 24 kHz
  with soxr). Out: `response.output_audio.delta` events, or binary frames `[0x01][PCM16]`
  when `session.audio.output.transport` is `"binary"`, at `session.audio.output.format.rate`.
  With `session.audio.output.pacing: "realtime"` the answer goes out as 20 ms frames in
  real time (PACING_LEAD_S ahead) with the other events in order between them; a
  barge-in drops what was not sent yet. `"none"` (default) sends audio as generated.
- Every server event carries `server_event_seq`, monotonic over the whole session
  (across reconnects), and every `response.*` event the `epoch` its response ran under.
  Barge-in and cancel advance the epoch; nothing of an older epoch is sent after that.
- `playback.ack {response_id, played_ms}`: what the user has heard. When the user
  talks over the agent, the answer in history is cut to the last acknowledged point
  (`conversation.item.truncated`), so the conversation holds only what was heard.
- Heartbeats: a `heartbeat` event every `heartbeat_s`; clients may send `heartbeat`.
- A dropped connection detaches the session; the answer in progress keeps running.
  Within `sessions.disconnect_grace_s` the client re-attaches with
  `session.resume {session_id, resume_token}` (its first event on a new socket, or the
  `session_id` and `resume_token` query parameters, which do not take a session slot)
  and gets `session.resumed`; the events produced while it was away are **replayed**
  from the session's bounded buffer (`sessions.replay_buffer_events`; the oldest are
  dropped first, and `session.resumed.dropped_events` says how many). A session past
  its grace answers `session.expired`. Each resume issues a new `resume_token`.
- `session.close` → `session.closed`, then the socket closes (1000). A fault in the
  server → an `error` event, then close 1011.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from media.audio_formats import Pcm16Resampler
from omni_rt.errors import WS_POLICY_VIOLATION, ClientError, OmniError
from protocols.auth import principal_of
from protocols.duplex.transport import RATES, DuplexTiming, DuplexTransport
from protocols.duplex.writer import write
from protocols.errors import error_event
from protocols.realtime import RATE, Conversation, vad_of
from protocols.realtime.state import config_of, conversation_state, items_of
from protocols.registry import Mount
from protocols.wire_json import load_json
from protocols.ws import DISCONNECTED, Socket, accept, close_attachment, fail_socket, reject
from sessions import Session, SessionError, SessionGone, SessionState

log = logging.getLogger("protocols.duplex")

MOVE_MARGIN_S = 0.5  # of a drain's time left, kept for writing the state and telling the client


class Duplex:
    """A duplex session's conversation and transport; they live in the session (they
    survive reconnects, and move with it to another node when this one drains) and
    stop with it."""

    def __init__(self, conv: Conversation, transport: DuplexTransport) -> None:
        self.conv = conv
        self.transport = transport
        self.moving = False  # handed off (a drain): input is no longer taken here

    async def export(self, left_s: float) -> dict[str, Any]:
        """The state that moves, at a clean point: the answer in progress has finished
        and what it said has gone out to an attached client (at the drain's deadline an
        answer still running is cancelled, as a barge-in would, and moves cut there)."""
        session, conv, t = self.conv.session, self.conv, self.transport
        deadline = time.monotonic() + max(0.0, left_s - MOVE_MARGIN_S)

        def busy() -> bool:
            attached = session.state == SessionState.ACTIVE
            return conv.responses.active is not None or (attached and bool(session.queued_events or t.outbox or t.sending_audio))

        while busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.moving = True
        if conv.responses.active is not None:
            await conv.responses.cancel("migrated")
        return {
            "conversation": conversation_state(conv),
            "transport": {"in_rate": t.in_rate, "out_rate": t.out_rate, "binary_out": t.binary_out, "paced": t.paced,
                          # + session.migrated, the last event this node sends
                          "out_seq": t.out_seq + 1},
        }

    @classmethod
    def restore(cls, session: Session, m: Mount, state: dict[str, Any]) -> Duplex:
        """A moved duplex session, as its exporter left it."""
        conv, tr = state["conversation"], state["transport"]
        cfg = config_of(conv["config"])
        session.data["items"] = items_of(conv["items"])
        if tr["in_rate"] not in RATES or tr["out_rate"] not in RATES:
            raise ValueError(f"audio rates {tr['in_rate']}/{tr['out_rate']} are not served here")
        self = cls.create(session, m, cfg.model)
        self.conv.cfg = cfg
        t = self.transport
        t.in_rate, t.out_rate, t.binary_out, t.paced, t.out_seq = int(tr["in_rate"]), int(tr["out_rate"]), bool(tr["binary_out"]), bool(tr["paced"]), int(tr["out_seq"])
        t._out = Pcm16Resampler(RATE, t.out_rate)
        return self

    @classmethod
    def create(cls, session: Session, m: Mount, model: str) -> Duplex:
        timing: DuplexTiming = m.options.get("duplex_timing", DuplexTiming())
        conv = Conversation(session, m.sessions, m.pipeline, ga=True, model=model, vad=vad_of(m))
        transport = DuplexTransport(conv.emit, m.sessions, timing)
        conv.transport = transport
        self = cls(conv, transport)
        session.data["duplex"] = self
        session.exporter = self.export

        async def stop() -> None:
            await conv.shutdown("session_ended")

        session.add_finalizer(stop)
        return self


def _refusal(exc: OmniError, session_id: str) -> dict[str, Any]:
    if isinstance(exc, SessionGone):
        return {"type": "session.expired", "session_id": session_id, "reason": exc.reason}
    return error_event(exc)


def mount(m: Mount) -> None:
    sessions, pipeline = m.sessions, m.pipeline

    def restore(session: Session, state: dict[str, Any]) -> None:
        Duplex.restore(session, m, state)

    sessions.restorers[("duplex", pipeline.name)] = restore

    async def resume(sid: Any, token: Any, principal: str) -> tuple[Session, Duplex]:
        if not isinstance(sid, str) or not sid:
            raise ClientError("Missing required parameter: 'session_id'.", code="missing_required_parameter", param="session_id")
        s = await sessions.resume(sid, token if isinstance(token, str) else None, principal)
        d = s.data.get("duplex")
        if not isinstance(d, Duplex):  # a session of another kind
            raise ClientError(f"Session {sid} is not a duplex session.", param="session_id")
        return s, d

    async def attach(sock: Socket, session: Session, d: Duplex, first: bool, principal: str) -> tuple[Session, Duplex] | None:
        """Serve one attachment. Returns the session to switch to when the client
        resumes another one as its first event; None when this connection is over."""
        gen = session.attachment
        loop = asyncio.get_running_loop()
        writer = loop.create_task(write(d.transport, sock, session, sessions))
        ended = asyncio.ensure_future(session.closed.wait())
        interval = d.transport.timing.heartbeat_s

        async def heartbeat() -> None:
            while True:
                await asyncio.sleep(interval)
                if session.attached_as(gen):
                    session.emit("heartbeat", {"interval_s": interval})

        beat = loop.create_task(heartbeat())
        switch: tuple[Session, Duplex] | None = None
        left = True  # however this attachment ends (the client left, a fault, a cancel)...
        try:
            while (data := await sock.receive(writer, ended)) is not None:
                if d.moving:
                    continue  # handed off: the client hears session.migrated next
                if isinstance(data, bytes) and data[:1] != b"{":
                    try:
                        session.touch()
                        await d.transport.audio_frame(d.conv, data)
                    except ClientError as err:
                        d.conv.error(err)
                    continue
                if first:
                    first = False
                    try:
                        ev = load_json(data)
                    except ClientError:
                        ev = None  # the conversation reads it again and says why it is not an event
                    if isinstance(ev, dict) and ev.get("type") == "session.resume":
                        try:
                            switch = await resume(ev.get("session_id"), ev.get("resume_token"), principal)
                            break
                        except ClientError as err:
                            d.conv.error(err)
                        except SessionError as exc:
                            refusal = _refusal(exc, str(ev.get("session_id")))
                            session.emit(refusal.pop("type"), refusal)
                        first = True  # a refused resume may be retried
                        continue
                await d.conv.handle(data)
        except Exception:
            left = False  # a fault: the caller ends the session
            raise
        finally:
            beat.cancel()
            ended.cancel()
            if session.state == SessionState.CLOSED and not writer.done():
                # the session's last event (closed, expired, migrated) goes out first
                await asyncio.wait({writer}, timeout=1.0)
            writer.cancel()
            await asyncio.gather(writer, beat, return_exceptions=True)
            if left and switch is None and session.attached_as(gen):
                await sessions.detach(session.id)  # ...it stays resumable for disconnect_grace_s
        return switch

    async def duplex(request: web.Request) -> web.StreamResponse:
        principal = principal_of(request).name
        model = request.query.get("model") or pipeline.models[0]
        session: Session | None = None
        sock: Socket | None = None
        try:
            if request.query.get("session_id"):
                sock = await accept(request)
                sid = request.query["session_id"]
                try:
                    session, d = await resume(sid, request.query.get("resume_token"), principal)
                except (SessionError, ClientError) as exc:
                    await sock.send_json(_refusal(exc, sid))
                    await sock.close(WS_POLICY_VIOLATION, "resume refused")
                    return sock.ws
                resumed = True
            else:
                try:
                    session = await sessions.open("duplex", pipeline.name, principal=principal)
                except SessionError as exc:
                    return await reject(request, exc)
                d = Duplex.create(session, m, model)
                sock = await accept(request)
                d.conv.emit("session.created", session=d.transport.session_wire(d.conv), resume_token=await sessions.issue_resume_token(session))
                resumed = False
            first = not resumed
            while True:
                if resumed:
                    dropped = session.dropped_events - session.data.get("dropped_seen", 0)
                    session.data["dropped_seen"] = session.dropped_events
                    await sock.send(
                        d.transport.direct(
                            "session.resumed",
                            session=d.transport.session_wire(d.conv),
                            resume_token=await sessions.issue_resume_token(session),
                            replayed_events=session.queued_events,
                            dropped_events=dropped,
                        )
                    )
                nxt = await attach(sock, session, d, first, principal)
                if nxt is None:
                    break
                # the client resumed an older session: the fresh one is not needed
                fresh = session
                session, d = nxt
                await sessions.end(fresh, "replaced_by_resume")
                resumed, first = True, False
        except DISCONNECTED:
            if session is not None and session.state == SessionState.ACTIVE:
                await sessions.detach(session.id)
        except Exception as exc:  # noqa: BLE001 - a fault: tell the client, end the session, close 1011
            return await fail_socket(sock, sessions, session, exc, f"duplex session {session.id if session else '-'}")
        assert sock is not None and session is not None
        await close_attachment(sock, session, "ended")  # a detached session has no close reason: 1000
        return sock.ws

    m.websocket("/v1/duplex", duplex, "full-duplex voice with resume")
