"""A voice-activity detector for tests: speech is audio louder than `level` (RMS over
10 ms windows), with the same server_vad rules (and the same `push`) as the real one,
so turn taking, barge-in and prefix padding run without a model."""

from __future__ import annotations

from typing import Any

import numpy as np

RATE = 24000
WINDOW = RATE // 100  # 10 ms


class EnergyVad:
    def __init__(self, level: float = 0.02) -> None:
        self.level = level
        self.buf = np.zeros(0, np.float32)
        self.pos = 0  # samples consumed
        self.speaking = False
        self.silence = 0  # samples of silence since speech

    def push(self, pcm: np.ndarray, td: Any) -> list[tuple[str, int]]:
        self.buf = np.concatenate([self.buf, pcm.astype(np.float32)])
        events: list[tuple[str, int]] = []
        n = len(self.buf) // WINDOW
        for i in range(n):
            w = self.buf[i * WINDOW : (i + 1) * WINDOW]
            loud = float(np.sqrt(np.mean(w * w))) >= self.level
            self.pos += WINDOW
            if not self.speaking and loud:
                self.speaking, self.silence = True, 0
                events.append(("start", (self.pos - WINDOW) * 1000 // RATE))
            elif self.speaking:
                if loud:
                    self.silence = 0
                else:
                    self.silence += WINDOW
                    if self.silence * 1000 // RATE >= td.silence_duration_ms:
                        self.speaking = False
                        events.append(("stop", (self.pos - self.silence) * 1000 // RATE))
        self.buf = self.buf[n * WINDOW :]
        return events


async def energy_vad() -> EnergyVad:
    """The `vad` mount option's factory."""
    return EnergyVad()
