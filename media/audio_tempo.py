"""Speech `speed`: tempo change without pitch change, streaming (FFmpeg's ``atempo``
through PyAV's filter graph)."""

from __future__ import annotations

import math
import numbers
from fractions import Fraction
from typing import Any

import numpy as np

from media.audio_formats import _AV_IMPORT_ERROR, _as_mono_float, av

__all__ = ["MAX_SPEED", "MIN_SPEED", "TempoFilter"]

MIN_SPEED = 0.25
MAX_SPEED = 4.0


class TempoFilter:
    """Change tempo by ``speed`` (0.25-4.0) without changing pitch, streaming.

    Uses FFmpeg's ``atempo`` (WSOLA) through ``av.filter.Graph``: ``process``
    pushes a chunk and returns whatever output is ready (atempo holds back
    ~30-65 ms of input: its overlap window plus one 20 ms sub-frame, so a very
    small first chunk may return nothing); ``flush`` drains the rest. Output
    length is ``len(input) / speed`` within about 2 %. ``speed == 1.0`` is a pass-through:
    ``process`` returns its input unchanged.
    """

    speed: float
    sample_rate: int
    _graph: Any  # av.filter.Graph while the stream runs
    _flushed: bool
    _pts: int

    def __init__(self, speed: float, sample_rate: int = 24000) -> None:
        if isinstance(speed, bool) or not isinstance(speed, numbers.Real):
            raise ValueError(f"speed must be a number between {MIN_SPEED} and {MAX_SPEED}, got {speed!r}")
        speed = float(speed)
        if not math.isfinite(speed) or not (MIN_SPEED <= speed <= MAX_SPEED):
            raise ValueError(f"speed must be between {MIN_SPEED} and {MAX_SPEED}, got {speed!r}")
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate <= 0:
            raise ValueError(f"sample_rate must be a positive int, got {sample_rate!r}")
        self.speed = speed
        self.sample_rate = sample_rate
        self._graph = None
        self._flushed = False
        self._pts = 0
        if speed != 1.0:
            if av is None:
                raise RuntimeError(f"speed != 1.0 needs PyAV: {_AV_IMPORT_ERROR}")
            self._build()

    def _build(self) -> None:
        # atempo takes 0.5..100 per instance; chain equal stages below 0.5.
        stages = 1
        while self.speed ** (1.0 / stages) < 0.5:
            stages += 1
        factor = self.speed ** (1.0 / stages)
        graph = av.filter.Graph()
        graph.threads = 1
        self._time_base = Fraction(1, self.sample_rate)
        nodes = [
            graph.add_abuffer(
                sample_rate=self.sample_rate, format="flt", layout="mono",
                time_base=self._time_base,
            )
        ]
        nodes += [graph.add("atempo", repr(factor)) for _ in range(stages)]
        nodes.append(graph.add("abuffersink"))
        graph.link_nodes(*nodes).configure()
        self._graph = graph
        self._block = max(1, self.sample_rate // 50)  # 20 ms sub-frames

    def _drain(self) -> np.ndarray:
        parts = []
        while True:
            try:
                frame = self._graph.pull()
            except BlockingIOError:  # av.error.BlockingIOError (EAGAIN): needs more input
                break
            except EOFError:  # av.error.EOFError: fully flushed
                break
            parts.append(frame.to_ndarray().reshape(-1))
        if not parts:
            return np.zeros(0, dtype=np.float32)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def process(self, pcm: np.ndarray) -> np.ndarray:
        """Push a float mono chunk; return the tempo-changed samples ready now."""
        if self._flushed:
            raise RuntimeError("TempoFilter.process() called after flush()")
        if self._graph is None:
            return pcm
        x = _as_mono_float(pcm)
        if x.size == 0:
            return np.zeros(0, dtype=np.float32)
        x = np.ascontiguousarray(x, dtype=np.float32)
        # atempo emits output for a frame only once the next frame arrives, so
        # pushing the chunk as one frame would hold all of it back until the
        # next call. Small sub-frames bound the hold-back to ~2 blocks.
        block = self._block
        for start in range(0, x.size, block):
            part = x[start:start + block]
            frame = av.AudioFrame.from_ndarray(part.reshape(1, -1), format="flt", layout="mono")
            frame.sample_rate = self.sample_rate
            frame.time_base = self._time_base
            frame.pts = self._pts
            self._pts += part.size
            self._graph.push(frame)
        return self._drain()

    def flush(self) -> np.ndarray:
        """Drain the filter at end of stream (idempotent)."""
        if self._flushed or self._graph is None:
            self._flushed = True
            return np.zeros(0, dtype=np.float32)
        self._flushed = True
        self._graph.push(None)
        out = self._drain()
        self._graph = None
        return out
