"""The duplex transport plugged into a realtime conversation: declared audio rates both
ways, binary audio frames, optional real-time pacing, playback acks, the monotonic
`server_event_seq`, and the duplex session keys (`session.audio.*.format.rate`,
`session.audio.output.transport`, `session.audio.output.pacing`)."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator
from pydantic_core import PydanticCustomError

from media.audio_formats import pcm16_bytes
from media.wire_audio import G711_RATE, OutputEncoder, WireFormat, WireFormatError, decode_clip, encode_clip
from omni_rt.errors import ClientError
from protocols.realtime import RATE, Config, EventOutput, wire_data
from protocols.realtime.models import PCM24, AudioIn, AudioInputIn, AudioOutputIn, SessionUpdate, apply_update, parse
from sessions import SessionEvent, SessionManager

if TYPE_CHECKING:
    from protocols.realtime import Conversation

AUDIO_FRAME = 0x01
RATES = (8000, 16000, 24000, 44100, 48000)
CHUNK_PERIOD_MS = 20  # the input frame period the server is tuned for (any length is accepted)
MAX_FRAME_BYTES = 1 << 20
AUDIO_DELTA = "response.output_audio.delta"
AUDIO_DONE = "response.output_audio.done"
# An audio event already in the output format ("pcm16/24000", "pcmu/8000"): the unsent
# rest of an answer a paced writer was cut off in (not converted a second time on replay).
RENDERED = "_out_format"


def format_tag(fmt: WireFormat) -> str:
    return f"{fmt.encoding}/{fmt.rate}"


# what both /v1/duplex flavours take and send (session.capabilities)
INPUT_FORMATS = [{"type": t, "rates": list(RATES) if t == "audio/pcm" else [G711_RATE], "binary_frame_type": AUDIO_FRAME}
                 for t in ("audio/pcm", "audio/pcmu", "audio/pcma")]
OUTPUT_FORMATS = [{"type": t, "rates": list(RATES) if t == "audio/pcm" else [G711_RATE]} for t in ("audio/pcm", "audio/pcmu", "audio/pcma")]


@dataclass(frozen=True)
class DuplexTiming:
    heartbeat_s: float = 5.0
    pacing_lead_s: float = 0.1  # paced audio is sent this far ahead of real time (network jitter)
    send_timeout_s: float = 10.0  # a paced send blocked this long: the client is not reading


def _duplex_format(v: Any) -> WireFormat:
    """`{type: audio/pcm, rate}` (one of RATES; 24 kHz by default), `{type: audio/pcmu}` or
    `{type: audio/pcma}` (G.711 at 8 kHz): the GA shape only."""
    if not isinstance(v, Mapping):
        raise PydanticCustomError("invalid_value", "Must be {type: audio/pcm, rate: N}, {type: audio/pcmu} or {type: audio/pcma}.")
    try:
        return WireFormat.parse_realtime(v, (RATE, *(r for r in RATES if r != RATE)))
    except WireFormatError as exc:
        raise PydanticCustomError("invalid_value", str(exc)) from None


DuplexFormat = Annotated[Any, AfterValidator(_duplex_format)]


class DuplexInput(AudioInputIn):
    format: DuplexFormat | None = None


class DuplexOutput(AudioOutputIn):
    format: DuplexFormat | None = None
    transport: Literal["json", "binary"] | None = None
    pacing: Literal["none", "realtime"] | None = None


class DuplexAudio(AudioIn):
    input: DuplexInput | None = None
    output: DuplexOutput | None = None


class DuplexSessionUpdate(SessionUpdate):
    audio: DuplexAudio | None = None


class DuplexTransport:
    tag_epochs = True

    def __init__(self, conv_emit: Any, sessions: SessionManager, timing: DuplexTiming) -> None:
        self.output = EventOutput(conv_emit, acks=True)
        self.sessions = sessions
        self.timing = timing
        self.in_fmt = PCM24  # as the conversation's config says (its input decodes it)
        self.out_fmt = PCM24
        self.binary_out = False
        self.paced = False  # session.audio.output.pacing: "realtime" sends audio as 20 ms frames in real time
        self._out = OutputEncoder(self.out_fmt, RATE)
        self.out_seq = 0  # server_event_seq: monotonic across attachments
        self.outbox: deque[SessionEvent] | None = None  # the attached writer's events not yet sent
        self.sending_audio = False  # the paced writer is sending one audio event's frames

    # ---- session shape -----------------------------------------------------------------
    def capabilities(self) -> dict[str, Any]:
        return {
            "supports_barge_in": True,
            "supports_session_resume": True,
            "chunk_period_ms": CHUNK_PERIOD_MS,
            "input_formats": INPUT_FORMATS,
            "output_formats": OUTPUT_FORMATS,
            "output_transports": ["json", "binary"],
            "output_pacing": ["none", "realtime"],
            "heartbeat_s": self.timing.heartbeat_s,
            "replay_buffer_events": self.sessions.spec.replay_buffer_events,
            "disconnect_grace_s": self.sessions.spec.disconnect_grace_s,
        }

    def session_wire(self, conv: Conversation) -> dict[str, Any]:
        s = conv.cfg.wire(True, conv.session.id)
        s["audio"]["input"]["format"] = self.in_fmt.ga()
        s["audio"]["output"]["format"] = self.out_fmt.ga()
        s["audio"]["output"]["transport"] = "binary" if self.binary_out else "json"
        s["audio"]["output"]["pacing"] = "realtime" if self.paced else "none"
        s["capabilities"] = self.capabilities()
        return s

    def update_session(self, conv: Conversation, body: Any) -> Config:
        """The GA shape only (the beta format keys are refused), with the duplex keys."""
        if isinstance(body, Mapping):
            for key in ("input_audio_format", "output_audio_format"):
                if key in body:
                    raise ClientError(f"'session.{key}' is the beta shape; use session.audio.*.format.", param=f"session.{key}")
        update = parse(DuplexSessionUpdate, body, "session")
        cfg = apply_update(conv.cfg, update, conv.pipeline.voices)
        audio = update.audio
        out = audio.output if audio is not None else None
        self.set_formats(cfg.input_format, cfg.output_format)
        if out is not None:
            if out.transport is not None:
                self.binary_out = out.transport == "binary"
            if out.pacing is not None:
                self.paced = out.pacing == "realtime"
        return cfg

    def set_formats(self, in_fmt: WireFormat, out_fmt: WireFormat) -> None:
        self.in_fmt = in_fmt
        if out_fmt != self.out_fmt:
            self.out_fmt, self._out = out_fmt, OutputEncoder(out_fmt, RATE)

    @property
    def in_rate(self) -> int:
        return self.in_fmt.rate

    @property
    def out_rate(self) -> int:
        return self.out_fmt.rate

    async def on_event(self, conv: Conversation, type: str, ev: dict[str, Any], event_id: str | None) -> bool:
        if type == "playback.ack":
            self.output.ack(ev.get("response_id"), ev.get("played_ms"))
        elif type == "heartbeat":
            pass  # the conversation already counted it as activity
        elif type == "session.close":
            await self.sessions.end(conv.session, "client_closed")
        elif type == "session.resume":
            raise ClientError("session.resume must be the first event on a new connection.", param="type")
        else:
            return False
        return True

    # ---- audio in ------------------------------------------------------------------------
    async def audio_frame(self, conv: Conversation, frame: bytes) -> None:
        """A binary frame `[0x01][audio]` in the declared input format (PCM16 LE mono at
        its rate, or G.711 bytes at 8 kHz)."""
        if len(frame) < 2 or frame[0] != AUDIO_FRAME:
            kind = f"0x{frame[0]:02x}" if frame else "empty"
            raise ClientError(f"Binary frames are [0x01][audio]; got a {kind} frame of {len(frame)} bytes.", code="invalid_frame")
        if len(frame) - 1 > MAX_FRAME_BYTES:
            raise ClientError(f"An audio frame may carry at most {MAX_FRAME_BYTES} bytes.", code="invalid_frame")
        await conv.input.append_bytes(frame[1:])

    # ---- events out ----------------------------------------------------------------------
    def out_audio(self, ev: SessionEvent) -> bytes:
        """An audio event's audio in the output format."""
        data = ev.data
        rendered = data.get(RENDERED)
        pcm: bytes = data["delta"]
        if rendered is None:
            return self._out.encode(data["response_id"], pcm)
        if rendered == format_tag(self.out_fmt):
            return pcm
        # the format changed since it was rendered: once more from what it was rendered in
        enc, rate = str(rendered).split("/")
        was = WireFormat(enc, int(rate))  # type: ignore[arg-type]
        return encode_clip(self.out_fmt, pcm16_bytes(decode_clip(was, pcm, RATE)), RATE)

    def tail(self, ev: SessionEvent) -> SessionEvent | None:
        """Before an answer's `response.output_audio.done`: the last few ms the output
        resampler still holds, as one more (already converted) audio event."""
        if ev.type != AUDIO_DONE:
            return None
        rest = self._out.finish(ev.data["response_id"])
        if not rest:
            return None
        ids = {k: ev.data[k] for k in ("response_id", "item_id", "output_index", "content_index", "epoch") if k in ev.data}
        return SessionEvent(AUDIO_DELTA, {**ids, "delta": rest, RENDERED: format_tag(self.out_fmt)}, ev.fence, ev.seq)

    def frame(self, ev: SessionEvent) -> str | bytes:
        if ev.type == AUDIO_DELTA:
            return self.render(ev.type, {**ev.data, "delta": self.out_audio(ev)})
        return self.render(ev.type, ev.data)

    def render(self, type: str, data: Mapping[str, Any]) -> str | bytes:
        """One event on the wire (audio already at the output rate)."""
        self.out_seq += 1
        if type == AUDIO_DELTA and self.binary_out:
            return bytes([AUDIO_FRAME]) + data["delta"]
        fields = wire_data({k: v for k, v in data.items() if k != RENDERED})
        return json.dumps({"type": type, "event_id": f"event_{self.out_seq:06d}", "server_event_seq": self.out_seq, **fields})

    def direct(self, type: str, **data: Any) -> str:
        """An event sent on this socket only (not queued for replay)."""
        self.out_seq += 1
        return json.dumps({"type": type, "event_id": f"event_{self.out_seq:06d}", "server_event_seq": self.out_seq, **data})
