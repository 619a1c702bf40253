"""How fast the serving path generates audio, as the streams themselves see it.

Each streaming audio decoder (`pipelines.tts.StreamingDecoder`) reports every chunk it
emits to `GENERATION`, a process-wide `RtfMeter`. A stream's generation real-time
factor is the wall time between its first and its latest chunk over the audio emitted
after the first chunk (the first chunk waits for its lookahead frames and would count
that wait twice): 0.5 means the stream is generated twice as fast as it plays, above
1 its listener hears holes. The meter keeps the streams that emitted within the last
`window_s`, and `worst()` is what load-aware admission reads: the slowest of them.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["GENERATION", "RtfMeter", "StreamRtf"]


@dataclass
class StreamRtf:
    first_t: float
    last_t: float
    first_audio_s: float
    audio_s: float

    @property
    def rtf(self) -> float | None:
        after_first = self.audio_s - self.first_audio_s
        if after_first <= 0:
            return None
        return (self.last_t - self.first_t) / after_first


class RtfMeter:
    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._streams: dict[int, StreamRtf] = {}
        self._keys = itertools.count()
        self._lock = threading.Lock()

    def new_stream(self) -> int:
        return next(self._keys)

    def chunk(self, key: int, audio_s: float, now: float | None = None) -> None:
        t = self.clock() if now is None else now
        with self._lock:
            s = self._streams.get(key)
            if s is None:
                self._streams[key] = StreamRtf(t, t, audio_s, audio_s)
            else:
                s.last_t = t
                s.audio_s += audio_s
            self._expire(t)

    def _expire(self, now: float) -> None:
        old = [k for k, s in self._streams.items() if now - s.last_t > self.window_s]
        for k in old:
            del self._streams[k]

    def rtfs(self, now: float | None = None) -> list[float]:
        """The RTF of every stream that emitted within the window (and has one)."""
        with self._lock:
            self._expire(self.clock() if now is None else now)
            return [r for s in self._streams.values() if (r := s.rtf) is not None]

    def worst(self, now: float | None = None) -> float | None:
        r = self.rtfs(now)
        return max(r) if r else None

    def clear(self) -> None:
        with self._lock:
            self._streams.clear()


GENERATION = RtfMeter()
