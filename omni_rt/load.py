"""How loaded the serving path is: how fast it generates audio, as the streams
themselves see it, and how busy the machine's CPUs are with this server.

Each streaming audio decoder (`pipelines.tts.StreamingDecoder`) reports every chunk it
emits to `GENERATION`, a process-wide `RtfMeter`. A stream's generation real-time
factor is the wall time between its first and its latest chunk over the audio emitted
after the first chunk (the first chunk waits for its lookahead frames and would count
that wait twice): 0.5 means the stream is generated twice as fast as it plays, above
1 its listener hears holes. The meter keeps the streams that emitted within the last
`window_s`, and `worst()` is what load-aware admission reads: the slowest of them.

A robot reports each call instead (`sample`): the time its actions took to come back
over the time its previous chunk of actions lasts at its declared control rate, a
real-time factor of the same meaning (above 1 the robot runs out of actions before the
next chunk arrives); the worst of its calls in the window counts.

`CpuMeter` is the other half: the CPU time of this process and every process it
started (vLLM's engine cores and workers included) over the last `window_s`, as a
fraction of the CPUs this process may run on. Generation speed degrades gently until
the cores are saturated and then falls off a cliff (every stage waits for a core), so
admission also keeps this under a bound rather than trusting a straight-line fit of
the RTF up to the cliff.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["GENERATION", "CpuMeter", "RtfMeter", "StreamRtf", "tree_cpu_seconds"]


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
        self._samples: dict[int, deque[tuple[float, float]]] = {}  # streams that report their RTF directly
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

    def sample(self, key: int, rtf: float, now: float | None = None) -> None:
        """A stream that measures its own real-time factor (a robot's call)."""
        t = self.clock() if now is None else now
        with self._lock:
            self._samples.setdefault(key, deque()).append((t, rtf))
            self._expire(t)

    def _expire(self, now: float) -> None:
        old = [k for k, s in self._streams.items() if now - s.last_t > self.window_s]
        for k in old:
            del self._streams[k]
        for k, q in list(self._samples.items()):
            while q and now - q[0][0] > self.window_s:
                q.popleft()
            if not q:
                del self._samples[k]

    def rtfs(self, now: float | None = None) -> list[float]:
        """The RTF of every stream that emitted within the window (and has one); for a
        stream that samples its own, the worst sample of the window."""
        with self._lock:
            self._expire(self.clock() if now is None else now)
            return [r for s in self._streams.values() if (r := s.rtf) is not None] + [max(r for _, r in q) for q in self._samples.values()]

    def worst(self, now: float | None = None) -> float | None:
        r = self.rtfs(now)
        return max(r) if r else None

    def clear(self) -> None:
        with self._lock:
            self._streams.clear()
            self._samples.clear()


GENERATION = RtfMeter()


def tree_cpu_seconds(root: Any = None) -> float:
    """User + system CPU seconds of a process (a `psutil.Process`; default this one)
    and its live descendants."""
    import psutil

    me = root if root is not None else psutil.Process()
    try:
        procs = [me, *me.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class CpuMeter:
    """Busy fraction of this server's CPUs over the last `window_s` (None until two
    readings at least a second apart). A process that exits takes its CPU time with it:
    a reading that goes back is taken as a new start."""

    def __init__(
        self,
        window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        read: Callable[[], float] = tree_cpu_seconds,
        cpus: int | None = None,
    ) -> None:
        self.window_s = window_s
        self.clock = clock
        self.read = read
        self.cpus = cpus or usable_cpus()
        self._readings: deque[tuple[float, float]] = deque()

    def utilisation(self) -> float | None:
        t, cpu = self.clock(), self.read()
        if self._readings and cpu < self._readings[-1][1]:
            self._readings.clear()
        self._readings.append((t, cpu))
        while len(self._readings) > 2 and t - self._readings[1][0] >= self.window_s:
            self._readings.popleft()
        t0, c0 = self._readings[0]
        if t - t0 < 1.0:
            return None
        return (cpu - c0) / (t - t0) / self.cpus
