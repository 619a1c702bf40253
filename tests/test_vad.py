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


def test_each_silero_detector_is_a_copy_with_a_state_of_its_own():
    """Detectors are copies of one loaded model: each keeps its own recurrent state
    (what one stream heard does not change another's probabilities) and a fresh copy
    answers as a freshly loaded model does."""
    import torch
    from silero_vad import load_silero_vad

    from protocols.realtime.vad import _load_silero

    rng = np.random.default_rng(0)
    speech = [torch.from_numpy(rng.standard_normal(512).astype(np.float32) * 0.3) for _ in range(6)]
    fresh = load_silero_vad()
    want = [float(fresh(x, 16000).detach()) for x in speech]
    a, b = _load_silero(), _load_silero()
    assert a is not b
    for x in speech[:3]:
        a(x, 16000)  # a hears something first
    got = [float(b(x, 16000).detach()) for x in speech]
    assert np.allclose(got, want, atol=1e-6)
    assert _load_silero() is not a
