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

The socket's lifecycle (open or resume, attach, heartbeat, detach, fault) is the one
every resumable wire shares (`protocols.resumable`); this module says what is the
voice conversation's own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

from aiohttp import web

from media.wire_audio import G711_RATE, WireFormat
from protocols.duplex.transport import RATES, DuplexTiming, DuplexTransport
from protocols.duplex.writer import write
from protocols.realtime import Conversation, vad_of
from protocols.realtime.state import config_of, conversation_state, items_of
from protocols.registry import Mount
from protocols.resumable import ResumableWire
from protocols.ws import Socket
from sessions import Session, SessionState

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
        self.dropped_seen = 0  # the session's dropped events already told to a resumed client

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
            "transport": {"in_rate": t.in_rate, "out_rate": t.out_rate, "in_encoding": t.in_fmt.encoding, "out_encoding": t.out_fmt.encoding,
                          "binary_out": t.binary_out, "paced": t.paced,
                          # + session.migrated, the last event this node sends
                          "out_seq": t.out_seq + 1},
        }

    @classmethod
    def restore(cls, session: Session, m: Mount, state: dict[str, Any]) -> Duplex:
        """A moved duplex session, as its exporter left it."""
        conv, tr = state["conversation"], state["transport"]
        cfg = config_of(conv["config"])
        items = items_of(conv["items"])
        formats = []
        for side in ("in", "out"):
            enc, rate = tr.get(f"{side}_encoding", "pcm16"), tr[f"{side}_rate"]
            if not ((enc == "pcm16" and rate in RATES) or (enc in ("pcmu", "pcma") and rate == G711_RATE)):
                raise ValueError(f"audio format {enc}/{rate} is not served here")
            formats.append(WireFormat(enc, int(rate)))
        self = cls.create(session, m, cfg.model)
        self.conv.items.update(items)
        self.conv.cfg = replace(cfg, input_format=formats[0], output_format=formats[1])
        t = self.transport
        t.set_formats(formats[0], formats[1])
        t.binary_out, t.paced, t.out_seq = bool(tr["binary_out"]), bool(tr["paced"]), int(tr["out_seq"])
        return self

    @classmethod
    def create(cls, session: Session, m: Mount, model: str) -> Duplex:
        timing: DuplexTiming = m.options.get("duplex_timing", DuplexTiming())
        conv = Conversation(session, m.sessions, m.pipeline, ga=True, model=model, vad=vad_of(m))
        transport = DuplexTransport(conv.emit, m.sessions, timing)
        conv.transport = transport
        self = cls(conv, transport)
        session.keep(self)
        session.exporter = self.export

        async def stop() -> None:
            await conv.shutdown("session_ended")

        session.add_finalizer(stop)
        return self


def mount(m: Mount) -> None:
    sessions, pipeline = m.sessions, m.pipeline
    vad_of(m)  # the end-of-turn model loads now, at start-up, not at the first session's open

    def restore(session: Session, state: dict[str, Any]) -> None:
        Duplex.restore(session, m, state)

    sessions.restorers[("duplex", pipeline.name)] = restore

    async def open_session(principal: str, model: str) -> tuple[Session, Duplex]:
        session = await sessions.open("duplex", pipeline.name, principal=principal)
        try:
            return session, Duplex.create(session, m, model)
        except BaseException:
            await sessions.end(session, "server_error")  # (the socket was never accepted: the HTTP error says why)
            raise

    async def handle(session: Session, d: Duplex, data: str | bytes) -> None:
        if isinstance(data, bytes) and data[:1] != b"{":
            session.touch()
            await d.transport.audio_frame(d.conv, data)
        else:
            await d.conv.handle(data)

    async def created(session: Session, d: Duplex) -> None:
        d.conv.emit("session.created", session=d.transport.session_wire(d.conv), resume_token=await sessions.issue_resume_token(session))

    async def resumed(sock: Socket, session: Session, d: Duplex) -> None:
        dropped = session.dropped_events - d.dropped_seen
        d.dropped_seen = session.dropped_events
        await sock.send(d.transport.direct(
            "session.resumed", session=d.transport.session_wire(d.conv), resume_token=await sessions.issue_resume_token(session),
            replayed_events=session.queued_events, dropped_events=dropped,
        ))

    wire: ResumableWire[Duplex] = ResumableWire(
        sessions, "duplex", "/v1/duplex", open=open_session, state_of=lambda s: s.kept(Duplex), handle=handle,
        error=lambda _s, d, err: d.conv.error(err),
        writer=lambda sock, session, d: write(d.transport, sock, session, sessions),
        created=created, resumed=resumed, heartbeat_s=lambda d: d.transport.timing.heartbeat_s, paused=lambda d: d.moving,
    )

    async def duplex(request: web.Request) -> web.StreamResponse:
        return await wire.serve(request, request.query.get("model") or pipeline.models[0])

    m.websocket("/v1/duplex", duplex, "full-duplex voice with resume")
