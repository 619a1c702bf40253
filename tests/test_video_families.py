"""The diffusers step engine on the tiny video families (a WanPipeline directory, Wan
2.1's layout, and an LTXPipeline directory, LTX-Video's): equal to the pipeline's own
__call__, batched == unbatched for the same seeds (jobs started at different steps
share forwards), progress, cancel between steps, and the clips a family cannot make
refused."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from omni_rt.engines.base import EngineError
from omni_rt.engines.diffusers_engine import DiffusersEngine, DiffusionJob
from testkit.diffusion import staggered

pytestmark = pytest.mark.integration  # diffusers pipelines on the tiny checkpoints

# directory, the size multiple, frames are multiple·k + 1, a valid clip, an invalid frame count
FAMILIES = {
    "wan": ("tiny-wan", 16, 4, (64, 96, 9), 8),
    "ltx": ("tiny-ltx", 32, 8, (64, 96, 17), 12),
}


@pytest.fixture(params=sorted(FAMILIES))
async def engine(request, models_dir):
    d = FAMILIES[request.param]
    eng = DiffusersEngine(str(models_dir / d[0]), name=request.param, max_batch=8, max_sequence_length=32)
    await eng.start()
    eng.case = d  # type: ignore[attr-defined]
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
    _dir, mult, fmult, (h, w, f), _bad = engine.case
    assert engine.video and engine.size_multiple == mult and engine.frame_multiple == fmult
    clip, _ = await clip_of(engine, DiffusionJob("a red cup", h, w, 5, seed=7, frames=f, fps=24))
    assert clip.shape == (f, h, w, 3) and clip.dtype == np.uint8
    extra = {"frame_rate": 24} if engine.name == "ltx" else {}
    ref = await asyncio.to_thread(
        lambda: engine.pipe("a red cup", height=h, width=w, num_frames=f, num_inference_steps=5, guidance_scale=1.0, max_sequence_length=32,
                            generator=torch.Generator().manual_seed(7), output_type="np", **extra).frames[0]
    )
    assert _diff((ref * 255).round(), clip) <= 1
    # classifier-free guidance with a negative prompt, as the pipeline does it
    clip2, _ = await clip_of(engine, DiffusionJob("a red cup", h, h, 4, seed=3, frames=1 + fmult, guidance_scale=4.0, negative_prompt="blurry"))
    ref2 = await asyncio.to_thread(
        lambda: engine.pipe("a red cup", negative_prompt="blurry", height=h, width=h, num_frames=1 + fmult, num_inference_steps=4, guidance_scale=4.0,
                            max_sequence_length=32, generator=torch.Generator().manual_seed(3), output_type="np").frames[0]
    )
    assert _diff((ref2 * 255).round(), clip2) <= 1


async def test_batched_equals_unbatched_and_late_jobs_join_running_steps(engine):
    jobs = [("a red cup", 1), ("a blue sea", 2), ("a red cup", 3)]
    f = 1 + engine.case[2]
    alone = [(await clip_of(engine, DiffusionJob(p, 64, 64, 12, seed=s, frames=f)))[0] for p, s in jobs]
    steps0, rows0 = engine.steps, engine.rows
    together = await staggered(engine, [DiffusionJob(p, 64, 64, 12, seed=s, frames=f) for p, s in jobs])
    assert engine.rows - rows0 > engine.steps - steps0, "no forward carried more than one job"
    for a, b in zip(alone, together, strict=True):
        assert _diff(a, b) <= 1
    assert _diff(alone[0], alone[2]) > 10  # seeds matter


async def test_progress_is_monotonic_and_cancel_stops_between_steps(engine):
    _, events = await clip_of(engine, DiffusionJob("x", 64, 64, 4, seed=0, frames=1 + engine.case[2]))
    assert [e["step"] for e in events if e["type"] == "progress"] == [1, 2, 3, 4]
    job = DiffusionJob("a long one", 64, 64, 200, seed=0, frames=1 + 2 * engine.case[2])
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
    _dir, mult, fmult, _ok, bad = engine.case
    with pytest.raises(EngineError, match=rf"{fmult}k\+1 frames"):
        await clip_of(engine, DiffusionJob("x", 64, 64, 2, seed=0, frames=bad))
    with pytest.raises(EngineError, match=f"multiples of {mult}"):
        await clip_of(engine, DiffusionJob("x", mult + 8, 64, 2, seed=0, frames=1))
    clip, _ = await clip_of(engine, DiffusionJob("still serving", 64, 64, 2, seed=0, frames=1))
    assert clip.shape == (1, 64, 64, 3)


async def test_diffusers_first_block_cache_as_an_engine_arg(models_dir):
    """threshold 0 never skips (the same clip as without the cache); a huge one skips
    every forward after the first (a different clip); jobs joining and leaving a cached
    batch restart it from a full forward instead of failing on a stale cache."""
    clips = {}
    for threshold in (None, 0.0, 1e9):
        cache = None if threshold is None else {"type": "first_block", "threshold": threshold}
        eng = DiffusersEngine(str(models_dir / "tiny-wan"), name="wan", max_sequence_length=32, cache=cache)
        await eng.start()
        try:
            clips[threshold] = (await clip_of(eng, DiffusionJob("a red cup", 64, 64, 8, seed=5, frames=5)))[0]
            if threshold == 1e9:
                async def late(i: int, eng: DiffusersEngine = eng) -> np.ndarray:
                    await asyncio.sleep(0.005 * i)
                    return (await clip_of(eng, DiffusionJob("a cup", 64, 64 + 16 * (i % 2), 6, seed=i, frames=5)))[0]

                got = await asyncio.gather(*(late(i) for i in range(4)))
                assert [g.shape for g in got] == [(5, 64, 64 + 16 * (i % 2), 3) for i in range(4)]
        finally:
            await eng.stop()
    assert _diff(clips[None], clips[0.0]) == 0
    assert _diff(clips[None], clips[1e9]) > 0
    with pytest.raises(ValueError, match="cache.type"):
        DiffusersEngine(str(models_dir / "tiny-wan"), cache={"type": "teacache"})


async def test_jobs_one_step_apart_share_a_decode(engine):
    """A job that finishes while another of its shape is one step from its end waits
    that step and is decoded with it; a job no one is close behind is decoded at once."""
    f = 1 + engine.case[2]
    sizes: list[int] = []
    decode = engine._decode

    def counted(jobs: list[DiffusionJob]) -> list[np.ndarray]:
        sizes.append(len(jobs))
        return decode(jobs)

    engine._decode = counted
    specs = [(6, 1), (7, 2), (8, 3)]  # started together: each ends one step after the one before
    alone = [(await clip_of(engine, DiffusionJob("a red cup", 64, 64, n, seed=s, frames=f)))[0] for n, s in specs]
    assert sizes == [1, 1, 1]
    sizes.clear()
    pair = await asyncio.gather(*(clip_of(engine, DiffusionJob("a red cup", 64, 64, n, seed=s, frames=f)) for n, s in specs[:2]))
    assert sizes == [2], "the job one step behind did not share the first one's decode"
    # held once only: of three jobs each one step behind the last, the third is decoded alone
    sizes.clear()
    three = await asyncio.gather(*(clip_of(engine, DiffusionJob("a red cup", 64, 64, n, seed=s, frames=f)) for n, s in specs))
    assert sizes == [2, 1]
    for a, (b, _) in zip(alone, [*pair, three[2]], strict=True):
        assert _diff(a, b) <= 1


async def test_prompt_encodings_are_kept(models_dir):
    """A prompt asked for again is not encoded again (the last `prompt_cache` kept, the
    least recently used out); kept and fresh encodings give the same clip."""
    eng = DiffusersEngine(str(models_dir / "tiny-wan"), name="wan", max_sequence_length=32, prompt_cache=2)
    await eng.start()
    try:
        assert eng.family is not None
        encoded: list[list[str]] = []
        encode = eng.family.encode

        def counted(prompts: list[str]) -> list[tuple[torch.Tensor, ...]]:
            encoded.append(list(prompts))
            return encode(prompts)

        eng.family.encode = counted  # type: ignore[method-assign]
        first = (await clip_of(eng, DiffusionJob("a red cup", 64, 64, 2, seed=1, frames=5)))[0]
        again = (await clip_of(eng, DiffusionJob("a red cup", 64, 64, 2, seed=1, frames=5)))[0]
        assert encoded == [["a red cup"]] and _diff(first, again) == 0
        # guidance: the prompt is kept, its negative prompt is new
        await clip_of(eng, DiffusionJob("a red cup", 64, 64, 2, seed=1, frames=5, guidance_scale=3.0, negative_prompt="blurry"))
        assert encoded[1:] == [["blurry"]]
        await clip_of(eng, DiffusionJob("a blue sea", 64, 64, 2, seed=1, frames=5))  # evicts "a red cup", the least recently used
        await clip_of(eng, DiffusionJob("a red cup", 64, 64, 2, seed=1, frames=5))
        assert encoded[2:] == [["a blue sea"], ["a red cup"]] and list(eng._prompts) == ["a blue sea", "a red cup"]
    finally:
        await eng.stop()
    with pytest.raises(ValueError, match="prompt_cache"):
        DiffusersEngine(str(models_dir / "tiny-wan"), prompt_cache=-1)
