"""`/v1/live/sessions`: OpenAI's Live API (the `openai` SDK's `client.live.connect()`).

The socket opens with `session.start {session: {model, audio?, instructions?, input?,
delegation?, ...}}` and the server answers `session.started` with the resolved
`SessionResource` (the model is in the event, never the URL). `session.model` picks the
engine among the pipelines that mount one (`LiveRouter`, one route):

- the voice pipeline's turn-taking engine (`mount`; `gpt-live-1`, `gpt-live-1.1` and the
  pipeline's other names): the Realtime conversation (`protocols.realtime.Conversation`)
  with semantic_vad turn-taking and barge-in, history, truncation, function calling;
- a full-duplex speech model (`mount_duplex_model`; `moshi`): listening and speaking at
  once every 80 ms frame, its text stream as the output transcript; it hears no text.

In: `session.input_audio.append {audio}` (the startup format: PCM16 at 16 or 24 kHz, or
G.711 μ-law / A-law at 8 kHz), `.mute` / `.unmute` (muted, the model hears silence),
`session.instructions.append` (developer context from then on), `session.thinking.append`
(silent context), `session.commentary.append` (context the model communicates: it
speaks next), `session.update {session: {delegation}}`, `response.item.create` /
`response.create` (Responses delegation), `session.close`. Out:
`session.output_audio.delta`, `session.output_transcript.delta`,
`session.input_transcript.delta` (streamed while the user speaks where the profile has a
streaming ASR stage), the acks (`session.input_audio.muted` / `unmuted`,
`session.instructions.appended`, `…thinking.appended`, `…commentary.appended`,
`session.updated`), `session.usage.updated`, `session.delegation.created`,
`response.event`, `session.closed {reason, session, usage}`, `info`, and
`error {error: {…, client_event_id}}`.

Delegation: the talking model gets a `delegate(task)` function of its own; when it calls
it the server sends `session.delegation.created` and an `info` (`code:
"delegation.task"`) carrying the task's text. With `{type: "client"}` the app answers
with `session.commentary.append` (the result, spoken next), `session.thinking.append` or
`session.instructions.append` (silent) naming `delegation_id`; with `{type:
"responses"}` this server runs the task on its own chat LM (`protocols.live_responses`).
What this server does not run (Decisions, audio fixtures, triggers, stored sessions,
WebRTC client capabilities) is refused with an `error` naming the field or event, and
the session goes on.

A dropped socket detaches the session (resumable for `sessions.disconnect_grace_s`):
the SDK's reconnect, given `?session_id=&resume_token=` by its `on_reconnecting`
handler (the token is an `info` event, `code: "session.resume_token"`, after
`session.started` and after each resume), re-attaches it and the events produced while
away are replayed. Timeline fields (`start_ms` / `end_ms`, `offset_ms`) are
milliseconds since the session started. A session lasts at most `MAX_SESSION_S`
(`expires_at`), then closes with reason `expired`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from media.wire_audio import WireFormat, WireFormatError
from omni_rt.errors import ClientError, OmniError
from protocols.auth import principal_of
from protocols.errors import error_event
from protocols.realtime import Config, Conversation, vad_of
from protocols.realtime.inputs import decode_base64
from protocols.realtime.items import Item, new_id
from protocols.realtime.models import PCM24, apply_session_update
from protocols.registry import Mount
from protocols.wire_json import load_json
from protocols.ws import Socket, accept, close_attachment, serve_events
from sessions import Session, SessionError, SessionEvent, SessionManager

log = logging.getLogger("protocols.live")

PATH = "/v1/live/sessions"
START_TIMEOUT_S = 10.0
MAX_SESSION_S = 3600  # a Live session's longest life (`expires_at`)
LIVE = "live:"  # session events of this wire (the rest are the conversation's, translated or dropped)
DELEGATE = "delegate"
DELEGATE_TOOL = {
    "type": "function",
    "name": DELEGATE,
    "description": "Hand a task you cannot do yourself (looking something up, acting in the application) to the application. "
                   "Say briefly that you are on it; the result comes back to you.",
    "parameters": {"type": "object", "properties": {"task": {"type": "string", "description": "what to do, in one sentence"}},
                   "required": ["task"]},
}
UNSUPPORTED_EVENTS = {
    "decision.create": "Decisions delegation",
    "decision.item.create": "Decisions delegation",
    "decision.item.delete": "Decisions delegation",
    "response.create": "Responses delegation",
    "response.item.create": "Responses delegation",
    "session.output_audio.fixture.play": "audio fixtures",
}


@dataclass
class LiveConfig:
    """A Live session's startup configuration, as `session.started` echoes it."""

    model: str
    voice: str | None = "marin"
    format: WireFormat = PCM24
    instructions: str = ""
    input: list[dict[str, Any]] = field(default_factory=list)
    delegation: dict[str, Any] | None = None
    safety_identifier: str | None = None

    def resource(self, session: Session, started: float) -> dict[str, Any]:
        return {"id": session.id, "expires_at": int(started + MAX_SESSION_S), "model": self.model, "status": "active",
                "audio": {"format": {**self.format.ga(), "rate": self.format.rate}, "output": {"voice": self.voice}},  # Live names G.711's rate too
                "delegation": {k: v for k, v in self.delegation.items() if not k.startswith("_")} if self.delegation else None,
                "input": self.input, "instructions": self.instructions, "safety_identifier": self.safety_identifier, "store": False,
                "triggers": []}


