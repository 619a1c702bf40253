"""`/v1/realtime`: the OpenAI Realtime protocol over WebSocket, on the voice pipeline.

Both dialects: GA (`client.realtime.connect`) and beta (`client.beta.realtime.connect`,
header `OpenAI-Beta: realtime=v1`). The dialect is fixed at connect time from that
header; every server event uses the dialect's names and session shape, and
`session.update` accepts either shape.

Each connection is one `realtime` session. The conversation (items, the encoded
embeddings of user audio, what the user heard of each answer) lives in the session.
User audio is encoded while it is appended (an encoder-only request per utterance);
a response is one request fenced by the session; cancel and barge-in advance the
session's epoch, so no delta of the old response goes out after `response.done`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
from aiohttp import web

from omni_rt import metrics
from omni_rt.errors import WS_POLICY_VIOLATION, ClientError, OmniError, RequestAborted
from omni_rt.payloads import Payload, PayloadKind
from omni_rt.request import RequestStream
from omni_rt.specs import PipelineSpec
from protocols.audio_formats import pcm16_bytes
from protocols.auth import principal_of
from protocols.errors import error_event, to_omni
from protocols.registry import Mount
from protocols.ws import DISCONNECTED, Socket, accept, numbered_json, reject, write_events
from sessions import Session, SessionError, SessionManager

log = logging.getLogger("protocols.realtime")

RATE = 24000
MAX_APPEND_BYTES = 15 * 1024 * 1024
MIN_COMMIT_MS = 100
AUDIO_PLACEHOLDER = "<|audio|>"

# beta name -> GA name, for the events whose names differ
GA_NAMES = {
    "response.audio.delta": "response.output_audio.delta",
    "response.audio.done": "response.output_audio.done",
    "response.audio_transcript.delta": "response.output_audio_transcript.delta",
    "response.audio_transcript.done": "response.output_audio_transcript.done",
    "response.text.delta": "response.output_text.delta",
    "response.text.done": "response.output_text.done",
    "conversation.item.created": "conversation.item.added",
}


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


# ---- session configuration ----------------------------------------------------------------


@dataclass
class TurnDetection:
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True

    def wire(self) -> dict[str, Any]:
        return {"type": "server_vad", **self.__dict__}


@dataclass
class Config:
    model: str
    voice: str = "alloy"
    instructions: str = ""
    audio_out: bool = True  # modalities include audio (else text only)
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    temperature: float = 0.8
    max_output_tokens: int | None = None
    speed: float = 1.0

    def wire(self, ga: bool, session_id: str) -> dict[str, Any]:
        td = self.turn_detection.wire() if self.turn_detection else None
        limit: Any = self.max_output_tokens if self.max_output_tokens is not None else "inf"
        if ga:
            fmt = {"type": "audio/pcm", "rate": RATE}
            return {
                "type": "realtime",
                "object": "realtime.session",
                "id": session_id,
                "model": self.model,
                "output_modalities": ["audio"] if self.audio_out else ["text"],
                "instructions": self.instructions,
                "audio": {
                    "input": {"format": fmt, "transcription": None, "noise_reduction": None, "turn_detection": td},
                    "output": {"format": fmt, "voice": self.voice, "speed": self.speed},
                },
                "tools": [],
                "tool_choice": "auto",
                "max_output_tokens": limit,
                "tracing": None,
                "truncation": "auto",
                "prompt": None,
                "include": None,
            }
        return {
            "id": session_id,
            "object": "realtime.session",
            "model": self.model,
            "modalities": ["text", "audio"] if self.audio_out else ["text"],
            "instructions": self.instructions,
            "voice": self.voice,
            "input_audio_format": "pcm16",
            "output_audio_format": "pcm16",
            "input_audio_transcription": None,
            "turn_detection": td,
            "tools": [],
            "tool_choice": "auto",
            "temperature": self.temperature,
            "max_response_output_tokens": limit,
            "speed": self.speed,
        }


def _want(obj: Mapping[str, Any], key: str, typ: type | tuple[type, ...], param: str) -> Any:
    v = obj[key]
    if not isinstance(v, typ) or (typ in (int, float, (int, float)) and isinstance(v, bool)):
        names = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
        raise ClientError(f"'{param}' must be {names}, got {type(v).__name__}.", code="invalid_type", param=param)
    return v


def _modalities(v: Any, param: str) -> bool:
    if not isinstance(v, list) or not v or not all(m in ("text", "audio") for m in v):
        raise ClientError(f"'{param}' must be a list of 'text' / 'audio'.", code="invalid_value", param=param)
    return "audio" in v


def _format(v: Any, param: str) -> None:
    ok = v == "pcm16" or (isinstance(v, Mapping) and v.get("type") == "audio/pcm" and v.get("rate", RATE) == RATE)
    if not ok:
        raise ClientError(f"Unsupported audio format {json.dumps(v)}; use pcm16 (audio/pcm at {RATE} Hz).", code="invalid_value", param=param)


def _turn_detection(v: Any, param: str, current: TurnDetection | None) -> TurnDetection | None:
    if v is None:
        return None
    if not isinstance(v, Mapping):
        raise ClientError(f"'{param}' must be an object or null.", code="invalid_type", param=param)
    if v.get("type", "server_vad") != "server_vad":
        raise ClientError(f"'{param}.type' {v.get('type')!r} is not supported; use server_vad or null.", code="invalid_value", param=f"{param}.type")
    td = TurnDetection(**(current.__dict__ if current else {}))
    for key, typ in (("threshold", (int, float)), ("prefix_padding_ms", int), ("silence_duration_ms", int)):
        if key in v:
            setattr(td, key, _want(v, key, typ, f"{param}.{key}"))
    for key in ("create_response", "interrupt_response"):
        if key in v:
            setattr(td, key, _want(v, key, bool, f"{param}.{key}"))
    if not 0.0 < td.threshold < 1.0:
        raise ClientError(f"'{param}.threshold' must be between 0 and 1.", code="invalid_value", param=f"{param}.threshold")
    if not 0 <= td.prefix_padding_ms <= 5000 or not 0 < td.silence_duration_ms <= 10000:
        raise ClientError(f"'{param}' padding/silence durations are out of range.", code="invalid_value", param=param)
    return td


def apply_session_update(cfg: Config, s: Mapping[str, Any], voices: Mapping[str, str]) -> Config:
    """Apply a session.update body (GA nested or beta flat shape) to a copy of `cfg`."""
    if not isinstance(s, Mapping):
        raise ClientError("'session' must be an object.", code="invalid_type", param="session")
    new = Config(**cfg.__dict__)
    if "voice" in s:
        new.voice = _voice(s["voice"], voices, "session.voice")
    if "instructions" in s:
        new.instructions = _want(s, "instructions", str, "session.instructions")
    for key in ("modalities", "output_modalities"):
        if key in s:
            new.audio_out = _modalities(s[key], f"session.{key}")
    for key in ("input_audio_format", "output_audio_format"):
        if key in s:
            _format(s[key], f"session.{key}")
    if "turn_detection" in s:
        new.turn_detection = _turn_detection(s["turn_detection"], "session.turn_detection", cfg.turn_detection)
    if "temperature" in s:
        new.temperature = _temperature(s["temperature"], "session.temperature")
    for key in ("max_response_output_tokens", "max_output_tokens"):
        if key in s:
            new.max_output_tokens = _max_tokens(s[key], f"session.{key}")
    audio = s.get("audio")
    if audio is not None:
        if not isinstance(audio, Mapping):
            raise ClientError("'session.audio' must be an object.", code="invalid_type", param="session.audio")
        inp, out = audio.get("input") or {}, audio.get("output") or {}
        if "format" in inp:
            _format(inp["format"], "session.audio.input.format")
        if "turn_detection" in inp:
            new.turn_detection = _turn_detection(inp["turn_detection"], "session.audio.input.turn_detection", cfg.turn_detection)
        if "format" in out:
            _format(out["format"], "session.audio.output.format")
        if "voice" in out:
            new.voice = _voice(out["voice"], voices, "session.audio.output.voice")
        if "speed" in out:
            new.speed = float(_want(out, "speed", (int, float), "session.audio.output.speed"))
    return new


def _voice(v: Any, voices: Mapping[str, str], param: str) -> str:
    if not isinstance(v, str) or v.lower() not in voices:
        raise ClientError(f"Unknown voice {v!r}; available: {', '.join(sorted(voices))}.", code="invalid_value", param=param)
    return v.lower()


def _temperature(v: Any, param: str) -> float:
    """OpenAI's realtime sampling temperature: a number in [0.6, 1.2]."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ClientError(f"Invalid type for '{param}': expected a decimal.", code="invalid_type", param=param)
    if not 0.6 <= float(v) <= 1.2:
        raise ClientError(f"Invalid '{param}': {v} is outside [0.6, 1.2].", code="invalid_value", param=param)
    return float(v)


