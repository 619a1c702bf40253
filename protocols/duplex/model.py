"""`/v1/duplex?model=moshi`: a full-duplex speech model over one WebSocket.

There are no turns and no responses: audio flows both ways all the time and the model
decides every 80 ms frame whether to speak. The wire keeps the duplex transport's
shapes (`protocols.duplex.transport`): binary frames `[0x01][PCM16 LE mono]` (or
`input_audio_buffer.append {audio: base64}`) in at the declared input rate, resampled
to the model's 24 kHz with soxr; the model's voice out as binary frames `[0x01][PCM16]`
(one per 80 ms frame, `session.audio.output.transport: "binary"`, the default here) or
`response.output_audio.delta {frame, delta: base64}` events ("json"), at the declared
output rate. Every JSON server event carries `server_event_seq`.

Server events: `session.created {session, resume_token}` first (`session.capabilities`:
`full_duplex`, `frame_ms`, input/output formats and rates, `heartbeat_s`,
`max_input_ahead_s`, `supports_session_resume`, `disconnect_grace_s`);
`duplex.text.delta {frame, delta}` — the model's text stream (its inner monologue, one
piece a frame when it says a word; padding frames send nothing); `duplex.frame.late
{frame}` when the step that made a frame overran its 80 ms (the server fell behind
real time); `heartbeat`;
`session.updated`; `error`; `session.closed`.

Client events: `session.update {session: {audio: {input: {format: {type: audio/pcm,
rate}}, output: {format: {...}, transport}}}}`, `input_audio_buffer.append`,
`heartbeat`, `session.close`, and `session.resume {session_id, resume_token}` as the
first event on a new socket (or the `session_id` / `resume_token` query parameters).

The model's clock runs from the moment the session opens: a user that stops sending is
heard as silence (the lease's idle TTL still applies to the session), and audio that
arrives faster than real time waits up to `max_input_ahead_s`; a frame beyond that is
refused with an `error` (`input_too_fast`) and not played in. A dropped connection
detaches the session: the model keeps listening (to silence) and its output waits in
the replay buffer (`sessions.replay_buffer_events`, oldest dropped first) for a resume
within `sessions.disconnect_grace_s`.

Admission: the stage admits a conversation only while the batched step for one more
still fits the frame budget (`pipelines.moshi`); otherwise `capacity`: an `error` event
and close 1013, with the seconds to wait in its message.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import secrets
import time
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from aiohttp import web

from media.audio_formats import pcm16_bytes
from media.wire_audio import InputDecoder, OutputEncoder, WireFormat, WireFormatError
from omni_rt.errors import CapacityExceeded, ClientError, InternalError, OmniError, RequestAborted
from omni_rt.payloads import Payload, PayloadKind
from protocols.duplex.transport import AUDIO_FRAME, INPUT_FORMATS, MAX_FRAME_BYTES, OUTPUT_FORMATS, RATES
from protocols.registry import Mount
from protocols.resumable import ResumableWire
from protocols.wire_json import load_json
from protocols.ws import Socket, write_events
from sessions import Session, SessionManager
from sessions.errors import FrameCapacity

log = logging.getLogger("protocols.duplex.model")

RATE = 24000
AUDIO_DELTA = "response.output_audio.delta"
TEXT_DELTA = "duplex.text.delta"
FRAME_LATE = "duplex.frame.late"
MAX_INPUT_AHEAD_S = 2.0
HEARTBEAT_S = 5.0


@runtime_checkable
class DuplexModel(Protocol):
    """What this wire needs from the pipeline's stage (`pipelines.moshi.MoshiProcessor`)."""

    def admit(self, key: str) -> None: ...

    def cancel(self, key: str) -> None: ...

    def describe(self) -> dict[str, Any]: ...


