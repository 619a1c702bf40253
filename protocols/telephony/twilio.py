"""`/v1/telephony/twilio`: a Twilio Media Streams WebSocket (`<Connect><Stream>`, the
bidirectional stream) onto a voice conversation.

Twilio's messages, as its documentation describes them:

- in: `connected`; `start {streamSid, start: {callSid, tracks, customParameters,
  mediaFormat: {encoding: audio/x-mulaw, sampleRate: 8000, channels: 1}}}`; `media
  {media: {track, chunk, timestamp, payload}}` (base64 μ-law, 20 ms); `dtmf {dtmf:
  {digit}}`; `mark {mark: {name}}` (a mark this server sent, echoed once the audio
  before it has played, or when a `clear` dropped it); `stop`.
- out: `media {streamSid, media: {payload}}` (base64 μ-law at 8 kHz, no header),
  `mark {streamSid, mark: {name}}` after each piece of an answer, `clear {streamSid}`
  when the caller talks over the agent.

The conversation is the Realtime one (server VAD, barge-in, history, tools), in μ-law
both ways. What the caller heard is what the marks say: each mark names the answer and
how many milliseconds of it had been sent before it; when the caller cuts in, the
answer is kept in history up to the last mark Twilio echoed before the `clear`.
A `dtmf` digit is an `input_audio_buffer.dtmf_event_received {event, received_at}`
session event, and with the parameter `dtmf: "message"` also a user message
(`DTMF <digit>`) in the conversation.

Twilio strips query strings from the stream URL: the call's settings come as
`<Parameter>` nouns (`start.customParameters`): `authorization` (`Bearer <key>`, or
`api_key`) where the server has API keys, `model`, `voice`, `instructions`,
`max_output_tokens`. The
handshake itself is open; a call that does not authenticate in its `start` is closed
(1008) before a session is opened. A call is a `realtime` session (caps, leases,
load-aware admission, drain). Closing the socket ends the `<Connect>` and so the
call; a session the server ends (idle, drain, shutdown) closes the socket.

Call control (`protocols.calls`): the call's id is its session's; with
`server.call_webhook_url` set the call rings (a signed `realtime.call.incoming`
webhook) and is heard once the app accepts it (`POST /v1/realtime/calls/{id}/accept`);
`/v1/realtime?call_id=` attaches a sideband control socket to it, which gets the
conversation's events (this wire carries only audio, marks and clears).

Bad input: a `media` before `start`, a `start` with another media format, or no
`start` within 10 s closes the stream with 1008 and the reason (no session was opened);
once the call runs, a message that is not JSON or a payload that is not base64 is
dropped with a warning (`omni_rt_telephony_bad_frames_total`) and the call goes on.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web
from prometheus_client import Counter

from media.wire_audio import PCMA, PCMU, WireFormat
from omni_rt.errors import ClientError, OmniError
from omni_rt.payloads import Fence
from protocols.auth import KEYS, KeyRing
from protocols.calls import PhoneCall, registry
from protocols.realtime import Config, Conversation, EventOutput, Response, vad_of
from protocols.realtime.models import apply_session_update
from protocols.registry import Mount
from protocols.wire_json import load_json
from protocols.ws import Socket, accept, serve_events
from sessions import SessionError, SessionEvent

log = logging.getLogger("protocols.telephony.twilio")

PATH = "/v1/telephony/twilio"


@dataclass(frozen=True)
class Dialect:
    """A provider's spelling of the media-streams protocol: Twilio's and Telnyx's carry
    the same messages (connected, start, media, mark, clear, dtmf, stop) and differ in
    their field names and media formats."""

    provider: str
    path: str
    stream_key: str  # the stream's id, top level of each message
    call_key: str  # the call's id in start
    params_key: str  # the custom parameters in start
    format_key: str  # the media format in start
    rate_key: str
    encodings: Mapping[str, WireFormat]
    stream_id_out: bool  # frames to the provider carry the stream's id


TWILIO = Dialect("twilio", "/v1/telephony/twilio", "streamSid", "callSid", "customParameters", "mediaFormat", "sampleRate",
                 {"audio/x-mulaw": PCMU}, True)
# Telnyx media streaming with stream_bidirectional_mode "rtp" (PCMU or PCMA payloads)
TELNYX = Dialect("telnyx", "/v1/telephony/telnyx", "stream_id", "call_control_id", "custom_parameters", "media_format", "sample_rate",
                 {"PCMU": PCMU, "PCMA": PCMA}, False)
START_TIMEOUT_S = 10.0  # Twilio sends connected and start at once
MAX_FRAME_BYTES = 64 << 10  # Twilio's messages are under a kilobyte (20 ms of μ-law)
BAD_FRAMES = Counter("omni_rt_telephony_bad_frames_total", "Telephony stream messages dropped as malformed", ["provider", "why"])
MARK = "twilio.mark"
CLEAR = "twilio.clear"


class StreamError(ClientError):
    """The stream broke Twilio's protocol: closed with 1008 and this reason."""


