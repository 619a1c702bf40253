"""The diffusers step engine on the tiny WanPipeline directory (Wan 2.1 layout, text to
video): equal to the pipeline's own __call__, batched == unbatched for the same seeds
(jobs started at different steps share forwards), progress, cancel between steps, and
the clips the family cannot make refused."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from omni_rt.engines.base import EngineError
from omni_rt.engines.diffusers_engine import DiffusersEngine, DiffusionJob


@pytest.fixture
async def engine(models_dir):
    eng = DiffusersEngine(str(models_dir / "tiny-wan"), name="wan", max_batch=8, max_sequence_length=32)
    await eng.start()
    yield eng
    await eng.stop()


async def clip_of(eng: DiffusersEngine, job: DiffusionJob) -> tuple[np.ndarray, list[dict]]:
    events = []
    async for ev in eng.generate(job):
        events.append(ev)
        if ev["type"] == "video":
            return ev["frames"], events
    raise AssertionError("no clip")


def _diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


async def test_a_clip_equals_the_pipelines_own_call(engine):
    assert engine.video and engine.size_multiple == 16 and engine.frame_multiple == 4
    clip, _ = await clip_of(engine, DiffusionJob("a red cup", 64, 96, 5, seed=7, frames=9))
    assert clip.shape == (9, 64, 96, 3) and clip.dtype == np.uint8
    ref = await asyncio.to_thread(
        lambda: engine.pipe("a red cup", height=64, width=96, num_frames=9, num_inference_steps=5, guidance_scale=1.0, max_sequence_length=32,
                            generator=torch.Generator().manual_seed(7), output_type="np").frames[0]
    )
    assert _diff((ref * 255).round(), clip) <= 1
    # classifier-free guidance with a negative prompt, as the pipeline does it
    clip2, _ = await clip_of(engine, DiffusionJob("a red cup", 64, 64, 4, seed=3, frames=5, guidance_scale=4.0, negative_prompt="blurry"))
    ref2 = await asyncio.to_thread(
        lambda: engine.pipe("a red cup", negative_prompt="blurry", height=64, width=64, num_frames=5, num_inference_steps=4, guidance_scale=4.0,
                            max_sequence_length=32, generator=torch.Generator().manual_seed(3), output_type="np").frames[0]
    )
    assert _diff((ref2 * 255).round(), clip2) <= 1


async def test_batched_equals_unbatched_and_late_jobs_join_running_steps(engine):
    jobs = [("a red cup", 1), ("a blue sea", 2), ("a red cup", 3)]
    alone = [(await clip_of(engine, DiffusionJob(p, 64, 64, 6, seed=s, frames=5)))[0] for p, s in jobs]
    steps0, rows0 = engine.steps, engine.rows

    async def late(i: int, p: str, s: int) -> np.ndarray:
        await asyncio.sleep(0.01 * i)  # started a step or two apart: each scheduler keeps its own state
        return (await clip_of(engine, DiffusionJob(p, 64, 64, 6, seed=s, frames=5)))[0]

    together = await asyncio.gather(*(late(i, p, s) for i, (p, s) in enumerate(jobs)))
    assert engine.rows - rows0 > engine.steps - steps0, "no forward carried more than one job"
    for a, b in zip(alone, together, strict=True):
        assert _diff(a, b) <= 1
    assert _diff(alone[0], alone[2]) > 10  # seeds matter


async def test_progress_is_monotonic_and_cancel_stops_between_steps(engine):
    _, events = await clip_of(engine, DiffusionJob("x", 64, 64, 4, seed=0, frames=5))
    assert [e["step"] for e in events if e["type"] == "progress"] == [1, 2, 3, 4]
    job = DiffusionJob("a long one", 64, 64, 200, seed=0, frames=9)
    gen = engine.generate(job)
    async for ev in gen:
        if ev["type"] == "progress" and ev["step"] >= 2:
            break
    await gen.aclose()
    await asyncio.sleep(0.3)
    stopped_at = job.step
    await asyncio.sleep(0.3)
    assert job.step == stopped_at < 200 and engine.load() == 0


async def test_clips_the_family_cannot_make_are_refused(engine):
    with pytest.raises(EngineError, match=r"4k\+1 frames"):
        await clip_of(engine, DiffusionJob("x", 64, 64, 2, seed=0, frames=8))
    with pytest.raises(EngineError, match="multiples of 16"):
        await clip_of(engine, DiffusionJob("x", 72, 64, 2, seed=0, frames=5))
    clip, _ = await clip_of(engine, DiffusionJob("still serving", 64, 64, 2, seed=0, frames=1))
    assert clip.shape == (1, 64, 64, 3)