class ModelConversation:
    """A session's conversation with the model: the request, the audio both ways, the
    wire settings. It lives in the session (it survives reconnects)."""

    def __init__(self, session: Session, sessions: SessionManager, model: str, frame_ms: float, reservation: str) -> None:
        self.session = session
        self.sessions = sessions
        self.model = model
        self.frame_ms = frame_ms
        self.in_fmt = self.out_fmt = WireFormat("pcm16", RATE)
        self.binary_out = True
        self._dec = InputDecoder(self.in_fmt, RATE)
        self._enc = OutputEncoder(self.out_fmt, RATE)
        self.out_seq = 0
        self.received_s = 0.0  # audio taken from the user, seconds at 24 kHz
        self.first_audio: float | None = None
        self.stream = session.submit({"reservation": reservation}, open_ended=True)
        self.pump = asyncio.get_running_loop().create_task(self._pump(), name=f"moshi-pump-{session.id}")
        session.keep(self)

        async def stop() -> None:
            self.pump.cancel()
            await asyncio.gather(self.pump, return_exceptions=True)

        session.add_finalizer(stop)

    # ---- the session's shape --------------------------------------------------------------
    def wire(self, caps: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "id": self.session.id, "object": "realtime.session", "type": "duplex", "model": self.model,
            "audio": {
                "input": {"format": self.in_fmt.ga()},
                "output": {"format": self.out_fmt.ga(), "transport": "binary" if self.binary_out else "json"},
            },
            "capabilities": dict(caps),
        }

    def update(self, body: Any) -> None:
        if not isinstance(body, dict):
            raise ClientError("'session' must be an object.", param="session")
        bad = set(body) - {"audio", "type", "model"}
        if bad:
            raise ClientError(f"Unknown session field(s) {sorted(bad)}; a full-duplex session takes session.audio.", code="unknown_parameter", param=f"session.{sorted(bad)[0]}")
        audio = body.get("audio") or {}
        if not isinstance(audio, dict) or set(audio) - {"input", "output"}:
            raise ClientError("session.audio takes 'input' and 'output'.", param="session.audio")
        inp, out = audio.get("input") or {}, audio.get("output") or {}
        in_fmt = _format(inp.get("format"), "session.audio.input.format") if "format" in inp else self.in_fmt
        out_fmt = _format(out.get("format"), "session.audio.output.format") if "format" in out else self.out_fmt
        transport = out.get("transport", "binary" if self.binary_out else "json")
        if transport not in ("binary", "json"):
            raise ClientError("session.audio.output.transport is 'binary' or 'json'.", param="session.audio.output.transport")
        self.set_formats(in_fmt, out_fmt)
        self.binary_out = transport == "binary"

    def set_formats(self, in_fmt: WireFormat, out_fmt: WireFormat) -> None:
        if in_fmt != self.in_fmt:
            self.in_fmt, self._dec = in_fmt, InputDecoder(in_fmt, RATE)
        if out_fmt != self.out_fmt:
            self.out_fmt, self._enc = out_fmt, OutputEncoder(out_fmt, RATE)

    # ---- audio in ---------------------------------------------------------------------------
    def audio_in(self, data: bytes) -> None:
        """Audio in the input format (PCM16 at its rate, or G.711 at 8 kHz): resampled
        and sent to the model, unless it is too far ahead of real time (then refused:
        nothing of it is played in)."""
        if len(data) % self.in_fmt.bytes_per_sample:
            raise ClientError("Audio frames carry 16-bit PCM: an even number of bytes.", code="invalid_frame")
        now = time.monotonic()
        seconds = len(data) / self.in_fmt.bytes_per_sample / self.in_fmt.rate
        if self.first_audio is None:
            self.first_audio = now
        ahead = self.received_s + seconds - (now - self.first_audio)
        if ahead > MAX_INPUT_AHEAD_S:
            raise ClientError(
                f"Audio is arriving {ahead:.1f} s ahead of real time; send it in real time (at most {MAX_INPUT_AHEAD_S:.1f} s ahead). "
                "This frame was not played in.",
                code="input_too_fast",
            )
        x = self._dec.decode(data)
        self.received_s += seconds
        if not self.session.send_input(self.stream, Payload(PayloadKind.AUDIO, self.session.fence, arrays={"pcm": x}, meta={"sample_rate": RATE})):
            raise ClientError("The conversation has ended; open a new session.", code="session_gone")

    # ---- audio and text out -------------------------------------------------------------------
    async def _pump(self) -> None:
        s = self.session
        try:
            async for _, p, _ in self.stream.payloads():
                frame = int(p.meta.get("frame", 0))
                s.emit(AUDIO_DELTA, {"frame": frame, "delta": self._enc.encode(s.id, pcm16_bytes(p.arrays["pcm"]))})
                if p.meta.get("text"):
                    s.emit(TEXT_DELTA, {"frame": frame, "delta": p.meta["text"]})
                if p.meta.get("late"):
                    s.emit(FRAME_LATE, {"frame": frame})
        except RequestAborted:
            return  # the session is ending
        except OmniError as exc:
            log.warning("moshi session %s: %s", s.id, exc)
            s.emit("error", {"error": {**exc.wire(), "event_id": None}})
            self.sessions.end_soon(s, "server_error")

    # ---- the wire ---------------------------------------------------------------------------
    def render(self, type: str, data: Mapping[str, Any]) -> str | bytes:
        self.out_seq += 1
        if type == AUDIO_DELTA:
            if self.binary_out:
                return bytes([AUDIO_FRAME]) + data["delta"]
            data = {**data, "delta": base64.b64encode(data["delta"]).decode()}
        return json.dumps({"type": type, "event_id": f"event_{self.out_seq:06d}", "server_event_seq": self.out_seq, **data})