class MarkedOutput(EventOutput):
    """The answer's audio as μ-law events, each followed by a mark naming the answer
    and the milliseconds sent so far; Twilio's echo of a mark is what was heard."""

    def __init__(self, conv_emit: Any, session_emit: Any, fmt: WireFormat = PCMU) -> None:
        super().__init__(conv_emit, acks=True, fmt=lambda: fmt)
        self.wire_format = fmt
        self.session_emit = session_emit
        self.sent: dict[str, int] = {}  # response id -> μ-law bytes sent
        self.outstanding: set[str] = set()  # marks sent and not echoed yet: audio Twilio may still play

    def push(self, resp: Response, fence: Fence, pcm16: bytes) -> None:
        self.produced(resp, pcm16)
        self._send(resp, fence, self._encoded(resp, pcm16))

    def end(self, resp: Response, fence: Fence) -> None:
        self._send(resp, fence, self._enc.finish(resp.id) if self._enc is not None else b"")

    def _send(self, resp: Response, fence: Fence, data: bytes) -> None:
        if not data:
            return
        a = self.answers.get(resp.id)
        if a is not None and a.heard_ms is None:
            a.heard_ms = 0  # marks are reliable: nothing echoed yet is nothing heard yet
        self.emit("response.audio.delta", fence, delta=data, **resp.ids)
        sent = self.sent[resp.id] = self.sent.get(resp.id, 0) + len(data)
        while len(self.sent) > 16:
            self.sent.pop(next(iter(self.sent)))
        name = f"{resp.id}:{sent * 1000 // self.wire_format.rate}"
        self.outstanding.add(name)
        self.session_emit(MARK, {"name": name}, fence=fence)

    def echoed(self, name: Any) -> None:
        """Twilio played the audio before this mark (or a clear dropped it: then the
        mark was no longer outstanding, and its echo says nothing)."""
        if not isinstance(name, str) or name not in self.outstanding:
            return
        self.outstanding.discard(name)
        rid, _, ms = name.rpartition(":")
        if rid in self.answers and ms.isdigit():
            self.ack(rid, int(ms))

    def clear(self) -> dict[str, int]:
        cut = super().clear()
        if self.outstanding:
            self.session_emit(CLEAR, {})  # unfenced: it goes out before the next answer
            self.outstanding.clear()  # the echoes of what it dropped are not heard audio
        return cut


class TwilioTransport:
    tag_epochs = False

    def __init__(self, output: MarkedOutput) -> None:
        self.output = output

    def update_session(self, conv: Conversation, body: Any) -> Config:
        """A sideband's session.update: everything but the audio format (the phone leg's)."""
        cfg = apply_session_update(conv.cfg, body, conv.pipeline.voices)
        return replace(cfg, input_format=conv.cfg.input_format, output_format=conv.cfg.output_format)

    def session_wire(self, conv: Conversation) -> dict[str, Any]:
        return conv.cfg.wire(True, conv.session.id)

    async def on_event(self, conv: Conversation, type: str, ev: dict[str, Any], event_id: str | None) -> bool:
        return False


