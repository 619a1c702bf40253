"""`/v1/duplex`: full-duplex voice over one WebSocket, on the voice pipeline.

The control plane is the OpenAI Realtime GA protocol (`protocols.realtime`: the same
events, the same conversation logic), with these extensions:

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
import json
import logging
import time
from collections import deque
from typing import Any, Mapping

import numpy as np
import soxr
from aiohttp import web

from omni_rt import metrics
from omni_rt.errors import WS_INTERNAL_ERROR, WS_POLICY_VIOLATION, ClientError, OmniError
from omni_rt.specs import PipelineSpec
from protocols.audio_formats import Pcm16Resampler
from protocols.auth import principal_of
from protocols.errors import error_event, to_omni
from protocols.realtime import (
    RATE,
    RealtimeConnection,
    TurnDetection,
    apply_session_update,
    wire_data,
)
from protocols.registry import Mount
from protocols.ws import DISCONNECTED, Socket, accept, reject
from sessions import Session, SessionError, SessionEvent, SessionGone, SessionManager, SessionState

log = logging.getLogger("protocols.duplex")

AUDIO_FRAME = 0x01
RATES = (8000, 16000, 24000, 44100, 48000)
CHUNK_PERIOD_MS = 20  # the input frame period the server is tuned for (any length is accepted)
MAX_FRAME_BYTES = 1 << 20
HEARTBEAT_S = 5.0
PACING_LEAD_S = 0.1  # paced audio is sent this far ahead of real time (network jitter)
SEND_TIMEOUT_S = 10.0  # a paced send blocked this long: the client is not reading


class DuplexConnection(RealtimeConnection):
    tag_epochs = True

    def __init__(self, session: Session, sessions: SessionManager, pipeline: PipelineSpec, model: str) -> None:
        super().__init__(session, sessions, pipeline, True, model)
        self.in_rate = RATE
        self.out_rate = RATE
        self.binary_out = False
        self.paced = False  # session.audio.output.pacing: "realtime" sends audio as 20 ms frames in real time
        self._in_rs: soxr.ResampleStream | None = None
        self._out = Pcm16Resampler(RATE, self.out_rate)
        self.out_seq = 0  # server_event_seq: monotonic across attachments
        self.played: dict[str, Any] = {}  # response id -> its item (for playback acks)

    # ---- session shape -----------------------------------------------------------------
    def capabilities(self) -> dict[str, Any]:
        return {
            "supports_barge_in": True,
            "supports_session_resume": True,
            "chunk_period_ms": CHUNK_PERIOD_MS,
            "input_formats": [{"type": "audio/pcm", "rates": list(RATES), "binary_frame_type": AUDIO_FRAME}],
            "output_formats": [{"type": "audio/pcm", "rates": list(RATES)}],
            "output_transports": ["json", "binary"],
            "output_pacing": ["none", "realtime"],
            "heartbeat_s": HEARTBEAT_S,
            "replay_buffer_events": self.sessions.spec.replay_buffer_events,
            "disconnect_grace_s": self.sessions.spec.disconnect_grace_s,
        }

    def session_wire(self) -> dict[str, Any]:
        s = self.cfg.wire(True, self.session.id)
        s["audio"]["input"]["format"] = {"type": "audio/pcm", "rate": self.in_rate}
        s["audio"]["output"]["format"] = {"type": "audio/pcm", "rate": self.out_rate}
        s["audio"]["output"]["transport"] = "binary" if self.binary_out else "json"
        s["audio"]["output"]["pacing"] = "realtime" if self.paced else "none"
        s["capabilities"] = self.capabilities()
        return s

    def _update(self, body: Any) -> None:
        """The duplex keys of a session.update (rates, output transport); the rest goes
        through the realtime rules."""
        if not isinstance(body, Mapping):
            raise ClientError("'session' must be an object.", code="invalid_type", param="session")
        body = json.loads(json.dumps(body))  # a copy we may strip
        audio = body.get("audio")
        in_rate, out_rate, binary, paced = self.in_rate, self.out_rate, self.binary_out, self.paced
        if isinstance(audio, dict):
            for side in ("input", "output"):
                part = audio.get(side)
                if not isinstance(part, dict) or "format" not in part:
                    continue
                fmt = part.pop("format")
                param = f"session.audio.{side}.format"
                if not isinstance(fmt, Mapping) or fmt.get("type", "audio/pcm") != "audio/pcm":
                    raise ClientError(f"'{param}' must be {{type: audio/pcm, rate: N}}.", code="invalid_value", param=param)
                rate = fmt.get("rate", RATE)
                if not isinstance(rate, int) or isinstance(rate, bool) or rate not in RATES:
                    raise ClientError(f"Unsupported sample rate {rate!r}; use one of {', '.join(map(str, RATES))}.", code="invalid_value", param=f"{param}.rate")
                if side == "input":
                    in_rate = rate
                else:
                    out_rate = rate
            out = audio.get("output")
            if isinstance(out, dict) and "transport" in out:
                t = out.pop("transport")
                if t not in ("json", "binary"):
                    raise ClientError("'session.audio.output.transport' must be 'json' or 'binary'.", code="invalid_value", param="session.audio.output.transport")
                binary = t == "binary"
            if isinstance(out, dict) and "pacing" in out:
                pacing = out.pop("pacing")
                if pacing not in ("none", "realtime"):
                    raise ClientError("'session.audio.output.pacing' must be 'none' or 'realtime'.", code="invalid_value", param="session.audio.output.pacing")
                paced = pacing == "realtime"
        for key in ("input_audio_format", "output_audio_format"):
            if key in body:
                raise ClientError(f"'session.{key}' is the beta shape; use session.audio.*.format.", code="invalid_value", param=f"session.{key}")
        cfg = apply_session_update(self.cfg, body, self.pipeline.voices)
        self.cfg, self.binary_out, self.paced = cfg, binary, paced
        if in_rate != self.in_rate:
            self.in_rate, self._in_rs = in_rate, None
        if out_rate != self.out_rate:
            self.out_rate, self._out = out_rate, Pcm16Resampler(RATE, out_rate)

    # ---- audio ---------------------------------------------------------------------------
    async def audio_frame(self, frame: bytes) -> None:
        if len(frame) < 2 or frame[0] != AUDIO_FRAME:
            kind = f"0x{frame[0]:02x}" if frame else "empty"
            raise ClientError(f"Binary frames are [0x01][PCM16 audio]; got a {kind} frame of {len(frame)} bytes.", code="invalid_frame")
        if len(frame) - 1 > MAX_FRAME_BYTES:
            raise ClientError(f"An audio frame may carry at most {MAX_FRAME_BYTES} bytes.", code="invalid_frame")
        if (len(frame) - 1) % 2:
            raise ClientError("Audio frames carry 16-bit PCM: an even number of bytes after the type byte.", code="invalid_frame")
        await self.append_input(np.frombuffer(frame, "<i2", offset=1).astype(np.float32) / 32768.0)

    async def append_input(self, pcm: np.ndarray) -> None:
        """Audio at the declared input rate."""
        if self.in_rate != RATE:
            if self._in_rs is None:
                self._in_rs = soxr.ResampleStream(self.in_rate, RATE, 1, dtype="float32")
            pcm = self._in_rs.resample_chunk(pcm)
        await self.append_pcm(pcm)

    def out_audio(self, response_id: str, pcm16: bytes) -> bytes:
        return self._out.convert(response_id, pcm16)

    # ---- playback ------------------------------------------------------------------------
    def ack(self, ev: Mapping[str, Any]) -> None:
        rid, played = ev.get("response_id"), ev.get("played_ms")
        if not isinstance(played, int) or isinstance(played, bool) or played < 0:
            raise ClientError("'played_ms' must be a non-negative integer.", code="invalid_value", param="played_ms")
        item = self.played.get(rid) if isinstance(rid, str) else None
        if item is None:
            raise ClientError(f"No response {rid!r} with audio on this session.", code="response_not_found", param="response_id")
        item.heard_ms = max(item.heard_ms or 0, min(played, item.audio_ms))

    async def speech_started(self, at_ms: int, td: TurnDetection) -> None:
        await super().speech_started(at_ms, td)
        if td.interrupt_response:
            # the user talks over what is still playing: keep only what was heard
            for item in list(self.played.values()):
                heard = item.heard_ms
                if heard is not None and heard < item.audio_ms and item.id in self.items:
                    self.item_truncate({"item_id": item.id, "content_index": 0, "audio_end_ms": heard})
                    item.audio_ms = heard

    async def create_response(self, ev: Mapping[str, Any], event_id: str | None) -> None:
        await super().create_response(ev, event_id)
        if self.response is not None and self.response.audio_out:
            self.played[self.response.id] = self.response.item
            while len(self.played) > 16:
                self.played.pop(next(iter(self.played)))

    # ---- events --------------------------------------------------------------------------
    async def dispatch(self, t: str, ev: dict[str, Any], event_id: str | None) -> None:
        if t == "session.update":
            if "session" not in ev:
                raise ClientError("Missing required parameter: 'session'.", code="missing_required_parameter", param="session")
            self._update(ev["session"])
            self.emit("session.updated", session=self.session_wire())
        elif t == "playback.ack":
            self.ack(ev)
        elif t == "heartbeat":
            pass  # handle() already counted it as activity
        elif t == "session.close":
            await self.sessions.end(self.session, "client_closed")
        elif t == "session.resume":
            raise ClientError("session.resume must be the first event on a new connection.", code="invalid_value", param="type")
        else:
            await super().dispatch(t, ev, event_id)

    def frame(self, ev: SessionEvent) -> str | bytes:
        if ev.type == "response.output_audio.delta":
            return self.render(ev.type, {**ev.data, "delta": self.out_audio(ev.data["response_id"], ev.data["delta"])})
        return self.render(ev.type, ev.data)

    def render(self, type: str, data: Mapping[str, Any]) -> str | bytes:
        """One event on the wire (audio already at the output rate)."""
        self.out_seq += 1
        if type == "response.output_audio.delta" and self.binary_out:
            return bytes([AUDIO_FRAME]) + data["delta"]
        return json.dumps({"type": type, "event_id": f"event_{self.out_seq:06d}", "server_event_seq": self.out_seq, **wire_data(data)})

    async def write(self, sock: Socket) -> None:
        """This attachment's writer: events as they come, or with pacing "realtime",
        audio cut into 20 ms frames sent in real time (PACING_LEAD_S ahead), the other
        events in order between them. Unsent events go back to the session when the
        attachment ends (replayed on resume); a barge-in drops the unsent old audio."""
        session = self.session
        pending: deque[SessionEvent] = deque()
        wake, room = asyncio.Event(), asyncio.Event()
        over = False

        async def pull() -> None:
            nonlocal over
            async for ev in session.events():
                pending.append(ev)
                wake.set()
                # Unpaced, take one event at a time: a client that does not read then
                # backs up the session's own queue (its slow-consumer bound). Paced,
                # events wait here for their time.
                while pending and not self.paced:
                    room.clear()
                    await room.wait()
            over = True
            wake.set()

        async def send(out: str | bytes) -> None:
            sending = sock.send(out)
            if not self.paced:
                await sending
                return
            try:
                await asyncio.wait_for(sending, SEND_TIMEOUT_S)
            except asyncio.TimeoutError:
                log.warning("duplex session %s: the client has not read for %.0f s; ending it", session.id, SEND_TIMEOUT_S)
                asyncio.get_running_loop().create_task(self.sessions.end(session, "slow_consumer"))
                raise

        puller = asyncio.get_running_loop().create_task(pull())
        clock, ahead = 0.0, 0.0  # the stream clock and the audio seconds sent on it
        try:
            while True:
                if not pending:
                    if over:
                        return
                    wake.clear()
                    await wake.wait()
                    continue
                ev = pending[0]
                if ev.fence is not None and ev.fence.is_stale_against(session.fence):
                    metrics.DROPPED_STALE.labels(hop="adapter").inc()
                    pending.popleft()
                    room.set()
                    continue
                if ev.type != "response.output_audio.delta" or not self.paced:
                    await send(self.frame(ev))
                    pending.popleft()
                    room.set()
                    if ev.type in ("session.expired", "session.closed") and ev.data.get("session_id") == session.id:
                        return  # this session's end (not a refused resume of another)
                    continue
                pcm = self.out_audio(ev.data["response_id"], ev.data["delta"])
                pending.popleft()
                room.set()
                step = self.out_rate * 2 // 50  # 20 ms
                for i in range(0, len(pcm), step):
                    now = time.monotonic()
                    if now > clock + ahead:  # idle or behind: the stream clock starts again
                        clock, ahead = now, 0.0
                    due = clock + ahead - PACING_LEAD_S
                    if due > now:
                        await asyncio.sleep(due - now)
                    if ev.fence is not None and ev.fence.is_stale_against(session.fence):
                        break  # barge-in / cancel: the rest of this answer is dropped
                    part = pcm[i : i + step]
                    await send(self.render(ev.type, {**ev.data, "delta": part}))
                    ahead += len(part) / 2 / self.out_rate
        finally:
            puller.cancel()
            await asyncio.gather(puller, return_exceptions=True)
            session.requeue(pending)

    def direct(self, type: str, **data: Any) -> str:
        """An event sent on this socket only (not queued for replay)."""
        self.out_seq += 1
        return json.dumps({"type": type, "event_id": f"event_{self.out_seq:06d}", "server_event_seq": self.out_seq, **data})


def _refusal(exc: OmniError, session_id: str) -> dict[str, Any]:
    if isinstance(exc, SessionGone):
        return {"type": "session.expired", "session_id": session_id, "reason": exc.reason}
    return error_event(exc)


def mount(m: Mount) -> None:
    sessions, pipeline = m.sessions, m.pipeline

    async def resume(sid: Any, token: Any, principal: str) -> tuple[Session, DuplexConnection]:
        if not isinstance(sid, str) or not sid:
            raise ClientError("Missing required parameter: 'session_id'.", code="missing_required_parameter", param="session_id")
        s = await sessions.resume(sid, token if isinstance(token, str) else None, principal)
        conn = s.data.get("duplex")
        if not isinstance(conn, DuplexConnection):  # a session of another kind
            raise ClientError(f"Session {sid} is not a duplex session.", code="invalid_value", param="session_id")
        return s, conn

    async def attach(sock: Socket, session: Session, conn: DuplexConnection, first: bool, principal: str) -> tuple[Session, DuplexConnection] | None:
        """Serve one attachment. Returns the session to switch to when the client
        resumes another one as its first event; None when this connection is over."""
        gen = session.attachment
        loop = asyncio.get_running_loop()
        writer = loop.create_task(conn.write(sock))
        ended = asyncio.ensure_future(session.closed.wait())

        async def heartbeat() -> None:
            while True:
                await asyncio.sleep(HEARTBEAT_S)
                if session.attached_as(gen):
                    session.emit("heartbeat", {"interval_s": HEARTBEAT_S})

        beat = loop.create_task(heartbeat())
        switch: tuple[Session, DuplexConnection] | None = None
        try:
            while (data := await sock.receive(writer, ended)) is not None:
                if isinstance(data, bytes) and data[:1] != b"{":
                    try:
                        session.touch()
                        await conn.audio_frame(data)
                    except ClientError as err:
                        conn.error(err)
                    continue
                if first:
                    first = False
                    try:
                        ev = json.loads(data)
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        ev = None
                    if isinstance(ev, dict) and ev.get("type") == "session.resume":
                        try:
                            switch = await resume(ev.get("session_id"), ev.get("resume_token"), principal)
                            break
                        except ClientError as err:
                            conn.error(err)
                        except SessionError as exc:
                            refusal = _refusal(exc, str(ev.get("session_id")))
                            session.emit(refusal.pop("type"), refusal)
                        first = True  # a refused resume may be retried
                        continue
                await conn.handle(data)
        finally:
            beat.cancel()
            ended.cancel()
            writer.cancel()
            await asyncio.gather(writer, beat, return_exceptions=True)
        if switch is not None:
            return switch
        if session.attached_as(gen):
            await sessions.detach(session.id)  # resumable for disconnect_grace_s
        return None

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
                    session, conn = await resume(sid, request.query.get("resume_token"), principal)
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
                conn = DuplexConnection(session, sessions, pipeline, model)
                _own(session, conn)
                sock = await accept(request)
                conn.emit("session.created", session=conn.session_wire(), resume_token=session.issue_resume_token())
                resumed = False
            first = not resumed
            while True:
                if resumed:
                    dropped = session.dropped_events - session.data.get("dropped_seen", 0)
                    session.data["dropped_seen"] = session.dropped_events
                    await sock.send(
                        conn.direct(
                            "session.resumed",
                            session=conn.session_wire(),
                            resume_token=session.issue_resume_token(),
                            replayed_events=len(session._events),
                            dropped_events=dropped,
                        )
                    )
                nxt = await attach(sock, session, conn, first, principal)
                if nxt is None:
                    break
                # the client resumed an older session: the fresh one is not needed
                fresh = session
                session, conn = nxt
                await sessions.end(fresh, "replaced_by_resume")
                resumed, first = True, False
        except DISCONNECTED:
            if session is not None and session.state == SessionState.ACTIVE:
                await sessions.detach(session.id)
        except Exception as exc:  # noqa: BLE001 - a fault: tell the client, end the session, close 1011
            err = to_omni(exc, f"duplex session {session.id if session else '-'}")
            if sock is not None:
                try:
                    await sock.send_json(error_event(err))
                except DISCONNECTED:
                    pass
            if session is not None:
                await sessions.end(session, "server_error")
            if sock is not None:
                await sock.close(WS_INTERNAL_ERROR, "internal error")
                return sock.ws
            raise
        assert sock is not None
        if session is not None and session.state == SessionState.CLOSED:
            reason = session.close_reason or ""
            await sock.close(WS_POLICY_VIOLATION if reason == "slow_consumer" else 1000, reason)
        else:
            await sock.close()
        return sock.ws

    m.websocket("/v1/duplex", duplex, "full-duplex voice with resume")


def _own(session: Session, conn: DuplexConnection) -> None:
    """The connection's state lives in the session (it survives reconnects) and stops
    with it."""
    session.data["duplex"] = conn

    async def stop() -> None:
        await conn.shutdown("session_ended")

    session.add_finalizer(stop)