class ReplicaPool(Protocol):
    """The entry stage's replicas (`omni_rt.stage_pool.StagePool`)."""

    def pick(self, affinity: str | None = None) -> Any: ...

    def pin(self, affinity: str, replica: Any) -> None: ...


async def open_conversation(sessions: SessionManager, pipeline: str, pool: ReplicaPool, kind: str, principal: str, model: str) -> tuple[Session, ModelConversation]:
    """Open a `kind` session on the full-duplex model, admitted by the frame budget of
    the replica that will run it (the pool's pick, pinned to the session; refused:
    FrameCapacity, `capacity` with retry-after), with its conversation. Anything else
    that goes wrong in the model's check is a fault, not a refusal."""
    key = f"open_{secrets.token_hex(8)}"
    chosen: list[tuple[Any, DuplexModel]] = []

    def admit() -> None:
        replica = pool.pick()
        proc = replica.processor
        if not isinstance(proc, DuplexModel):
            raise InternalError(f"pipeline {pipeline}: replica {replica.index} of its entry stage is no full-duplex model")
        try:
            proc.admit(key)
        except CapacityExceeded as exc:  # the model's own refusal (pipelines.moshi.FrameBudgetExceeded)
            raise FrameCapacity(kind, exc.live, exc.message, sessions.spec.realtime_admission.retry_after_s) from exc
        chosen.append((replica, proc))

    def cancel() -> None:
        for _, proc in chosen:
            proc.cancel(key)

    try:
        session = await sessions.open(kind, pipeline, principal=principal, admit=admit)
    except BaseException:
        cancel()  # refused after the frame budget reserved room (a cap, the store)
        raise
    replica, proc = chosen[0]
    pool.pin(session.id, replica)  # its request runs where its room was reserved
    session.add_finalizer(cancel)  # a reservation no request took over (a request takes it on start)
    try:
        return session, ModelConversation(session, sessions, model, float(proc.describe()["frame_ms"]), key)
    except BaseException:
        cancel()
        await sessions.end(session, "server_error")
        raise


def _format(v: Any, param: str) -> WireFormat:
    """`{type: audio/pcm, rate}` (one of RATES), `{type: audio/pcmu}` or `{type: audio/pcma}`."""
    if not isinstance(v, Mapping):
        raise ClientError("Must be {type: audio/pcm, rate: N}, {type: audio/pcmu} or {type: audio/pcma}.", param=param)
    try:
        return WireFormat.parse_realtime(v, (RATE, *(r for r in RATES if r != RATE)))
    except WireFormatError as exc:
        raise ClientError(str(exc), param=f"{param}.rate" if v.get("type", "audio/pcm") == "audio/pcm" else param) from None