def _max_tokens(v: Any, param: str) -> int | None:
    if v == "inf":
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 4096:
        raise ClientError(f"'{param}' must be an integer 1-4096 or 'inf'.", code="invalid_value", param=param)
    return v


# ---- voice activity detection -------------------------------------------------------------


class Vad:
    """silero-vad over 16 kHz windows of 512 samples, with OpenAI's server_vad knobs."""

    WINDOW = 512

    def __init__(self, model: Any) -> None:
        import soxr

        self.model = model
        self.resampler = soxr.ResampleStream(RATE, 16000, 1, dtype="float32")
        self.buf = np.zeros(0, np.float32)
        self.pos16 = 0  # 16 kHz samples consumed
        self.speaking = False
        self.silence = 0  # 16 kHz samples of silence since speech
        self.speech_start16 = 0

    def push(self, pcm: np.ndarray, td: TurnDetection) -> list[tuple[str, int]]:
        """Feed 24 kHz float audio; returns ("start"|"stop", ms) events in order."""
        import torch

        self.buf = np.concatenate([self.buf, self.resampler.resample_chunk(pcm)])
        events: list[tuple[str, int]] = []
        n = len(self.buf) // self.WINDOW
        if n == 0:
            return events
        with torch.inference_mode():
            for i in range(n):
                w = self.buf[i * self.WINDOW : (i + 1) * self.WINDOW]
                prob = float(self.model(torch.from_numpy(w), 16000))
                self.pos16 += self.WINDOW
                if not self.speaking and prob >= td.threshold:
                    self.speaking = True
                    self.silence = 0
                    self.speech_start16 = self.pos16 - self.WINDOW
                    events.append(("start", self.speech_start16 * 1000 // 16000))
                elif self.speaking:
                    if prob < max(td.threshold - 0.15, 0.01):
                        self.silence += self.WINDOW
                        if self.silence * 1000 // 16000 >= td.silence_duration_ms:
                            self.speaking = False
                            events.append(("stop", (self.pos16 - self.silence) * 1000 // 16000))
                    else:
                        self.silence = 0
        self.buf = self.buf[n * self.WINDOW :]
        return events


_VAD_LOCK = asyncio.Lock()


async def load_vad() -> Any:
    """A fresh silero-vad model (its recurrent state is per stream)."""

    def load() -> Any:
        import torch

        threads = torch.get_num_threads()
        from silero_vad import load_silero_vad

        model = load_silero_vad()
        torch.set_num_threads(threads)  # importing silero_vad sets it to 1 process-wide
        return model

    async with _VAD_LOCK:
        return await asyncio.to_thread(load)


# ---- one connection -----------------------------------------------------------------------


@dataclass
class Item:
    id: str
    role: str
    content: list[dict[str, Any]]
    status: str = "completed"
    embeds: "asyncio.Future[np.ndarray | None] | None" = None  # user audio, encoded
    audio_ms: int = 0  # assistant audio produced
    heard_ms: int | None = None  # of that, what the user acknowledged hearing (duplex)
    transcript: str = ""  # assistant text / transcript

    def wire(self, ga: bool) -> dict[str, Any]:
        content = []
        for c in self.content:
            c = dict(c)
            c.pop("_audio", None)
            if not ga and c.get("type") in ("output_audio", "output_text"):
                c["type"] = "audio" if c["type"] == "output_audio" else "text"
            content.append(c)
        return {"id": self.id, "object": "realtime.item", "type": "message", "role": self.role, "status": self.status, "content": content}

    def text_for_prompt(self) -> str:
        parts = []
        for c in self.content:
            t = c.get("type")
            if t in ("input_text", "text", "output_text"):
                parts.append(c.get("text") or "")
            elif t == "input_audio":
                parts.append(c.get("transcript") or AUDIO_PLACEHOLDER)
            elif t in ("output_audio", "audio"):
                parts.append(c.get("transcript") or "")
        return " ".join(p for p in parts if p)


@dataclass
class Response:
    id: str
    item: Item
    audio_out: bool
    stream: RequestStream | None = None
    task: "asyncio.Task[None] | None" = None
    cancel_reason: str | None = None
    started: float = field(default_factory=time.monotonic)
    epoch: int = 0


class RealtimeConnection:
    """The conversation logic of one realtime-style session, independent of the transport:
    everything it says goes out as session events (`session.emit`), which a transport
    writer (`send_events` here, `protocols.duplex`, `protocols.webrtc`) puts on
    its wire. Audio deltas carry raw PCM16 bytes; writers encode them for their wire."""

    # Response events get an `epoch` field (the duplex protocol's extension).
    tag_epochs = False

    def __init__(self, session: Session, sessions: SessionManager, pipeline: PipelineSpec, ga: bool, model: str) -> None:
        self.session = session
        self.sessions = sessions
        self.pipeline = pipeline
        self.ga = ga
        self.cfg = Config(model=model)
        self.items: dict[str, Item] = session.data.setdefault("items", {})  # the conversation
        self.response: Response | None = None
        # input audio buffer
        self.input: RequestStream | None = None
        self.input_item_id: str | None = None
        self.input_ms = 0  # audio appended since the buffer was last committed/cleared
        self.total_ms = 0  # all audio appended on this session
        self.pending_prefix: list[np.ndarray] = []
        self.vad: Vad | None = None
        self.speech_item: str | None = None
        self.collecting: set[asyncio.Task[None]] = set()

    # ---- output ----
    def name(self, beta_name: str) -> str:
        return GA_NAMES.get(beta_name, beta_name) if self.ga else beta_name

    def emit(self, type: str, fence: Any = None, **data: Any) -> None:
        if self.tag_epochs and type.startswith("response."):
            resp = self.response
            rid = data.get("response_id") or (data.get("response") or {}).get("id")
            data["epoch"] = resp.epoch if resp is not None and resp.id == rid else self.session.epoch
        self.session.emit(self.name(type), data, fence=fence)

    def error(self, err: OmniError, event_id: str | None = None) -> None:
        """A bad client event (or a refused one): an `error` event; the socket stays open."""
        self.session.emit("error", {"error": error_event(err, event_id)["error"]})

    async def shutdown(self, reason: str) -> None:
        """Stop this connection's work (the session is ending or the client left for good)."""
        try:
            if self.response is not None:
                await self.cancel_response(reason)
        except Exception:  # noqa: BLE001 - the rest is stopped regardless
            log.exception("session %s: cancelling the response failed", self.session.id)
        for task in self.collecting:
            task.cancel()
        if self.input is not None:
            await self.input.close()
            self.input = None

    # ---- conversation ----
    def add_item(self, item: Item, done: bool = True) -> None:
        """Append to the conversation. GA clients also get `conversation.item.done`
        (right away for finished items; for a response's item when it finishes)."""
        prev = next(reversed(self.items), None)
        self.items[item.id] = item
        self.emit("conversation.item.created", previous_item_id=prev, item=item.wire(self.ga))
        if self.ga and done:
            self.emit("conversation.item.done", previous_item_id=prev, item=item.wire(self.ga))

    def messages(self, instructions: str) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": instructions}] if instructions else []
        for it in self.items.values():
            text = it.text_for_prompt()
            if text:
                msgs.append({"role": it.role if it.role in ("user", "assistant", "system") else "user", "content": text})
        return msgs

    # ---- input audio ----
    def _start_input(self) -> None:
        # Not fenced: cancelling a response (a barge-in) must not drop what the user
        # is saying or has just committed; `clear` closes this request instead.
        stream = self.session.submit(outputs={"audio_encoder"}, fenced=False)
        self.input = stream
        self.input_item_id = _id("item")

    def _send_audio(self, pcm: np.ndarray) -> None:
        if self.input is None:
            self._start_input()
        assert self.input is not None
        self.session.send_input(self.input, Payload(PayloadKind.AUDIO, self.session.fence, arrays={"pcm": pcm}, meta={"sample_rate": RATE}))

    async def append(self, b64: Any, event_id: str | None) -> None:
        if not isinstance(b64, str):
            raise ClientError("'audio' must be a base64 string.", code="invalid_type", param="audio")
        if len(b64) > MAX_APPEND_BYTES * 4 // 3 + 4:
            raise ClientError(f"An append may carry at most {MAX_APPEND_BYTES} bytes of audio.", code="invalid_value", param="audio")
        try:
            raw = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise ClientError("'audio' is not valid base64.", code="invalid_value", param="audio") from None
        if len(raw) % 2:
            raise ClientError("'audio' must be 16-bit PCM: an even number of bytes.", code="invalid_value", param="audio")
        if not raw:
            return
        await self.append_pcm(np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0)

    async def append_pcm(self, pcm: np.ndarray) -> None:
        """Append float32 mono audio at the model rate (`RATE`)."""
        if not len(pcm):
            return
        ms = len(pcm) * 1000 // RATE
        td = self.cfg.turn_detection
        if td is None:
            self._send_audio(pcm)
            self.input_ms += ms
            self.total_ms += ms
            return
        # server VAD: keep the last prefix_padding_ms while silent; stream while speaking
        if self.vad is None:
            self.vad = Vad(await load_vad())
        events = await asyncio.to_thread(self.vad.push, pcm, td)
        self.total_ms += ms
        if self.input is not None:
            self._send_audio(pcm)
            self.input_ms += ms
        else:
            self.pending_prefix.append(pcm)
            keep = td.prefix_padding_ms * RATE // 1000
            joined = np.concatenate(self.pending_prefix)
            self.pending_prefix = [joined[-keep:]] if keep else []
        for kind, at_ms in events:
            if kind == "start":
                await self.speech_started(at_ms, td)
            else:
                await self.speech_stopped(at_ms, td)

    async def speech_started(self, at_ms: int, td: TurnDetection) -> None:
        barge_in = self.response is not None and td.interrupt_response
        if self.input is None:
            prefix = np.concatenate(self.pending_prefix) if self.pending_prefix else np.zeros(0, np.float32)
            self.pending_prefix = []
            self._start_input()
            if len(prefix):
                self._send_audio(prefix)
                self.input_ms += len(prefix) * 1000 // RATE
        self.speech_item = self.input_item_id
        self.emit("input_audio_buffer.speech_started", audio_start_ms=max(0, at_ms - td.prefix_padding_ms), item_id=self.input_item_id)
        if barge_in:
            # The user talks over the agent: the response stops here (its queued
            # deltas fail the fence check); the new utterance is re-encoded under the
            # new epoch.
            t0 = time.monotonic()
            await self.cancel_response("turn_detected")
            metrics.BARGE_IN_SECONDS.observe(time.monotonic() - t0)

    async def speech_stopped(self, at_ms: int, td: TurnDetection) -> None:
        self.emit("input_audio_buffer.speech_stopped", audio_end_ms=at_ms, item_id=self.input_item_id)
        await self.commit(None)
        if td.create_response:
            await self.create_response({}, None)

    async def commit(self, event_id: str | None) -> None:
        if self.input is None or self.input_ms < MIN_COMMIT_MS:
            raise ClientError(f"Error committing input audio buffer: buffer too small. Expected at least {MIN_COMMIT_MS}ms of audio, "
                f"but buffer only has {self.input_ms:.2f}ms of audio.", code="input_audio_buffer_commit_empty")
        stream, item_id = self.input, self.input_item_id
        assert item_id is not None
        self.input, self.input_item_id, self.input_ms = None, None, 0
        stream.end_input()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[np.ndarray | None] = loop.create_future()
        self.collecting.add(loop.create_task(self._collect(stream, fut)))
        for it in self.items.values():
            it.embeds = None  # only the latest utterance is spliced into prompts
        item = Item(item_id, "user", [{"type": "input_audio", "transcript": None}], embeds=fut)
        prev = next(reversed(self.items), None)
        self.emit("input_audio_buffer.committed", previous_item_id=prev, item_id=item_id)
        self.add_item(item)

    async def _collect(self, stream: RequestStream, fut: "asyncio.Future[np.ndarray | None]") -> None:
        chunks = []
        try:
            async for _, p, _ in stream.payloads():
                chunks.append(p.arrays["embeds"])
            fut.set_result(np.concatenate(chunks) if chunks else None)
        except Exception as exc:  # noqa: BLE001 - whoever waits must not wait forever
            if not fut.done():
                fut.set_exception(exc)
        finally:
            if not fut.done():
                fut.cancel()
            await asyncio.shield(stream.close())

    async def clear(self) -> None:
        if self.input is not None:
            await self.input.close()
        self.input, self.input_item_id, self.input_ms, self.pending_prefix = None, None, 0, []
        self.emit("input_audio_buffer.cleared")

    # ---- items ----
    async def item_create(self, ev: Mapping[str, Any]) -> None:
        item = ev.get("item")
        if not isinstance(item, Mapping):
            raise ClientError("Missing required parameter: 'item'.", code="missing_required_parameter", param="item")
        if item.get("type", "message") != "message":
            raise ClientError(f"Item type {item.get('type')!r} is not supported; use 'message'.", code="invalid_value", param="item.type")
        role = item.get("role")
        if role not in ("user", "assistant", "system"):
            raise ClientError("'item.role' must be user, assistant or system.", code="invalid_value", param="item.role")
        content = item.get("content")
        if not isinstance(content, list) or not content:
            raise ClientError("'item.content' must be a non-empty list.", code="invalid_value", param="item.content")
        parts: list[dict[str, Any]] = []
        audio: np.ndarray | None = None
        for i, c in enumerate(content):
            if not isinstance(c, Mapping):
                raise ClientError(f"'item.content[{i}]' must be an object.", code="invalid_type", param=f"item.content[{i}]")
            t = c.get("type")
            if t in ("input_text", "text", "output_text"):
                if not isinstance(c.get("text"), str):
                    raise ClientError(f"'item.content[{i}].text' must be a string.", code="invalid_type", param=f"item.content[{i}].text")
                parts.append({"type": t, "text": c["text"]})
            elif t == "input_audio" and role == "user":
                raw = c.get("audio")
                try:
                    data = base64.b64decode(raw, validate=True) if isinstance(raw, str) else None
                except (binascii.Error, ValueError):
                    data = None
                if data is None or len(data) % 2 or len(data) > MAX_APPEND_BYTES:
                    raise ClientError(f"'item.content[{i}].audio' must be base64 16-bit PCM.", code="invalid_value", param=f"item.content[{i}].audio")
                audio = np.frombuffer(data, "<i2").astype(np.float32) / 32768.0
                parts.append({"type": "input_audio", "transcript": c.get("transcript")})
            else:
                raise ClientError(f"Content type {t!r} is not supported for a {role} item.", code="invalid_value", param=f"item.content[{i}].type")
        item_id = item.get("id") if isinstance(item.get("id"), str) else _id("item")
        if item_id in self.items:
            raise ClientError(f"An item with id '{item_id}' already exists.", code="invalid_value", param="item.id")
        new = Item(item_id, role, parts)
        if audio is not None:
            stream = self.session.submit(outputs={"audio_encoder"}, fenced=False)
            self.session.send_input(stream, Payload(PayloadKind.AUDIO, self.session.fence, arrays={"pcm": audio}, meta={"sample_rate": RATE}))
            stream.end_input()
            fut: asyncio.Future[np.ndarray | None] = asyncio.get_running_loop().create_future()
            await self._collect(stream, fut)
            for it in self.items.values():
                it.embeds = None
            new.embeds = fut
        self.add_item(new)

    def item_delete(self, ev: Mapping[str, Any]) -> None:
        item_id = ev.get("item_id")
        if not isinstance(item_id, str) or item_id not in self.items:
            raise ClientError(f"Item with item_id '{item_id}' not found.", code="item_not_found", param="item_id")
        if self.response is not None and self.response.item.id == item_id:
            raise ClientError("The item of the active response cannot be deleted; cancel it first.", code="invalid_value", param="item_id")
        del self.items[item_id]
        self.emit("conversation.item.deleted", item_id=item_id)

    def item_truncate(self, ev: Mapping[str, Any]) -> None:
        item_id = ev.get("item_id")
        item = self.items.get(item_id) if isinstance(item_id, str) else None
        if item is None:
            raise ClientError(f"Item with item_id '{item_id}' not found.", code="item_not_found", param="item_id")
        if item.role != "assistant" or not any(c.get("type") in ("output_audio", "audio") for c in item.content):
            raise ClientError("Only assistant audio items can be truncated.", code="invalid_value", param="item_id")
        end = ev.get("audio_end_ms")
        if not isinstance(end, int) or isinstance(end, bool) or end < 0:
            raise ClientError("'audio_end_ms' must be a non-negative integer.", code="invalid_value", param="audio_end_ms")
        content_index = ev.get("content_index", 0)
        end = min(end, item.audio_ms)  # clamp: the client cannot have heard more than was sent
        # history keeps only what the user heard: the transcript up to that point
        full = item.transcript
        keep = full if item.audio_ms == 0 else full[: round(len(full) * end / item.audio_ms)]
        for c in item.content:
            if c.get("type") in ("output_audio", "audio"):
                c["transcript"] = keep
        self.emit("conversation.item.truncated", item_id=item_id, content_index=content_index, audio_end_ms=end)

    # ---- responses ----
    async def create_response(self, ev: Mapping[str, Any], event_id: str | None) -> None:
        if self.response is not None:
            raise ClientError(f"Conversation already has an active response in progress: {self.response.id}. "
                "Wait until the response is finished before creating a new one.", code="conversation_already_has_active_response")
        overrides = ev.get("response") or {}
        if not isinstance(overrides, Mapping):
            raise ClientError("'response' must be an object.", code="invalid_type", param="response")
        cfg = self.cfg
        audio_out = cfg.audio_out
        for key in ("modalities", "output_modalities"):
            if key in overrides:
                audio_out = _modalities(overrides[key], f"response.{key}")
        instructions = cfg.instructions
        if "instructions" in overrides:
            instructions = _want(overrides, "instructions", str, "response.instructions")
        voice = _voice(overrides["voice"], self.pipeline.voices, "response.voice") if "voice" in overrides else cfg.voice
        max_tokens = cfg.max_output_tokens
        for key in ("max_output_tokens", "max_response_output_tokens"):
            if key in overrides:
                max_tokens = _max_tokens(overrides[key], f"response.{key}")
        temperature = _temperature(overrides["temperature"], "response.temperature") if "temperature" in overrides else cfg.temperature
        part_type = "output_audio" if audio_out else "output_text"
        part0: dict[str, Any] = {"type": part_type, "transcript": ""} if audio_out else {"type": part_type, "text": ""}
        item = Item(_id("item"), "assistant", [part0], status="in_progress")
        resp = Response(_id("resp"), item, audio_out, epoch=self.session.epoch)
        # the latest user audio (if any) is spliced into the prompt at its placeholder
        embeds = None
        for it in reversed(self.items.values()):
            if it.embeds is not None:
                try:
                    embeds = await it.embeds
                except Exception:  # noqa: BLE001 - answer without the audio rather than not at all
                    embeds = None
                break
        params = {
            "messages": self.messages(instructions),
            "voice": self.pipeline.voices.get(voice, voice),
            "max_output_tokens": max_tokens,
            "temperature": temperature,
        }
        outputs = {"thinker", "code2wav"} if audio_out else {"thinker"}
        # The user's audio was encoded while it was appended: its embeddings go
        # straight to the thinker, which is this request's entry.
        resp.stream = self.session.submit(params, outputs=outputs, entry="thinker")
        self.response = resp
        try:
            if embeds is not None:
                self.session.send_input(resp.stream, Payload(PayloadKind.HIDDEN, self.session.fence, arrays={"embeds": embeds}))
            resp.stream.end_input()
        except BaseException:
            self.response = None
            await resp.stream.close()
            raise
        self.emit("response.created", response=self._response_wire(resp, "in_progress"))
        resp.task = asyncio.get_running_loop().create_task(self._run_response(resp))

    def _response_wire(self, resp: Response, status: str, details: Any = None, usage: Any = None) -> dict[str, Any]:
        out = {
            "id": resp.id,
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "output": [resp.item.wire(self.ga)] if status != "in_progress" else [],
            "usage": usage,
            "conversation_id": self.session.id,
            "metadata": None,
        }
        key = "output_modalities" if self.ga else "modalities"
        out[key] = (["audio"] if self.ga else ["text", "audio"]) if resp.audio_out else ["text"]
        return out

    async def _run_response(self, resp: Response) -> None:
        assert resp.stream is not None
        stream, item = resp.stream, resp.item
        fence = self.session.fence
        ids = {"response_id": resp.id, "item_id": item.id, "output_index": 0, "content_index": 0}
        status, details = "completed", None
        self.emit("response.output_item.added", response_id=resp.id, output_index=0, item=item.wire(self.ga))
        self.add_item(item, done=False)
        part = dict(item.content[0])
        if not self.ga:
            part["type"] = "audio" if resp.audio_out else "text"
        self.emit("response.content_part.added", part=part, **ids)
        text_delta = "response.audio_transcript.delta" if resp.audio_out else "response.text.delta"
        samples = 0
        first = True
        try:
            async for stage, payload, _ in stream.payloads():
                if stage == "thinker":
                    item.transcript += payload.text or ""
                    self.emit(text_delta, fence, delta=payload.text or "", **ids)
                else:
                    pcm = payload.arrays["pcm"]
                    samples += len(pcm)
                    item.audio_ms = samples * 1000 // RATE
                    data = pcm16_bytes(pcm)
                    if first:
                        metrics.TTFP_SECONDS.labels(api="realtime").observe(time.monotonic() - resp.started)
                        first = False
                    self.emit("response.audio.delta", fence, delta=data, **ids)
                self.session.touch()
        except RequestAborted:
            status, details = "cancelled", {"type": "cancelled", "reason": resp.cancel_reason or "client_cancelled"}
        except Exception as exc:  # noqa: BLE001 - the client always hears how its response ended
            if resp.cancel_reason is not None:
                status, details = "cancelled", {"type": "cancelled", "reason": resp.cancel_reason}
            else:
                err = to_omni(exc, f"response {resp.id}")
                status = "failed"
                details = {"type": "failed", "error": {"type": "server_error", "code": "generation_failed", "message": err.public_message()}}
        finally:
            await asyncio.shield(stream.close())
        if status == "completed" and resp.cancel_reason is not None:
            # cancelled while its last payloads were in flight: the stream may end
            # without raising (stale outputs are skipped), but the answer was cut
            status, details = "cancelled", {"type": "cancelled", "reason": resp.cancel_reason}
        usage = dict(stream.done.usage or {}) if stream.done is not None else {}
        n_in, n_audio = usage.get("input_tokens", 0), usage.get("input_audio_tokens", 0)
        usage = {
            "total_tokens": n_in + usage.get("output_tokens", 0),
            "input_tokens": n_in,
            "output_tokens": usage.get("output_tokens", 0),
            # audio tokens: the rows of the user's encoded speech in the prompt
            "input_token_details": {"text_tokens": n_in - n_audio, "audio_tokens": n_audio, "cached_tokens": 0},
        }
        c = item.content[0]
        if resp.audio_out:
            c["transcript"] = item.transcript
        else:
            c["text"] = item.transcript
        item.status = "completed" if status == "completed" else "incomplete"
        if status == "completed":
            if resp.audio_out:
                self.emit("response.audio.done", **ids)
                self.emit("response.audio_transcript.done", transcript=item.transcript, **ids)
            else:
                self.emit("response.text.done", text=item.transcript, **ids)
            done_part = dict(c)
            if not self.ga:
                done_part["type"] = "audio" if resp.audio_out else "text"
            self.emit("response.content_part.done", part=done_part, **ids)
        self.emit("response.output_item.done", response_id=resp.id, output_index=0, item=item.wire(self.ga))
        if self.ga and item.id in self.items:
            self.emit("conversation.item.done", previous_item_id=None, item=item.wire(self.ga))
        self.emit("response.done", response=self._response_wire(resp, status, details, usage))
        metrics.E2E_SECONDS.labels(api="realtime").observe(time.monotonic() - resp.started)
        if self.response is resp:
            self.response = None

    async def cancel_response(self, reason: str) -> None:
        resp = self.response
        if resp is None:
            return
        resp.cancel_reason = reason
        # Advance the epoch first: from here on nothing of this response passes a
        # fence check, then abort its stages.
        self.session.advance_epoch()
        if resp.stream is not None:
            await resp.stream.abort(reason)
        if resp.task is not None:
            await asyncio.shield(resp.task)

    # ---- dispatch ----
    async def handle(self, raw: str | bytes) -> None:
        event_id = None
        try:
            try:
                ev = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise ClientError("The event is not valid JSON.", code="invalid_json") from None
            if not isinstance(ev, dict):
                raise ClientError("An event must be a JSON object.", code="invalid_json")
            event_id = ev.get("event_id") if isinstance(ev.get("event_id"), str) else None
            t = ev.get("type")
            if not isinstance(t, str):
                raise ClientError("Missing required parameter: 'type'.", code="missing_required_parameter", param="type")
            self.session.touch()
            await self.dispatch(t, ev, event_id)
        except (ClientError, SessionError) as err:
            self.error(err, event_id)

    async def dispatch(self, t: str, ev: dict[str, Any], event_id: str | None) -> None:
        if t == "session.update":
            if "session" not in ev:
                raise ClientError("Missing required parameter: 'session'.", code="missing_required_parameter", param="session")
            self.cfg = apply_session_update(self.cfg, ev["session"], self.pipeline.voices)
            self.emit("session.updated", session=self.cfg.wire(self.ga, self.session.id))
        elif t == "input_audio_buffer.append":
            if "audio" not in ev:
                raise ClientError("Missing required parameter: 'audio'.", code="missing_required_parameter", param="audio")
            await self.append(ev["audio"], event_id)
        elif t == "input_audio_buffer.commit":
            await self.commit(event_id)
        elif t == "input_audio_buffer.clear":
            await self.clear()
        elif t == "conversation.item.create":
            await self.item_create(ev)
        elif t == "conversation.item.delete":
            self.item_delete(ev)
        elif t == "conversation.item.truncate":
            self.item_truncate(ev)
        elif t == "response.create":
            await self.create_response(ev, event_id)
        elif t == "response.cancel":
            if self.response is None:
                raise ClientError("Cancellation failed: no active response found.", code="response_cancel_not_active")
            await self.cancel_response("client_cancelled")
        else:
            raise ClientError(f"Invalid value: '{t}'. Supported event types are the Realtime client events.", code="invalid_value", param="type")


def wire_data(data: Mapping[str, Any]) -> dict[str, Any]:
    """Event data for a JSON wire: audio bytes become base64."""
    return {k: base64.b64encode(v).decode() if isinstance(v, (bytes, bytearray)) else v for k, v in data.items()}


def mount(m: Mount) -> None:
    sessions, pipeline = m.sessions, m.pipeline

    async def realtime(request: web.Request) -> web.StreamResponse:
        model = request.query.get("model") or pipeline.models[0]
        ga = "realtime=v1" not in (request.headers.get("openai-beta") or "")
        try:
            session = await sessions.open("realtime", pipeline.name, principal=principal_of(request).name)
        except SessionError as exc:
            return await reject(request, exc)
        conn = RealtimeConnection(session, sessions, pipeline, ga, model)
        sock: Socket | None = None
        writer: asyncio.Task[None] | None = None
        ended: asyncio.Future[Any] | None = None
        reason = "client_disconnected"
        try:
            sock = await accept(request)
            conn.emit("session.created", session=conn.cfg.wire(ga, session.id))
            writer = asyncio.get_running_loop().create_task(write_events(sock, session, numbered_json(wire_data)))
            ended = asyncio.ensure_future(session.closed.wait())
            while (data := await sock.receive(writer, ended)) is not None:
                if data:
                    await conn.handle(data)
            if writer.done() or ended.done():
                reason = "ended"
        except DISCONNECTED:
            pass
        except Exception as exc:  # noqa: BLE001 - a fault of ours: tell the client, close 1011
            err = to_omni(exc, f"realtime session {session.id}")
            reason = "server_error"
            if sock is not None:
                try:
                    await sock.send_json(error_event(err))
                except DISCONNECTED:
                    pass
                await sock.close(err.ws_close, "internal error")
        finally:
            if ended is not None:
                ended.cancel()
            await conn.shutdown("client_disconnected")
            await sessions.end(session, reason)
            if writer is not None:
                writer.cancel()
                await asyncio.gather(writer, return_exceptions=True)
            if sock is not None:
                await sock.close(WS_POLICY_VIOLATION if session.close_reason == "slow_consumer" else 1000, session.close_reason or "")
        return sock.ws if sock is not None else web.Response(status=500)

    m.websocket("/v1/realtime", realtime, "OpenAI Realtime (GA and beta)")
