"""Where an answer's audio goes, and what the user heard of it.

A conversation talks to one `AudioOutput` (in the spirit of LiveKit's `AudioOutput`):
it pushes each chunk of an answer as it is generated, clears the output when the user
cuts in or the answer is cancelled, and learns from `clear` how much of each answer
that was cut the user had heard, so the conversation keeps exactly that. The one
definition of "heard" is the output's:

- `EventOutput` (the WebSocket wires): audio goes out as `response.output_audio.delta`
  events. On `/v1/realtime` the server cannot know what was played: the client says
  so with `conversation.item.truncate`, and `clear` reports nothing. With acks
  (`/v1/duplex`) the client reports what it played (`playback.ack`), and that is what
  was heard.
- the WebRTC call's track output (`protocols.webrtc`): the server plays the audio
  itself, so what it played is what was heard.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from media.wire_audio import OutputEncoder, WireFormat
from omni_rt.errors import ClientError
from omni_rt.payloads import Fence
from protocols.realtime.items import Response
from protocols.realtime.models import PCM24, RATE

RECENT_ANSWERS = 16  # answers whose heard position is kept (acks may trail the audio)


class AudioOutput(Protocol):
    def push(self, resp: Response, fence: Fence, pcm16: bytes) -> None:
        """One chunk of an answer: PCM16 LE mono at the model rate, in order."""
        ...

    def end(self, resp: Response, fence: Fence) -> None:
        """The answer's audio is complete (a resampling output flushes its tail)."""
        ...

    def clear(self) -> dict[str, int]:
        """Stop what is playing (barge-in, cancel). The answers that were cut, as their
        item id -> the milliseconds of it the user heard."""
        ...


@dataclass
class _Answer:
    item_id: str
    samples: int = 0  # produced, at the model rate
    heard_ms: int | None = None
    cut_ms: int | None = None  # cleared here: nothing after it will be played

    @property
    def produced_ms(self) -> int:
        ms = self.samples * 1000 // RATE
        return ms if self.cut_ms is None else min(ms, self.cut_ms)


class EventOutput:
    """Audio as session events. `emit` is the conversation's (dialect names, fences).
    With `fmt` (the session's output format, read at each chunk) the events carry the
    audio in that format (G.711 at 8 kHz: resampled per answer, its tail flushed at
    `end`); without it they carry PCM16 at the model rate and the transport converts."""

    def __init__(self, emit: Callable[..., None], acks: bool = False, fmt: Callable[[], WireFormat] | None = None) -> None:
        self.emit = emit
        self.acks = acks
        self.fmt = fmt
        self._enc: OutputEncoder | None = None
        self.answers: OrderedDict[str, _Answer] = OrderedDict()  # response id -> what was produced / heard

    def _encoded(self, resp: Response, pcm16: bytes) -> bytes:
        fmt = self.fmt() if self.fmt is not None else None
        if fmt is None or fmt == PCM24:
            return pcm16
        if self._enc is None or self._enc.fmt != fmt:
            self._enc = OutputEncoder(fmt, RATE)
        return self._enc.encode(resp.id, pcm16)

    def produced(self, resp: Response, pcm16: bytes) -> None:
        """Count a chunk of the answer (PCM16 at the model rate) as produced."""
        if self.acks:
            a = self.answers.get(resp.id)
            if a is None:
                a = self.answers[resp.id] = _Answer(resp.item.id)
                while len(self.answers) > RECENT_ANSWERS:
                    self.answers.popitem(last=False)
            a.samples += len(pcm16) // 2

    def push(self, resp: Response, fence: Fence, pcm16: bytes) -> None:
        self.produced(resp, pcm16)
        self.emit("response.audio.delta", fence, delta=self._encoded(resp, pcm16), **resp.ids)

    def end(self, resp: Response, fence: Fence) -> None:
        # an encoding output's resampler holds the answer's last few ms (a transport
        # that converts itself flushes at audio.done)
        tail = self._enc.finish(resp.id) if self._enc is not None else b""
        if tail:
            self.emit("response.audio.delta", fence, delta=tail, **resp.ids)

    def ack(self, response_id: Any, played_ms: Any) -> None:
        """`playback.ack`: the client has played `played_ms` of that answer."""
        if not isinstance(played_ms, int) or isinstance(played_ms, bool) or played_ms < 0:
            raise ClientError("'played_ms' must be a non-negative integer.", param="played_ms")
        a = self.answers.get(response_id) if isinstance(response_id, str) else None
        if a is None:
            raise ClientError(f"No response {response_id!r} with audio on this session.", code="response_not_found", param="response_id")
        a.heard_ms = max(a.heard_ms or 0, min(played_ms, a.produced_ms))

    def clear(self) -> dict[str, int]:
        cut: dict[str, int] = {}
        for a in self.answers.values():
            if a.heard_ms is not None and a.heard_ms < a.produced_ms:
                cut[a.item_id] = a.cut_ms = a.heard_ms  # the rest will not be played
        return cut
