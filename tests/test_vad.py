"""Voice-activity detection: the silero detector's loading across event loops, and
the fake detector the in-process tests use."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from protocols.realtime import TurnDetection
from protocols.realtime.vad import silero_vad
from testkit import EnergyVad


def test_silero_detectors_load_from_several_event_loops_at_once():
    """Two loads wait on each other in one loop, then in another loop (an asyncio lock
    shared at module level binds to the first loop and fails in the second)."""
    errors: list[BaseException] = []

    def loop_of_two_loads() -> None:
        async def two() -> None:
            await asyncio.gather(silero_vad(), silero_vad())

        try:
            asyncio.run(two())
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    for _ in range(2):  # one loop after another, then two at the same time
        loop_of_two_loads()
    threads = [threading.Thread(target=loop_of_two_loads) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []


def test_energy_vad_follows_the_server_vad_rules():
    td = TurnDetection(silence_duration_ms=200)
    vad = EnergyVad()
    t = np.arange(24000) / 24000
    loud = (0.3 * np.sin(2 * np.pi * 220 * t[:12000])).astype(np.float32)  # 500 ms
    events = vad.push(np.zeros(4800, np.float32), td) + vad.push(loud, td) + vad.push(np.zeros(9600, np.float32), td)
    assert events == [("start", 200), ("stop", 700)]