def _text(raw: Any, param: str, limit: int = 64_000) -> str:
    if not isinstance(raw, str):
        raise ClientError(f"'{param}' must be a string.", code="invalid_type", param=param)
    if len(raw) > limit:
        raise ClientError(f"'{param}' is over {limit} characters.", code="string_above_max_length", param=param)
    return raw


def _delegation(raw: Any, param: str) -> dict[str, Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ClientError(f"'{param}' must be an object or null.", code="invalid_type", param=param)
    kind = raw.get("type")
    if kind == "decisions":
        raise ClientError("Decisions delegation is not served here; use {type: 'client'} (the app handles delegated tasks), "
                          "{type: 'responses'} (this server's chat LM) or null.", code="unsupported_value", param=f"{param}.type")
    if kind not in ("client", "responses"):
        raise ClientError(f"'{param}.type' must be 'client', 'responses' or 'decisions'.", code="invalid_value", param=f"{param}.type")
    delay = raw.get("acknowledgement_delay_ms", 0)
    if not isinstance(delay, int) or isinstance(delay, bool) or not 0 <= delay <= 60_000:
        raise ClientError(f"'{param}.acknowledgement_delay_ms' must be an integer from 0 to 60000.", code="invalid_value",
                          param=f"{param}.acknowledgement_delay_ms")
    extra = set(raw) - {"type", "acknowledgement_delay_ms", "responses"}
    if extra:
        raise ClientError(f"Unknown parameter '{param}.{sorted(extra)[0]}'.", code="unknown_parameter", param=f"{param}.{sorted(extra)[0]}")
    if kind == "client":
        if "responses" in raw:
            raise ClientError(f"'{param}.responses' goes with type 'responses'.", code="invalid_value", param=f"{param}.responses")
        return {"type": "client", "acknowledgement_delay_ms": delay}
    from protocols.live_responses import parse_config

    cfg = parse_config(raw.get("responses"), f"{param}.responses")
    echo = {k: cfg[k] for k in ("model", "instructions", "tools", "max_output_tokens", "parallel_tool_calls")}
    if isinstance(raw["responses"].get("tool_choice"), (str, Mapping)):
        echo["tool_choice"] = raw["responses"]["tool_choice"]
    return {"type": "responses", "acknowledgement_delay_ms": delay, "responses": echo, "_config": cfg}


def _merged(update: Any, current: dict[str, Any] | None) -> Any:
    """A session.update's delegation over the current one: omitted settings keep their
    values (the Responses backend's too)."""
    if not isinstance(update, Mapping) or current is None or update.get("type") != current.get("type"):
        return update
    out = {k: v for k, v in current.items() if not k.startswith("_")}
    for k, v in update.items():
        if k == "responses" and isinstance(v, Mapping) and isinstance(out.get("responses"), Mapping):
            out["responses"] = {**out["responses"], **v}
        else:
            out[k] = v
    return out


def _input_items(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > 128:
        raise ClientError("'session.input' must be a list of at most 128 messages.", code="invalid_value", param="session.input")
    out = []
    for i, it in enumerate(raw):
        p = f"session.input[{i}]"
        if not isinstance(it, Mapping) or it.get("role") not in ("developer", "user", "assistant"):
            raise ClientError(f"'{p}.role' must be developer, user or assistant.", code="invalid_value", param=f"{p}.role")
        content = it.get("content")
        if not isinstance(content, list) or len(content) != 1 or not isinstance(content[0], Mapping):
            raise ClientError(f"'{p}.content' must hold exactly one text part.", code="invalid_value", param=f"{p}.content")
        kind = content[0].get("type")
        allowed = ("output_text", "text") if it["role"] == "assistant" else ("input_text",)
        if kind is not None and kind not in allowed:
            raise ClientError(f"'{p}.content[0].type' must be {' or '.join(allowed)} for a {it['role']} message.", code="invalid_value",
                              param=f"{p}.content[0].type")
        out.append({"type": "message", "role": it["role"], "content": [{"type": kind or allowed[0],
                                                                        "text": _text(content[0].get("text"), f"{p}.content[0].text")}]})
    return out


def parse_start(raw: Any, models: list[str], voices_of: Any) -> LiveConfig:
    """`session.start`'s session: what this server runs, or a ClientError naming the
    field. `voices_of(model)`: the voices that model speaks (None: only its own)."""
    if not isinstance(raw, Mapping):
        raise ClientError("Missing required parameter: 'session'.", code="missing_required_parameter", param="session")
    model = raw.get("model")
    if not isinstance(model, str):
        raise ClientError("Missing required parameter: 'session.model'.", code="missing_required_parameter", param="session.model")
    if model not in models:
        raise ClientError(f"The model {model!r} is not served on the Live API here; available: {', '.join(models)}.",
                          code="model_not_found", param="session.model")
    cfg = LiveConfig(model=model)
    known = {"model", "audio", "instructions", "input", "delegation", "safety_identifier", "store", "triggers", "client"}
    for key in raw:
        if key not in known:
            raise ClientError(f"Unknown parameter 'session.{key}'.", code="unknown_parameter", param=f"session.{key}")
    audio = raw.get("audio") or {}
    if not isinstance(audio, Mapping):
        raise ClientError("'session.audio' must be an object.", code="invalid_type", param="session.audio")
    if audio.get("format") is not None:
        try:
            cfg.format = WireFormat.parse_realtime(audio["format"], pcm_rates=(24000, 16000))
        except WireFormatError as exc:
            raise ClientError(str(exc), code="invalid_value", param="session.audio.format") from None
    voice = (audio.get("output") or {}).get("voice") if isinstance(audio.get("output") or {}, Mapping) else None
    if isinstance(voice, Mapping):
        voice = voice.get("id")
    voices = voices_of(model)
    if voices is None:  # a model with one voice, its own
        if voice is not None:
            raise ClientError(f"{model} speaks with its own voice; omit 'session.audio.output.voice'.", code="unsupported_value",
                              param="session.audio.output.voice")
        cfg.voice = None
    elif voice is not None:
        cfg.voice = _text(voice, "session.audio.output.voice", 128)
    if voices is not None and cfg.voice not in voices:
        raise ClientError(f"Unknown voice {cfg.voice!r}; available: {', '.join(sorted(voices))}.", code="invalid_value",
                          param="session.audio.output.voice")
    if raw.get("instructions") is not None:
        cfg.instructions = _text(raw["instructions"], "session.instructions")
    cfg.input = _input_items(raw.get("input"))
    cfg.delegation = _delegation(raw.get("delegation"), "session.delegation")
    if raw.get("safety_identifier") is not None:
        cfg.safety_identifier = _text(raw["safety_identifier"], "session.safety_identifier", 256)
    if raw.get("store"):
        raise ClientError("Stored sessions (forking, recording download) are not kept by this server; omit 'session.store' or set it false.",
                          code="unsupported_value", param="session.store")
    if raw.get("triggers"):
        raise ClientError("Decisions triggers are not served here; omit 'session.triggers'.", code="unsupported_value", param="session.triggers")
    if raw.get("client") is not None:
        raise ClientError("'session.client' configures a WebRTC frontend; this is a WebSocket session.", code="unsupported_value",
                          param="session.client")
    return cfg


class LiveBase:
    """A Live session's state around its engine (kept in the session: it survives a
    dropped socket): the timeline, mute, and the events every engine shares."""

    def __init__(self, session: Session, cfg: LiveConfig) -> None:
        self.session, self.cfg = session, cfg
        self.started = time.time()
        self.t0 = time.monotonic()
        self.muted = False
        self.count = 0
        self.closed_sent = False  # session.closed went out (the client's close, or expiry)

    def now_ms(self) -> int:
        return int((time.monotonic() - self.t0) * 1000)

    def emit(self, type: str, client_event_id: str | None = None, **data: Any) -> None:
        if client_event_id is not None:
            data["client_event_id"] = client_event_id
        self.session.emit(LIVE + type, data)

    def usage(self) -> dict[str, Any]:
        return {"seconds": float(int(time.time() - self.started))}

    def resource(self) -> dict[str, Any]:
        return self.cfg.resource(self.session, self.started)

    def _json(self, type: str, data: Mapping[str, Any]) -> str:
        self.count += 1
        return json.dumps({"type": type, "event_id": f"event_{self.count:06d}", **data})

    def frame(self, ev: SessionEvent) -> str | None:
        if ev.type.startswith(LIVE):
            return self._json(ev.type[len(LIVE):], ev.data)
        if ev.type in ("session.closed", "session.expired", "session.migrated"):  # the server ended it
            why = str(ev.data.get("reason") or "")
            if why in ("close_requested", "client_closed") or self.closed_sent:
                return None
            reason = "expired" if ev.type == "session.expired" and why in ("idle_timeout", "disconnect_grace_expired") else "connection_lost"
            self.closed_sent = True
            return self._json("session.closed", {"reason": reason, "session": self.resource(), "usage": self.usage()})
        if ev.type == "error":  # the engine's (a refused audio chunk, a failed answer)
            err = dict(ev.data.get("error") or {})
            err = {"type": err.get("type", "invalid_request_error"), "code": err.get("code") or "invalid_request",
                   "message": err.get("message", ""), "param": err.get("param"), "client_event_id": None}
            return self._json("error", {"error": err})
        return self.translate(ev)

    def translate(self, ev: SessionEvent) -> str | None:
        """The engine's own events in Live's words (None: no Live event)."""
        raise NotImplementedError

    def silence(self, audio: str) -> bytes:
        """Base64 audio of the startup format, decoded (muted: as much silence)."""
        raw = decode_base64(audio, "audio")
        if self.muted:
            enc = self.cfg.format.encoding
            return (b"\xff" if enc == "pcmu" else b"\xd5" if enc == "pcma" else b"\x00") * len(raw)
        return raw

    async def handle(self, msg: Mapping[str, Any]) -> bool:
        """One client event (False: the client closed the session)."""
        t, cid = msg.get("type"), _client_id(msg)
        if t == "session.input_audio.append":
            audio = msg.get("audio")
            if not isinstance(audio, str):
                raise ClientError("Missing required parameter: 'audio'.", code="missing_required_parameter", param="audio")
            self.session.touch()
            await self.audio(self.silence(audio))
        elif t in ("session.input_audio.mute", "session.input_audio.unmute"):
            self.muted = t.endswith(".mute")
            self.emit("session.input_audio.muted" if self.muted else "session.input_audio.unmuted", cid)
        elif t in ("session.instructions.append", "session.thinking.append", "session.commentary.append"):
            await self.context(t.split(".")[1], msg, cid)
        elif t == "session.update":
            body = msg.get("session")
            if not isinstance(body, Mapping):
                raise ClientError("Missing required parameter: 'session'.", code="missing_required_parameter", param="session")
            for key in body:
                if key not in ("delegation", "triggers"):
                    raise ClientError(f"'session.{key}' cannot change after startup (only delegation and triggers update).",
                                      code="immutable_parameter", param=f"session.{key}")
            if body.get("triggers"):
                raise ClientError("Decisions triggers are not served here.", code="unsupported_value", param="session.triggers")
            if "delegation" in body:
                new = _delegation(_merged(body["delegation"], self.cfg.delegation), "session.delegation")
                if (new or {}).get("type") != (self.cfg.delegation or {}).get("type"):
                    raise ClientError("The delegation type cannot change after startup.", code="immutable_parameter", param="session.delegation.type")
                self.cfg.delegation = new
                self.delegation_updated()
            self.emit("session.updated", cid, session=self.resource())
        elif t == "session.close":
            self.closed_sent = True
            self.emit("session.closed", cid, reason="close_requested", session=self.resource(), usage=self.usage())
            return False
        elif t == "session.start":
            raise ClientError("The session has started already.", code="session_already_started", param="type")
        elif t in ("response.item.create", "response.create") and (self.cfg.delegation or {}).get("type") == "responses":
            await self.backend_event(t, msg, cid)
        elif isinstance(t, str) and t in UNSUPPORTED_EVENTS:
            raise ClientError(f"'{t}' needs {UNSUPPORTED_EVENTS[t]}, which this server does not run.", code="unsupported_event", param="type")
        else:
            raise ClientError(f"Invalid value: {str(t)[:64]!r}. Supported event types are the Live client events.", code="invalid_value", param="type")
        return True

    async def audio(self, raw: bytes) -> None:
        raise NotImplementedError

    async def context(self, kind: str, msg: Mapping[str, Any], cid: str | None) -> None:
        raise NotImplementedError

    def delegation_updated(self) -> None:
        """The delegation's settings changed (session.update)."""

    async def backend_event(self, t: str, msg: Mapping[str, Any], cid: str | None) -> None:
        raise ClientError(f"'{t}' needs Responses delegation.", code="unsupported_event", param="type")


class LiveSession(LiveBase):
    """The turn-taking engine: the voice pipeline's Realtime conversation."""

    def __init__(self, session: Session, conv: Conversation, cfg: LiveConfig) -> None:
        super().__init__(session, cfg)
        self.conv = conv
        self.delegations: dict[str, str] = {}  # delegation id (the call's id) -> the call item's id
        self.streamed: set[str] = set()  # input items whose transcript went out as deltas
        self.backend: Any = None  # protocols.live_responses.ResponsesBackend, with Responses delegation
        self.speak_task: asyncio.Task[None] | None = None  # an answer asked for once the one under way is over
        produce = conv.emit

        def emit(type: str, fence: Any = None, **data: Any) -> None:
            # a delegation starts when the talking model's call is made, not when its
            # event is written to a socket (there may be none: a detached session)
            produce(type, fence, **data)
            item = data.get("item") if type == "response.output_item.done" else None
            if isinstance(item, Mapping) and item.get("type") == "function_call" and item.get("name") == DELEGATE:
                self._delegated(item)

        conv.emit = emit  # type: ignore[method-assign]

    def delegation_updated(self) -> None:
        if self.backend is not None and self.cfg.delegation is not None and "_config" in self.cfg.delegation:
            self.backend.config = self.cfg.delegation["_config"]

    async def backend_event(self, t: str, msg: Mapping[str, Any], cid: str | None) -> None:
        if t == "response.item.create":
            self.backend.item_create(msg.get("item"), cid)
        else:
            self.backend.create()

    async def delegated_outcome(self, did: str, text: str) -> None:
        """A Responses delegation's outcome: the talking model's `delegate` call gets it,
        and it speaks once it is not already speaking."""
        self.conv.add_item(Item(new_id("item"), "", [], type="function_call_output", call_id=did, output=text))
        self.speak_next()

    def speak_next(self) -> None:
        """An answer now, or once the one under way is over (one asked answers all that
        was added meanwhile); a refusal (a rate limit, a stage down) is the client's error."""
        if self.speak_task is None or self.speak_task.done():
            self.speak_task = asyncio.get_running_loop().create_task(self._speak())

    async def _speak(self) -> None:
        conv = self.conv
        while conv.responses.active is not None:
            if not self.session.is_open:
                return
            await asyncio.sleep(0.05)
        try:
            await conv.responses.create(None)
        except OmniError as exc:
            if not exc.expose:
                log.exception("live session %s: an answer could not start", self.session.id)
            frame = error_frame(exc)
            self.emit("error", error=frame["error"])

    def translate(self, ev: SessionEvent) -> str | None:
        t, d = ev.type, ev.data
        if t == "response.output_audio.delta":
            return self._json("session.output_audio.delta", {"delta": base64.b64encode(d["delta"]).decode()})
        if t == "response.output_audio_transcript.delta" and d.get("delta"):
            now = self.now_ms()
            return self._json("session.output_transcript.delta", {"delta": d["delta"], "start_ms": now, "end_ms": now})
        if t == "conversation.item.input_audio_transcription.delta" and d.get("delta"):
            self.streamed.add(str(d.get("item_id")))
            now = self.now_ms()
            return self._json("session.input_transcript.delta", {"delta": d["delta"], "start_ms": now, "end_ms": now})
        if t == "conversation.item.input_audio_transcription.completed" and d.get("item_id") not in self.streamed and d.get("transcript"):
            now = self.now_ms()  # a batch transcript (Whisper at commit): one delta
            return self._json("session.input_transcript.delta", {"delta": d["transcript"], "start_ms": now, "end_ms": now})
        if t == "response.done":
            return self._json("session.usage.updated", {"usage": self.usage()})
        return None  # Realtime's own bookkeeping (items, speech_started, …) has no Live event

    def _delegated(self, item: Mapping[str, Any]) -> None:
        did = str(item.get("call_id"))
        self.delegations[did] = str(item.get("id"))
        try:
            task = str(json.loads(item.get("arguments") or "{}").get("task", ""))
        except (ValueError, AttributeError):
            task = str(item.get("arguments") or "")
        delegation: dict[str, Any] = {"id": did, "target": "client", "type": "delegation"}
        if self.backend is not None:
            delegation.update(target="responses", response_id=self.backend.start(did, task))
        self.emit("session.delegation.created", delegation=delegation, offset_ms=self.now_ms())
        # the task's text (delegation.created carries metadata only) follows as an info event
        self.emit("info", code="delegation.task", message=task)

    async def audio(self, raw: bytes) -> None:
        await self.conv.input.append_bytes(raw)

    async def context(self, kind: str, msg: Mapping[str, Any], cid: str | None) -> None:
        """instructions (developer context), thinking (silent), commentary (spoken next);
        with `delegation_id`, the app's answer to a delegated task."""
        content = _text(msg.get("content"), "content", 8000)
        did = msg.get("delegation_id")
        conv = self.conv
        start = self.now_ms()
        if did is not None:
            if self.backend is not None:
                raise ClientError("Delegation ids are not taken with Responses delegation (this server's chat LM answers the task).",
                                  code="invalid_value", param="delegation_id")
            if not isinstance(did, str) or did not in self.delegations:
                raise ClientError(f"No delegation {str(did)[:64]!r} in this session.", code="delegation_not_found", param="delegation_id")
            conv.add_item(Item(new_id("item"), "", [], type="function_call_output", call_id=did, output=content))
        else:
            label = {"instructions": "", "thinking": "(silent context, not to be read out) ", "commentary": "(tell the user) "}[kind]
            conv.add_item(Item(new_id("item"), "system", [{"type": "input_text", "text": label + content}]))
        self.emit(f"session.{kind}.appended", cid, start_ms=start, end_ms=self.now_ms())
        if kind == "commentary":
            self.speak_next()


class LiveModelSession(LiveBase):
    """The full-duplex engine (Moshi): audio in and out every frame, its text stream as
    the output transcript. It hears no text: appended context is refused."""

    USAGE_EVERY_FRAMES = 125  # a usage update every 10 s of the model's audio

    def __init__(self, session: Session, cfg: LiveConfig, conv: Any) -> None:
        super().__init__(session, cfg)
        self.conv = conv
        self.frames = 0

    def translate(self, ev: SessionEvent) -> str | None:
        from protocols.duplex.model import AUDIO_DELTA, TEXT_DELTA

        if ev.type == AUDIO_DELTA:
            self.frames += 1
            if self.frames % self.USAGE_EVERY_FRAMES == 0:
                self.emit("session.usage.updated", usage=self.usage())
            return self._json("session.output_audio.delta", {"delta": base64.b64encode(ev.data["delta"]).decode()})
        if ev.type == TEXT_DELTA and ev.data.get("delta"):
            now = self.now_ms()
            return self._json("session.output_transcript.delta", {"delta": ev.data["delta"], "start_ms": now, "end_ms": now})
        return None

    async def audio(self, raw: bytes) -> None:
        limits, principal = self.conv.sessions.rate_limits, self.session.principal
        if limits.limited(principal, "audio_seconds"):
            fmt = self.cfg.format
            await limits.take(principal, "audio_seconds", len(raw) / fmt.bytes_per_sample / fmt.rate)  # (RateLimited: the client's error)
        self.conv.audio_in(raw)

    async def context(self, kind: str, msg: Mapping[str, Any], cid: str | None) -> None:
        raise ClientError(f"{self.cfg.model} is a full-duplex speech model: it hears audio only, so session.{kind}.append cannot reach it.",
                          code="unsupported_event", param="type")


async def _await_start(sock: Socket, models: list[str], voices_of: Any) -> tuple[LiveConfig, str | None] | None:
    """The client's `session.start` (the first message): its config, or None when the
    socket closed first. Anything else first is refused with an `error` and the socket
    stays open for the start."""
    deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
    while True:
        try:
            data = await sock.receive_by(deadline)
        except asyncio.TimeoutError:
            raise ClientError(f"No 'session.start' within {START_TIMEOUT_S:.0f} s of connecting.", code="session_start_timeout") from None
        if data is None:
            return None
        msg: Any = None
        try:
            msg = load_json(data)
            if not isinstance(msg, dict):
                raise ClientError("Each event is a JSON object.", code="invalid_json")
            if msg.get("type") != "session.start":
                raise ClientError(f"'{str(msg.get('type'))[:64]}' before 'session.start': send session.start first and wait for session.started.",
                                  code="session_not_started", param="type")
            return parse_start(msg.get("session"), models, voices_of), _client_id(msg)
        except ClientError as exc:
            await sock.send_json(error_frame(exc, _client_id(msg)))


def _client_id(msg: Any) -> str | None:
    return msg.get("event_id") if isinstance(msg, dict) and isinstance(msg.get("event_id"), str) else None


def error_frame(exc: OmniError, client_event_id: str | None = None) -> dict[str, Any]:
    """An `error` event in Live's shape (for the socket before a session's events run)."""
    err = error_event(exc)["error"]
    return {"type": "error", "event_id": f"event_{secrets.token_hex(6)}", "client_event_id": client_event_id,
            "error": {"type": err["type"], "code": err.get("code") or "invalid_request", "message": err["message"], "param": err.get("param"),
                      "client_event_id": client_event_id}}


@dataclass
class Engine:
    """One engine behind `/v1/live/sessions`: the models it answers to, their voices
    (None: the model's own only), and how a started session opens on it (returns the
    session and its Live state, or raises a ClientError / SessionError)."""

    models: list[str]
    voices: Mapping[str, str] | None
    open: Any  # async (principal, LiveConfig) -> (Session, LiveBase)


class LiveRouter:
    """The Live route of one server: the engines its pipelines mount, chosen by
    `session.model` in `session.start` (the URL names no model)."""

    def __init__(self, sessions: SessionManager) -> None:
        self.sessions = sessions
        self.engines: list[Engine] = []

    def add(self, m: Mount, engine: Engine) -> None:
        first = not self.engines
        self.engines.append(engine)
        if first:
            m.websocket(PATH, self.serve, "OpenAI Live API (client.live.connect): the voice pipeline's turn-taking engine, "
                                          "and the full-duplex model where one is served")

    def models(self) -> list[str]:
        return [name for e in self.engines for name in e.models]

    def engine(self, model: str) -> Engine:
        return next(e for e in self.engines if model in e.models)

    async def serve(self, request: web.Request) -> web.StreamResponse:
        principal = principal_of(request).name
        sock = await accept(request)
        sessions = self.sessions
        if request.query.get("session_id"):
            return await self.rejoin(sock, request.query["session_id"], request.query.get("resume_token"), principal)
        while True:
            try:
                started = await _await_start(sock, self.models(), lambda model: self.engine(model).voices)
            except ClientError as exc:
                await sock.send_json(error_frame(exc))
                await sock.close(1008, exc.message[:120])
                return sock.ws
            if started is None:
                return sock.ws
            lcfg, cid = started
            try:
                session, ls = await self.engine(lcfg.model).open(principal, lcfg)
                break
            except ClientError as exc:  # a start the engine cannot run: told, and another start may follow
                await sock.send_json(error_frame(exc, cid))
            except SessionError as exc:  # refused by admission
                await sock.send_json(error_frame(exc, cid))
                await sock.close(exc.ws_close, exc.message[:120])
                return sock.ws
        ls.emit("session.started", cid, session=ls.resource())
        ls.emit("info", code="session.resume_token", message=await sessions.issue_resume_token(session))

        async def expire() -> None:
            await asyncio.sleep(MAX_SESSION_S)
            ls.closed_sent = True
            ls.emit("session.closed", reason="expired", session=ls.resource(), usage=ls.usage())
            await asyncio.sleep(0.2)
            await sessions.end(session, "expired")

        timer = asyncio.get_running_loop().create_task(expire())

        async def stop() -> None:
            timer.cancel()
            await asyncio.gather(timer, return_exceptions=True)

        session.add_finalizer(stop)
        return await self.attach(sock, session, ls)

    async def rejoin(self, sock: Socket, sid: str, token: str | None, principal: str) -> web.WebSocketResponse:
        """A dropped socket's session, re-attached (the SDK's reconnect with
        `?session_id=&resume_token=`): what it said while away is replayed."""
        sessions = self.sessions
        try:
            here = next((x for x in sessions.sessions() if x.id == sid), None)  # (a session moved here is adopted by the resume)
            if here is not None and (here.kept(LiveSession) or here.kept(LiveModelSession)) is None:
                raise ClientError(f"Session {sid} is not a Live session.", code="invalid_value", param="session_id")
            session = await sessions.resume(sid, token, principal)
            ls = session.kept(LiveSession) or session.kept(LiveModelSession)
            if ls is None:
                raise ClientError(f"Session {sid} is not a Live session.", code="invalid_value", param="session_id")
        except (SessionError, ClientError) as exc:
            await sock.send_json(error_frame(exc))
            await sock.close(1008, "resume refused")
            return sock.ws
        ls.emit("info", code="session.resumed", message=f"session {sid} resumed; {session.queued_events} events replayed")
        ls.emit("info", code="session.resume_token", message=await sessions.issue_resume_token(session))
        return await self.attach(sock, session, ls)

    async def attach(self, sock: Socket, session: Session, ls: LiveBase) -> web.WebSocketResponse:
        sessions = self.sessions
        gen = session.attachment

        async def on_message(data: str | bytes) -> bool:
            msg: Any = None
            try:
                msg = load_json(data)
                if not isinstance(msg, dict):
                    raise ClientError("Each event is a JSON object.", code="invalid_json")
                return await ls.handle(msg)
            except OmniError as exc:
                if not exc.expose:
                    raise
                frame = error_frame(exc, _client_id(msg))
                ls.emit("error", frame["client_event_id"], error=frame["error"])
                return True

        taken_over = False

        async def on_exit(why: str) -> None:
            nonlocal taken_over
            if session.is_open and not session.attached_as(gen):
                taken_over = True  # a resume took the session to another socket: it is that socket's now
                return
            if why == "client_left" and session.is_open:
                await sessions.detach(session.id)  # resumable for the manager's disconnect_grace_s
                return
            await sessions.end(session, {"client_closed": "close_requested", "session_ended": "ended"}.get(why, why))

        why = await serve_events(sock, session, ls.frame, on_message, on_exit)
        if taken_over:
            await sock.close(4000, "resumed on another connection")
            return sock.ws
        if why == "client_left":
            return sock.ws
        await close_attachment(sock, session, why)
        return sock.ws


_ROUTERS: dict[SessionManager, LiveRouter] = {}


def router(sessions: SessionManager) -> LiveRouter:
    r = _ROUTERS.get(sessions)
    if r is None:
        r = _ROUTERS[sessions] = LiveRouter(sessions)
    return r


def mount(m: Mount) -> None:
    """The voice pipeline's turn-taking engine (its conversation, as on /v1/realtime)."""
    sessions, pipeline, vad = m.sessions, m.pipeline, vad_of(m)

    async def open_session(principal: str, lcfg: LiveConfig) -> tuple[Session, LiveBase]:
        session = await sessions.open("realtime", pipeline.name, principal=principal)
        session.params["wire"] = "live"
        conv = Conversation(session, sessions, pipeline, ga=True, model=lcfg.model, vad=vad)
        try:
            conv.cfg = _conversation_config(conv, lcfg, pipeline)
        except BaseException:
            await sessions.end(session, "failed")
            raise
        ls = session.keep(LiveSession(session, conv, lcfg))
        if lcfg.delegation is not None and lcfg.delegation["type"] == "responses":
            from protocols.live_responses import ResponsesBackend

            ls.backend = ResponsesBackend(ls, sessions, pipeline, principal, lcfg.delegation["_config"])
        for it in lcfg.input:
            role = "system" if it["role"] == "developer" else it["role"]
            kind = "output_text" if role == "assistant" else "input_text"
            conv.add_item(Item(new_id("item"), role, [{"type": kind, "text": it["content"][0]["text"]}]))

        async def stop() -> None:
            if ls.speak_task is not None:
                ls.speak_task.cancel()
                await asyncio.gather(ls.speak_task, return_exceptions=True)
            if ls.backend is not None:
                await ls.backend.close()
            await conv.shutdown("session_ended")

        session.add_finalizer(stop)
        return session, ls

    router(sessions).add(m, Engine(list(pipeline.models), pipeline.voices, open_session))


def mount_duplex_model(m: Mount) -> None:
    """A full-duplex speech model (Moshi): listening and speaking at once, every frame."""
    from protocols.duplex.model import DuplexModel, open_conversation

    sessions, pipeline = m.sessions, m.pipeline
    m.processor(DuplexModel)  # the contract, checked at start-up
    pool = m.entry_pool

    async def open_session(principal: str, lcfg: LiveConfig) -> tuple[Session, LiveBase]:
        if lcfg.delegation is not None:
            raise ClientError(f"{lcfg.model} is a full-duplex speech model with no function calling: it cannot delegate; "
                              "omit 'session.delegation'.", code="unsupported_value", param="session.delegation")
        if lcfg.instructions or lcfg.input:
            raise ClientError(f"{lcfg.model} takes no text: omit 'session.instructions' and 'session.input'.", code="unsupported_value",
                              param="session.instructions" if lcfg.instructions else "session.input")
        session, conv = await open_conversation(sessions, pipeline.name, pool, "duplex", principal, lcfg.model)
        conv.set_formats(lcfg.format, lcfg.format)
        conv.binary_out = False
        ls = session.keep(LiveModelSession(session, lcfg, conv))
        return session, ls

    router(sessions).add(m, Engine(list(pipeline.models), None, open_session))


def _conversation_config(conv: Conversation, lcfg: LiveConfig, pipeline: Any) -> Config:
    """The Realtime conversation a Live session runs: semantic_vad turn-taking with
    barge-in, the startup audio format both ways, the voice, the frontend instructions,
    input transcription (streamed where the profile has a streaming ASR stage), and the
    `delegate` function when the app takes delegated tasks."""
    session = conv.session
    transcription = {"model": "gpt-4o-transcribe"} if session.serves("stt") else {"model": "whisper-1"} if session.serves("asr") else None
    body: dict[str, Any] = {
        "type": "realtime",
        "instructions": lcfg.instructions,
        "audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "auto", "interrupt_response": True, "create_response": True},
                            "transcription": transcription}},
        "tools": [DELEGATE_TOOL] if lcfg.delegation is not None else [],
    }
    try:
        cfg = apply_session_update(Config(model=pipeline.models[0]), body, pipeline.voices)
    except ClientError as exc:
        raise ClientError(exc.message, code=exc.code, param=f"session.{exc.param}" if exc.param else None) from None
    return replace(cfg, voice=lcfg.voice or cfg.voice, input_format=lcfg.format, output_format=lcfg.format)


__all__ = ["PATH", "LiveConfig", "LiveSession", "mount", "parse_start"]