def mount(m: Mount) -> None:
    sessions, pipeline = m.sessions, m.pipeline
    proc = m.processor(DuplexModel)
    pool = m.entry_pool
    model_names = list(pipeline.models)

    def caps() -> dict[str, Any]:
        d = proc.describe()
        return {
            "full_duplex": True, "frame_ms": d["frame_ms"], "supports_barge_in": False, "supports_session_resume": True,
            "input_formats": INPUT_FORMATS,
            "output_formats": OUTPUT_FORMATS, "output_transports": ["binary", "json"],
            "heartbeat_s": HEARTBEAT_S, "max_input_ahead_s": MAX_INPUT_AHEAD_S,
            "replay_buffer_events": sessions.spec.replay_buffer_events, "disconnect_grace_s": sessions.spec.disconnect_grace_s,
        }

    async def open_session(principal: str, model: str) -> tuple[Session, ModelConversation]:
        return await open_conversation(sessions, pipeline.name, pool, "duplex", principal, model)

    async def handle(session: Session, conv: ModelConversation, data: str | bytes) -> None:
        session.touch()
        if isinstance(data, bytes) and data[:1] != b"{":
            if len(data) < 2 or data[0] != AUDIO_FRAME:
                kind = f"0x{data[0]:02x}" if data else "empty"
                raise ClientError(f"Binary frames are [0x01][PCM16 audio]; got a {kind} frame of {len(data)} bytes.", code="invalid_frame")
            if len(data) - 1 > MAX_FRAME_BYTES:
                raise ClientError(f"An audio frame may carry at most {MAX_FRAME_BYTES} bytes.", code="invalid_frame")
            conv.audio_in(data[1:])
            return
        ev = load_json(data)
        if not isinstance(ev, dict) or not isinstance(ev.get("type"), str):
            raise ClientError("Each event is a JSON object with a string 'type'.", param="type")
        kind = ev["type"]
        if kind == "input_audio_buffer.append":
            audio = ev.get("audio")
            if not isinstance(audio, str):
                raise ClientError("'audio' must be base64 PCM16.", param="audio")
            try:
                raw = base64.b64decode(audio, validate=True)
            except (binascii.Error, ValueError):
                raise ClientError("'audio' is not valid base64.", param="audio") from None
            conv.audio_in(raw)
        elif kind == "session.update":
            conv.update(ev.get("session"))
            session.emit("session.updated", {"session": conv.wire(caps())})
        elif kind == "heartbeat":
            pass
        elif kind == "session.close":
            await sessions.end(session, "client_closed")
        elif kind == "session.resume":  # (as the first event, the lifecycle takes it)
            raise ClientError("session.resume must be the first event on a new connection.", param="type")
        else:
            raise ClientError(
                f"Unknown event type {kind!r}; known: input_audio_buffer.append, session.update, heartbeat, session.close, session.resume.",
                code="invalid_event", param="type",
            )

    async def created(session: Session, conv: ModelConversation) -> None:
        session.emit("session.created", {"session": conv.wire(caps()), "resume_token": await sessions.issue_resume_token(session)})

    async def resumed(sock: Socket, session: Session, conv: ModelConversation) -> None:
        conv.out_seq += 1
        await sock.send(json.dumps({
            "type": "session.resumed", "event_id": f"event_{conv.out_seq:06d}", "server_event_seq": conv.out_seq,
            "session": conv.wire(caps()), "resume_token": await sessions.issue_resume_token(session), "replayed_events": session.queued_events,
        }))

    wire: ResumableWire[ModelConversation] = ResumableWire(
        sessions, "full-duplex model", "/v1/duplex", open=open_session, state_of=lambda s: s.kept(ModelConversation), handle=handle,
        error=lambda session, _c, err: session.emit("error", {"error": {**err.wire(), "event_id": None}}),
        writer=lambda sock, session, conv: write_events(sock, session, lambda ev: conv.render(ev.type, ev.data)),
        created=created, resumed=resumed, heartbeat_s=lambda _c: HEARTBEAT_S,
    )

    async def duplex(request: web.Request) -> web.StreamResponse:
        return await wire.serve(request, request.query.get("model") or model_names[0])

    for name in model_names:
        m.websocket("/v1/duplex", duplex, f"full-duplex speech ({name}, ?model={name})" if name == model_names[0] else None, model=name)
