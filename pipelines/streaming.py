"""Streaming audio decoding shared by the speech stages (the tts pipeline's code2wav, the
Qwen-Omni talkers' vocoders): `StreamingDecoder` turns a growing frame sequence into
audio chunks sized so that a listener playing them in real time does not run dry,
`DecodeTimes` keeps a stage's recent decode times (its streams share one), and
`AudioEmitter` emits the chunks as AUDIO payloads."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Awaitable, Callable

import numpy as np

from omni_rt.load import StreamMeter
from omni_rt.payloads import Payload, PayloadKind
from omni_rt.specs import ChunkingSpec
from omni_rt.stage import StageContext
from pipelines.codec import SAMPLE_RATE, SAMPLES_PER_FRAME

__all__ = ["AudioEmitter", "DecodeTimes", "StreamingDecoder", "audio_payload"]


class DecodeTimes:
    """How long a decoder stage's recent decodes took (its streams share one): the
    slowest of the last `n`, which a new stream's first chunk must outlast."""

    def __init__(self, n: int = 8) -> None:
        self._recent: deque[float] = deque(maxlen=n)

    def add(self, seconds: float) -> None:
        self._recent.append(seconds)

    def recent(self) -> float:
        return max(self._recent, default=0.0)


class StreamingDecoder:
    """Turns a growing frame sequence into audio chunks.

    With `chunking` (chunk edge): the first chunk is `first_chunk_frames`, later ones
    `chunk_frames`; each window also decodes `left_context_frames` already-emitted
    frames and waits for `lookahead_frames` future frames, and only the chunk's own
    samples are kept. With enough context on both sides (the decoder's receptive
    field) this equals decoding everything at once. Without chunking (batch edge):
    one decode at the end.

    Listeners play the audio in real time from its first chunk. A full `chunk_frames`
    after a short first chunk takes `chunk_frames / speed` frame periods to generate
    (`speed`: how much faster than real time the talker is), longer than the first
    chunk lasts when the talker is only a little faster than real time: the player
    would run dry once per answer. So the decoder keeps the time the audio emitted so
    far ends playing (`_play_end`, playback starting at each chunk's emission or when
    the one before it ends) and, once less than `refill_ms` of it is left, decodes the
    frames that are ready at once: chunks then grow by the speed factor, back up to
    `chunk_frames`. A talker slower than real time (playback already dry) gets full
    chunks: short ones would only multiply the decoding work of an overloaded stage.

    The first chunk is where a stream is most fragile: its audio is all a listener has
    while the next frame is made and decoded. With refill on, it holds at least
    `first_chunk_frames` and as many more as that takes: this stream's frame period so
    far plus the stage's recent decode time plus `jitter_ms`. On an idle stage that is
    one frame; on a busy one (frames every 65 ms, 40 ms decodes: measured with four
    answers starting together on 2 cores) a one-frame first chunk (85 ms) ran out
    before the second, every such answer opened with a hole.
    """

    def __init__(
        self,
        decode: Callable[..., Awaitable[np.ndarray]],
        chunking: ChunkingSpec | None,
        clock: Callable[[], float] = time.monotonic,
        meter: StreamMeter | None = None,
        samples_per_frame: int = SAMPLES_PER_FRAME,
        width: int = 7,
        decode_times: DecodeTimes | None = None,
    ) -> None:
        self._decode = decode
        self._decode_times = decode_times if decode_times is not None else DecodeTimes()
        self._first_t: float | None = None  # when this stream's first frames came
        self.samples_per_frame = samples_per_frame
        self._meter = meter  # told of every chunk emitted (load-aware admission reads it)
        self._meter_key = meter.new_stream() if meter is not None else 0
        self.chunking = chunking
        self._clock = clock
        self._play_end: float | None = None  # when the audio emitted so far has played (real time)
        self._buf = np.zeros((0, width), dtype=np.int32)  # frames of `width` codes
        self._base = 0  # absolute index of _buf[0]
        self.total = 0  # frames received
        self.emitted = 0  # frames whose audio has been produced

    def _append(self, frames: np.ndarray) -> None:
        if self._first_t is None:
            self._first_t = self._clock()
        self._buf = np.concatenate([self._buf, frames.astype(np.int32, copy=False)])
        self.total += len(frames)

    def first_chunk_frames(self, c: ChunkingSpec) -> int:
        """The first chunk's size (see the class): enough audio to outlast the making
        and decoding of the next frame."""
        if not c.refill_ms or self._first_t is None or self.total < 2:
            return c.first_chunk_frames
        period = (self._clock() - self._first_t) / (self.total - 1)
        need = period + self._decode_times.recent() + c.jitter_ms / 1000
        frame_s = self.samples_per_frame / SAMPLE_RATE
        return max(c.first_chunk_frames, min(c.chunk_frames, math.ceil(need / frame_s - 1e-9)))

    async def _window(self, start: int, end: int, keep_from: int, keep_to: int) -> np.ndarray:
        lo, hi = start - self._base, end - self._base
        t0 = self._clock()
        audio = await self._decode(np.ascontiguousarray(self._buf[lo:hi]), deadline=self.deadline(keep_from))
        self._decode_times.add(self._clock() - t0)
        a = (keep_from - start) * self.samples_per_frame
        b = (keep_to - start) * self.samples_per_frame
        if self._meter is not None:
            self._meter.chunk(self._meter_key, (keep_to - keep_from) * self.samples_per_frame / SAMPLE_RATE, self._clock())
        return audio[a:b]

    def deadline(self, keep_from: int) -> float:
        """When the window starting at frame `keep_from` is due (earliest deadline
        first in the decoder's engine): the first one `first_chunk_budget_ms` from now,
        a later one when the audio emitted so far has played (the listener's buffer
        runs dry), already past for a stream that is late."""
        now = self._clock()
        if keep_from == 0 or self._play_end is None:
            budget = self.chunking.first_chunk_budget_ms if self.chunking is not None else ChunkingSpec().first_chunk_budget_ms
            return now + budget / 1000
        return self._play_end

    def _trim(self) -> None:
        if self.chunking is None:
            return
        keep = max(0, self.emitted - self.chunking.left_context_frames)
        drop = keep - self._base
        if drop > 0:
            self._buf = self._buf[drop:]
            self._base = keep

    async def push(self, frames: np.ndarray) -> list[np.ndarray]:
        self._append(frames)
        out: list[np.ndarray] = []
        c = self.chunking
        if c is None:
            return out
        while True:
            ready = self.total - c.lookahead_frames - self.emitted  # frames whose lookahead is in
            size = self.first_chunk_frames(c) if self.emitted == 0 else c.chunk_frames
            if ready < size:
                if self.emitted == 0 or ready < 1 or not self._running_low(c):
                    break
                size = ready  # a short chunk now rather than a hole in the audio
            end = self.emitted + size
            start = max(0, self.emitted - c.left_context_frames)
            out.append(await self._window(start, end + c.lookahead_frames, self.emitted, end))
            now = self._clock()
            self._play_end = max(now, self._play_end if self._play_end is not None else now) + size * self.samples_per_frame / SAMPLE_RATE
            self.emitted = end
            self._trim()
        return out

    def _running_low(self, c: ChunkingSpec) -> bool:
        """Less than `refill_ms` of the emitted audio is left to play, and some is."""
        if not c.refill_ms or self._play_end is None:
            return False
        now = self._clock()
        return self._play_end - c.refill_ms / 1000 <= now < self._play_end

    async def finish(self) -> list[np.ndarray]:
        if self.emitted >= self.total:
            return []
        left = self.chunking.left_context_frames if self.chunking is not None else 0
        start = max(0, self.emitted - left)
        audio = await self._window(start, self.total, self.emitted, self.total)
        self.emitted = self.total
        return [audio]


def audio_payload(ctx: StageContext, audio: np.ndarray, start_sample: int) -> Payload:
    return Payload(
        PayloadKind.AUDIO,
        ctx.fence,
        arrays={"pcm": np.ascontiguousarray(audio, dtype=np.float32)},
        meta={"sample_rate": SAMPLE_RATE, "start_sample": start_sample},
    )


class AudioEmitter:
    """Emits a stream's audio chunks as AUDIO payloads, each stamped with the sample it
    starts at."""

    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.samples = 0

    async def __call__(self, chunks: list[np.ndarray]) -> None:
        for audio in chunks:
            if len(audio):
                await self.ctx.emit(audio_payload(self.ctx, audio, self.samples))
                self.samples += len(audio)