def _authorized(keys: KeyRing | None, params: Mapping[str, Any]) -> str | None:
    """The principal a call's parameters authenticate, or None (also when the server's
    key ring is not known: this path bypasses the HTTP authentication)."""
    if keys is None:
        return None
    if not keys.enabled:
        return "anonymous"
    auth = params.get("authorization")
    if not isinstance(auth, str) and isinstance(params.get("api_key"), str):
        auth = f"Bearer {params['api_key']}"
    principal = keys.principal_for(auth if isinstance(auth, str) else None)
    return principal.name if principal is not None else None


def _message(data: str | bytes) -> dict[str, Any]:
    try:
        msg = load_json(data)
    except ClientError as exc:
        raise StreamError(f"not a Twilio stream message: {exc.message}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("event"), str):
        raise StreamError("each message is a JSON object with a string 'event'")
    return msg


def mount(m: Mount) -> None:
    """Twilio Media Streams at /v1/telephony/twilio."""
    _mount(m, TWILIO)


def mount_telnyx(m: Mount) -> None:
    """Telnyx media streaming at /v1/telephony/telnyx."""
    _mount(m, TELNYX)


def _mount(m: Mount, d: Dialect) -> None:
    sessions, pipeline = m.sessions, m.pipeline
    vad = vad_of(m)
    calls = registry(sessions, m.server)

    def apply_config(call: PhoneCall, body: dict[str, Any]) -> None:
        """An accept's session configuration on the call (the phone leg stays μ-law)."""
        model = body.get("model")
        if model is not None and model not in pipeline.models:
            raise ClientError(f"The model {model!r} does not exist; available: {', '.join(pipeline.models)}.", code="model_not_found", param="model")
        cfg = apply_session_update(call.conv.cfg, {k: v for k, v in body.items() if k != "model"}, pipeline.voices)
        call.conv.cfg = replace(cfg, model=model or cfg.model, input_format=call.conv.cfg.input_format, output_format=call.conv.cfg.output_format)

    calls.mount(m.route, apply_config)

    async def _ring(call: PhoneCall) -> None:
        try:
            answered = await calls.ring(call)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a call that cannot ring is ended, not left silent
            log.exception("call %s: ringing failed; the call is ended", call.call_id)
            answered = None
        if answered is None:
            await sessions.end(call.session, "call_rejected")

    async def stream(request: web.Request) -> web.StreamResponse:
        sock = await accept(request, max_frame=MAX_FRAME_BYTES)
        try:
            start, fmt = await _await_start(sock, d)
        except StreamError as exc:
            await sock.close(1008, exc.message[:120])
            return sock.ws
        if start is None:
            return sock.ws
        info = start["start"]
        stream_sid = str(start.get(d.stream_key) or info.get(d.stream_key) or "")
        call_sid = str(info.get(d.call_key) or "")
        params = info.get(d.params_key) or {}
        if not isinstance(params, dict):
            params = {}
        keys = request.app.get(KEYS)
        principal = _authorized(keys, params)
        if principal is None:
            await sock.close(1008, f"unauthorized: pass the API key in {d.params_key} as authorization: Bearer <key>")
            return sock.ws
        try:
            cfg = _config(pipeline, params, fmt)
            session = await sessions.open("realtime", pipeline.name, principal=principal)
        except (SessionError, ClientError) as exc:
            await sock.close(exc.ws_close, exc.message[:120])
            return sock.ws
        session.pinned = True  # the phone leg cannot move: a drain waits for the call to end
        conv = Conversation(session, sessions, pipeline, ga=True, model=cfg.model, vad=vad)
        conv.cfg = cfg
        output = MarkedOutput(conv.emit, session.emit, fmt)
        conv.transport = TwilioTransport(output)
        session.params.update({"call_sid": call_sid, "stream_sid": stream_sid, "provider": d.provider})
        tag = d.provider.capitalize()
        ids = ("CallSid", "StreamSid") if d is TWILIO else ("CallId", "StreamId")  # each provider's own words
        headers = [{"name": f"X-{tag}-{ids[0]}", "value": call_sid}, {"name": f"X-{tag}-{ids[1]}", "value": stream_sid}]
        for k in ("from", "to"):  # Telnyx's start says who calls whom
            if isinstance(info.get(k), str):
                headers.append({"name": k.capitalize(), "value": info[k]})
        headers += [{"name": f"X-{tag}-Param-{k}", "value": str(v)} for k, v in params.items() if k not in ("authorization", "api_key")]
        call = PhoneCall(session, conv, d.provider, headers)
        calls.add(call)
        if calls.webhook_url is None:
            await calls.ring(call)  # answered at once with the deploy's session
        else:
            ringing = asyncio.get_running_loop().create_task(_ring(call))
            session.add_finalizer(lambda: _cancel(ringing))
        dtmf_message = params.get("dtmf") == "message"
        log.info("%s call %s (stream %s) is session %s", d.provider, call_sid, stream_sid, session.id)
        sid = {d.stream_key: stream_sid} if d.stream_id_out else {}

        def frame(ev: SessionEvent) -> str | None:
            if ev.type == "response.output_audio.delta":
                return json.dumps({"event": "media", **sid, "media": {"payload": base64.b64encode(ev.data["delta"]).decode()}})
            if ev.type == MARK:
                return json.dumps({"event": "mark", **sid, "mark": {"name": ev.data["name"]}})
            if ev.type == CLEAR:
                return json.dumps({"event": "clear", **sid})
            # the rest of the conversation's events have no place on this wire: they go to
            # the call's sideband control socket, if one is attached
            call.forward(ev)
            return None

        async def on_message(data: str | bytes) -> bool:
            try:
                msg = _message(data)
            except StreamError as exc:
                BAD_FRAMES.labels(d.provider, "message").inc()
                log.warning(f"{d.provider} call %s: %s; dropped", call_sid, exc.message)
                return True
            kind = msg["event"]
            body = msg.get(kind) if kind in ("media", "mark", "dtmf") else {}
            if not isinstance(body, dict):
                BAD_FRAMES.labels(d.provider, "shape").inc()
                log.warning(f"{d.provider} call %s: a %r message without its %r object; dropped", call_sid, kind, kind)
                return True
            if kind == "media":
                if body.get("track", "inbound") not in ("inbound", "inbound_track") or not call.accepted:
                    return True  # (a ringing call is not heard yet)
                payload = body.get("payload")
                try:
                    if not isinstance(payload, str):
                        raise TypeError(type(payload).__name__)
                    audio = base64.b64decode(payload, validate=True)
                except (binascii.Error, ValueError, TypeError):
                    BAD_FRAMES.labels(d.provider, "base64").inc()
                    log.warning(f"{d.provider} call %s: a media payload is not base64; dropped", call_sid)
                    return True
                session.touch()
                try:
                    await conv.input.append_bytes(audio)
                except OmniError as exc:  # refused audio, a stage down: said on the sideband, the call goes on
                    if not exc.expose:
                        raise
                    log.warning(f"{d.provider} call %s: audio not taken: %s", call_sid, exc.public_message())
                    conv.error(exc)
            elif kind == "mark":
                output.echoed(body.get("name"))
            elif kind == "dtmf":
                digit = str(body.get("digit", ""))[:1]
                if digit:
                    session.emit("input_audio_buffer.dtmf_event_received", {"event": digit, "received_at": int(time.time())})
                    if dtmf_message:
                        await conv.handle(json.dumps({"type": "conversation.item.create", "item": {
                            "type": "message", "role": "user", "content": [{"type": "input_text", "text": f"DTMF {digit}"}]}}))
            elif kind == "stop":
                return False  # the call ended
            elif kind in ("connected", "start"):
                pass
            elif kind == "error":  # Telnyx says what went wrong on its side
                log.warning(f"{d.provider} call %s: the provider reports an error: %s", call_sid, str(msg)[:300])
            else:
                BAD_FRAMES.labels(d.provider, "event").inc()
                log.info(f"{d.provider} call %s: unknown event %r ignored", call_sid, kind)
            return True

        async def on_exit(why: str) -> None:
            await conv.shutdown("call_ended")
            await sessions.end(session, {"client_left": "client_disconnected", "client_closed": "call_ended"}.get(why, why))

        why = await serve_events(sock, session, frame, on_message, on_exit)
        await sock.close(1011 if why == "server_error" else 1000, "call ended")
        return sock.ws

    what = {"twilio": "Twilio Media Streams (<Connect><Stream>)", "telnyx": "Telnyx media streaming (stream_bidirectional_mode rtp)"}
    m.websocket(d.path, stream, f"{what[d.provider]}: phone calls onto the voice agent")


async def _cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _await_start(sock: Socket, d: Dialect) -> tuple[dict[str, Any] | None, WireFormat]:
    """The provider's `connected`, then `start`: the start message, checked, and the
    call's audio format; None when the stream closed first."""
    deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
    while True:
        try:
            data = await sock.receive_by(deadline)
        except asyncio.TimeoutError:
            raise StreamError(f"no 'start' message within {START_TIMEOUT_S:.0f} s") from None
        if data is None:
            return None, PCMU
        msg = _message(data)
        kind = msg["event"]
        if kind == "connected":
            continue
        if kind != "start":
            raise StreamError(f"'{kind}' before 'start': a stream starts with connected, then start")
        start = msg.get("start")
        if not isinstance(start, dict):
            raise StreamError("'start' carries a 'start' object")
        fmt = start.get(d.format_key) or {}
        wire = d.encodings.get(str(fmt.get("encoding"))) if isinstance(fmt, dict) else None
        if wire is None or not isinstance(fmt, dict) or str(fmt.get(d.rate_key)) != "8000" or str(fmt.get("channels", 1)) != "1":
            served = " or ".join(d.encodings)
            raise StreamError(f"{d.format_key} {str(fmt)[:80]} is not served; {served} at 8000 Hz, mono")
        return msg, wire


def _config(pipeline: Any, params: Mapping[str, Any], fmt: WireFormat = PCMU) -> Config:
    """The call's conversation: the deploy's default session, μ-law both ways, and the
    call's `<Parameter>` settings (`model`, `voice`, `instructions`, `max_output_tokens`)."""
    model = params.get("model")
    if model is not None and model not in pipeline.models:
        raise ClientError(f"model {model!r} is not served here", param="model")
    cfg = replace(Config(model=model or pipeline.models[0]), input_format=fmt, output_format=fmt)
    update: dict[str, Any] = {}
    if isinstance(params.get("voice"), str):
        update["voice"] = params["voice"]
    if isinstance(params.get("instructions"), str):
        update["instructions"] = params["instructions"]
    limit = params.get("max_output_tokens")
    if limit is not None:  # <Parameter> values are strings
        if not (isinstance(limit, str) and limit.isdigit()) and limit != "inf":
            raise ClientError("max_output_tokens is an integer or 'inf'", param="max_output_tokens")
        update["max_output_tokens"] = limit if limit == "inf" else int(limit)
    return apply_session_update(cfg, update, pipeline.voices) if update else cfg


__all__ = ["PATH", "TELNYX", "TWILIO", "Dialect", "MarkedOutput", "mount", "mount_telnyx"]
