"""Earliest-deadline-first in the step engines that decode audio.

A streaming decoder gives each chunk the moment its listener's playback runs dry, and
a new stream's first chunk the moment its frames were ready plus a bounded budget;
the torch engine runs its queue earliest-due first. These tests hold the engine on a
gate item, queue work with known deadlines behind it, and check what order it runs
in, then replay that order with a nominal cost per item: with EDF every deadline that
can be met is met, while the older rule (every first chunk ahead of every running
stream) lets a running stream's playback run dry.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from omni_rt.engines.torch_engine import TorchEngine
from omni_rt.specs import ChunkingSpec
from pipelines.codec import SAMPLES_PER_FRAME
from pipelines.streaming import StreamingDecoder


class _Recorder(torch.nn.Module):
    """Identity; records each batch's first value (the item's id) and blocks on a gate
    for the item with id -1, so the test can fill the queue behind it."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[int] = []
        self.gate = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for v in x[:, 0].tolist():
            if v == -1:
                self.gate.wait(10)
            else:
                self.order.append(int(v))
        return x


async def _run_in_engine_order(items: Sequence[tuple[int, float | None, int]]) -> list[int]:
    """items: (id, deadline or None, priority). Returns the ids in the order run."""
    module = _Recorder()
    engine = TorchEngine(lambda: module, name="edf", max_batch=1, max_wait_ms=0.0)
    await engine.start()
    try:
        gate = asyncio.ensure_future(engine.run(np.array([-1.0], np.float32)))
        while engine._running == 0:  # the gate item is in the module
            await asyncio.sleep(0.001)
        runs = [asyncio.ensure_future(engine.run(np.array([float(i)], np.float32), priority=p, deadline=d)) for i, d, p in items]
        await asyncio.sleep(0.01)
        module.gate.set()
        await asyncio.gather(gate, *runs)
    finally:
        await engine.stop()
    return module.order


async def test_the_engine_runs_its_queue_earliest_deadline_first():
    now = time.monotonic()
    items = [(0, now + 3.0, 1), (1, now + 1.0, 1), (2, None, 0), (3, now + 2.0, 1), (4, now + 1.0, 1), (5, None, 1)]
    order = await _run_in_engine_order(items)
    # priority 0 without a deadline is due at once; equal deadlines keep arrival order;
    # priority 1 without a deadline is due default_slack_ms (250 ms) after it was queued
    assert order == [2, 5, 1, 4, 3, 0]


def test_the_decoder_dates_first_chunks_by_the_budget_and_later_ones_by_playback():
    now = [100.0]
    c = ChunkingSpec()
    dec = StreamingDecoder(lambda *a, **k: None, c, clock=lambda: now[0])  # type: ignore[arg-type]
    assert dec.deadline(0) == pytest.approx(100.0 + c.first_chunk_budget_ms / 1000)
    dec._play_end = 100.4  # 400 ms of audio left to play
    assert dec.deadline(5) == pytest.approx(100.4)
    now[0] = 101.0  # the stream is late: its chunk is overdue, so it runs first
    assert dec.deadline(5) < now[0]


async def test_decoder_windows_reach_the_engine_with_their_deadlines():
    now = [50.0]
    seen: list[float] = []

    async def decode(frames, deadline):
        seen.append(deadline)
        return np.zeros(len(frames) * SAMPLES_PER_FRAME, np.float32)

    c = ChunkingSpec(first_chunk_frames=1, chunk_frames=4, left_context_frames=0, lookahead_frames=0, refill_ms=0)
    dec = StreamingDecoder(decode, c, clock=lambda: now[0])
    await dec.push(np.zeros((1, 7), np.int32))  # first chunk: 1 frame, due at 50.2
    now[0] = 50.01
    await dec.push(np.zeros((4, 7), np.int32))  # next: due when the first frame has played
    frame_s = SAMPLES_PER_FRAME / 24000
    assert seen == [pytest.approx(50.0 + c.first_chunk_budget_ms / 1000), pytest.approx(50.0 + frame_s)]


def _misses(order: list[int], due: dict[int, float], start: float, cost: float) -> list[int]:
    """Replay an order one item at a time at `cost` seconds each: the items that finish late."""
    t = start
    late = []
    for i in order:
        t += cost
        if t > due[i] + 1e-9:
            late.append(i)
    return late


async def test_with_more_chunks_than_fit_at_once_edf_meets_every_deadline_that_can_be_met():
    """Eight running streams with 60..270 ms of audio left and four new streams whose
    first chunks are ready now; each decode costs 20 ms. The twelve chunks take 240 ms,
    more than the nearest playback lasts, but EDF meets every deadline (the first
    chunks inside their 200 ms budget), while running every first chunk first (the
    older rule) leaves the four streams closest to running dry without audio."""
    now = time.monotonic()
    cost = 0.02
    budget = ChunkingSpec().first_chunk_budget_ms / 1000
    running = {i: now + 0.06 + 0.03 * i for i in range(8)}  # streams 0..7: their playback ends
    first = {10 + j: now + budget for j in range(4)}  # new streams 10..13
    due = {**running, **first}
    items = [(i, d, 1) for i, d in running.items()] + [(i, d, 0) for i, d in first.items()]
    order = await _run_in_engine_order(items)
    assert _misses(order, due, now, cost) == []
    assert max(order.index(i) for i in first) * cost + cost <= budget  # no first chunk waited past its budget
    first_chunks_first = sorted(first) + sorted(running)
    assert _misses(first_chunks_first, due, now, cost) == [0, 1, 2, 3]
