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

import numpy as np
import soxr
from pydantic import AfterValidator
from pydantic_core import PydanticCustomError

from media.audio_formats import Pcm16Resampler
from omni_rt.errors import ClientError
from protocols.realtime import RATE, Config, EventOutput, wire_data
from protocols.realtime.models import AudioIn, AudioInputIn, AudioOutputIn, SessionUpdate, apply_update, parse
from sessions import SessionEvent, SessionManager

if TYPE_CHECKING:
    from protocols.realtime import Conversation

AUDIO_FRAME = 0x01
RATES = (8000, 16000, 24000, 44100, 48000)
CHUNK_PERIOD_MS = 20  # the input frame period the server is tuned for (any length is accepted)
MAX_FRAME_BYTES = 1 << 20
AUDIO_DELTA = "response.output_audio.delta"
AUDIO_DONE = "response.output_audio.done"
# An audio event whose PCM is already at the output rate: the unsent rest of an answer
# a paced writer was cut off in (it is not resampled a second time on replay).
RENDERED_RATE = "_out_rate"


@dataclass(frozen=True)
class DuplexTiming:
    heartbeat_s: float = 5.0
    pacing_lead_s: float = 0.1  # paced audio is sent this far ahead of real time (network jitter)
    send_timeout_s: float = 10.0  # a paced send blocked this long: the client is not reading


def _pcm_rate(v: Any) -> int:
    if not isinstance(v, Mapping) or v.get("type", "audio/pcm") != "audio/pcm":
        raise PydanticCustomError("invalid_value", "Must be {type: audio/pcm, rate: N}.")
    rate = v.get("rate", RATE)
    if not isinstance(rate, int) or isinstance(rate, bool) or rate not in RATES:
        raise PydanticCustomError("invalid_value", f"Unsupported sample rate {rate!r}; use one of {', '.join(map(str, RATES))}.")
    return rate


PcmRate = Annotated[Any, AfterValidator(_pcm_rate)]


class DuplexInput(AudioInputIn):
    format: PcmRate | None = None


class DuplexOutput(AudioOutputIn):
    format: PcmRate | None = None
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
        self.in_rate = RATE
        self.out_rate = RATE
        self.binary_out = False
        self.paced = False  # session.audio.output.pacing: "realtime" sends audio as 20 ms frames in real time
        self._in_rs: soxr.ResampleStream | None = None
        self._out = Pcm16Resampler(RATE, self.out_rate)
        self.out_seq = 0  # server_event_seq: monotonic across attachments
        self.outbox: deque[SessionEvent] | None = None  # the attached writer's events not yet sent
        self.sending_audio = False  # the paced writer is sending one audio event's frames

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
            "heartbeat_s": self.timing.heartbeat_s,
            "replay_buffer_events": self.sessions.spec.replay_buffer_events,
            "disconnect_grace_s": self.sessions.spec.disconnect_grace_s,
        }

    def session_wire(self, conv: Conversation) -> dict[str, Any]:
        s = conv.cfg.wire(True, conv.session.id)
        s["audio"]["input"]["format"] = {"type": "audio/pcm", "rate": self.in_rate}
        s["audio"]["output"]["format"] = {"type": "audio/pcm", "rate": self.out_rate}
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
        inp = audio.input if audio is not None else None
        out = audio.output if audio is not None else None
        if inp is not None and inp.format is not None and inp.format != self.in_rate:
            self.in_rate, self._in_rs = inp.format, None
        if out is not None:
            if out.format is not None and out.format != self.out_rate:
                self.out_rate, self._out = out.format, Pcm16Resampler(RATE, out.format)
            if out.transport is not None:
                self.binary_out = out.transport == "binary"
            if out.pacing is not None:
                self.paced = out.pacing == "realtime"
        return cfg

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
        """A binary frame `[0x01][PCM16 LE mono]` at the declared input rate."""
        if len(frame) < 2 or frame[0] != AUDIO_FRAME:
            kind = f"0x{frame[0]:02x}" if frame else "empty"
            raise ClientError(f"Binary frames are [0x01][PCM16 audio]; got a {kind} frame of {len(frame)} bytes.", code="invalid_frame")
        if len(frame) - 1 > MAX_FRAME_BYTES:
            raise ClientError(f"An audio frame may carry at most {MAX_FRAME_BYTES} bytes.", code="invalid_frame")
        if (len(frame) - 1) % 2:
            raise ClientError("Audio frames carry 16-bit PCM: an even number of bytes after the type byte.", code="invalid_frame")
        pcm = np.frombuffer(frame, "<i2", offset=1).astype(np.float32) / 32768.0
        if self.in_rate != RATE:
            if self._in_rs is None:
                self._in_rs = soxr.ResampleStream(self.in_rate, RATE, 1, dtype="float32")
            pcm = self._in_rs.resample_chunk(pcm)
        await conv.input.append_pcm(pcm)

    # ---- events out ----------------------------------------------------------------------
    def out_audio(self, ev: SessionEvent) -> bytes:
        """An audio event's PCM at the output rate."""
        data = ev.data
        rendered = data.get(RENDERED_RATE)
        pcm: bytes = data["delta"]
        if rendered is None:
            return self._out.convert(data["response_id"], pcm)
        if rendered == self.out_rate:
            return pcm
        x = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0  # the rate changed since: one-off
        y = soxr.resample(x, rendered, self.out_rate)
        return (np.clip(y, -1, 1) * 32767).astype("<i2").tobytes()

    def tail(self, ev: SessionEvent) -> SessionEvent | None:
        """Before an answer's `response.output_audio.done`: the last few ms the output
        resampler still holds, as one more (already converted) audio event."""
        if ev.type != AUDIO_DONE:
            return None
        rest = self._out.finish(ev.data["response_id"])
        if not rest:
            return None
        ids = {k: ev.data[k] for k in ("response_id", "item_id", "output_index", "content_index", "epoch") if k in ev.data}
        return SessionEvent(AUDIO_DELTA, {**ids, "delta": rest, RENDERED_RATE: self.out_rate}, ev.fence, ev.seq)

    def frame(self, ev: SessionEvent) -> str | bytes:
        if ev.type == AUDIO_DELTA:
            return self.render(ev.type, {**ev.data, "delta": self.out_audio(ev)})
        return self.render(ev.type, ev.data)

    def render(self, type: str, data: Mapping[str, Any]) -> str | bytes:
        """One event on the wire (audio already at the output rate)."""
        self.out_seq += 1
        if type == AUDIO_DELTA and self.binary_out:
            return bytes([AUDIO_FRAME]) + data["delta"]
        fields = wire_data({k: v for k, v in data.items() if k != RENDERED_RATE})
        return json.dumps({"type": type, "event_id": f"event_{self.out_seq:06d}", "server_event_seq": self.out_seq, **fields})

    def direct(self, type: str, **data: Any) -> str:
        """An event sent on this socket only (not queued for replay)."""
        self.out_seq += 1
        return json.dumps({"type": type, "event_id": f"event_{self.out_seq:06d}", "server_event_seq": self.out_seq, **data})
