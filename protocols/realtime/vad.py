"""Voice-activity detection for server_vad turn taking.

A detector is fed 24 kHz float audio and answers speech start / stop events on the
audio timeline (ms), with OpenAI's server_vad knobs. `SileroVad` is the real one
(silero-vad over 16 kHz windows of 512 samples); tests plug in a fake with the same
`push` (`testkit.EnergyVad`) through the `vad` mount option.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import numpy as np

from protocols.realtime.models import RATE, TurnDetection


class VoiceActivity(Protocol):
    def push(self, pcm: np.ndarray, td: TurnDetection) -> list[tuple[str, int]]:
        """Feed 24 kHz float audio; ("start" | "stop", ms) events in order."""
        ...


VadFactory = Callable[[], Awaitable[VoiceActivity]]


class SileroVad:
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


# Loading silero-vad touches torch's process-wide thread setting: one load at a time.
# A thread lock, taken in the loading thread: an asyncio lock here would be shared by
# every event loop of the process and fail in all but the first that waited on it.
_LOAD_LOCK = threading.Lock()


_TEMPLATE: list[Any] = []  # the model as loaded, once per process (read only: sessions get copies)


def preload_silero() -> None:
    """Load the model in the background now (a server's start-up), not at the first
    session's open: the load holds the interpreter lock ~80 ms, stalling the loop."""
    threading.Thread(target=_load_silero, name="silero-preload", daemon=True).start()


def _load_silero() -> Any:
    """A detector of its own (its recurrent state is per stream): a copy of the model
    loaded once. Loading it (torch.jit.load) holds the interpreter lock ~80 ms, a copy
    ~7 ms: a session's open no longer stalls the loop that paces every other's audio."""
    import copy

    import torch

    with _LOAD_LOCK:
        if not _TEMPLATE:
            threads = torch.get_num_threads()
            from silero_vad import load_silero_vad

            _TEMPLATE.append(load_silero_vad())
            torch.set_num_threads(threads)  # importing silero_vad sets it to 1 process-wide
        model = copy.deepcopy(_TEMPLATE[0])
    model.reset_states()
    return model


async def silero_vad() -> VoiceActivity:
    """A fresh silero-vad detector (its recurrent state is per stream)."""
    return SileroVad(await asyncio.to_thread(_load_silero))
