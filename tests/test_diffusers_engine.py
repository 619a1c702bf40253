"""The diffusers step engine on the tiny FluxPipeline directory: equal to the
pipeline's own __call__, batched == unbatched, progress, previews, cancel between
steps, refusals."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from omni_rt.engines.base import EngineError
from omni_rt.engines.diffusers_engine import DiffusersEngine, DiffusionJob

pytestmark = pytest.mark.integration  # diffusers pipelines on the tiny checkpoints


@pytest.fixture
async def engine(models_dir):
    eng = DiffusersEngine(str(models_dir / "tiny-flux-image"), name="dit", max_batch=8, max_sequence_length=64)
    await eng.start()
    yield eng
    await eng.stop()


async def image_of(eng: DiffusersEngine, job: DiffusionJob) -> tuple[np.ndarray, list[dict]]:
    events = []
    async for ev in eng.generate(job):
        events.append(ev)
        if ev["type"] == "image":
            return ev["image"], events
    raise AssertionError("no image")


async def test_engine_equals_the_pipelines_own_call(engine):
    img, _ = await image_of(engine, DiffusionJob("a red cat", 128, 192, 6, seed=11))
    assert img.shape == (128, 192, 3) and img.dtype == np.uint8
    ref = await asyncio.to_thread(
        lambda: engine.pipe("a red cat", num_inference_steps=6, height=128, width=192, max_sequence_length=64,
                            generator=torch.Generator().manual_seed(11), output_type="np").images[0]
    )
    assert np.abs((ref * 255).round().astype(int) - img.astype(int)).max() <= 1
    # with classifier-free guidance (the pipeline's true CFG)
    img2, _ = await image_of(engine, DiffusionJob("a red cat", 128, 128, 4, seed=2, guidance_scale=3.0, negative_prompt="blurry"))
    ref2 = await asyncio.to_thread(
        lambda: engine.pipe("a red cat", negative_prompt="blurry", true_cfg_scale=3.0, num_inference_steps=4, height=128, width=128,
                            max_sequence_length=64, generator=torch.Generator().manual_seed(2), output_type="np").images[0]
    )
    assert np.abs((ref2 * 255).round().astype(int) - img2.astype(int)).max() <= 1


async def test_batched_equals_unbatched_for_the_same_seeds(engine):
    jobs = [("a red cat", 1), ("a blue sea", 2), ("a green field", 3), ("a red cat", 4)]
    alone = [(await image_of(engine, DiffusionJob(p, 128, 128, 6, seed=s)))[0] for p, s in jobs]
    steps0, rows0 = engine.steps, engine.rows
    together = await asyncio.gather(*(image_of(engine, DiffusionJob(p, 128, 128, 6, seed=s)) for p, s in jobs))
    assert engine.rows - rows0 > engine.steps - steps0, "no step carried more than one request"
    for a, (b, _) in zip(alone, together, strict=True):
        assert np.abs(a.astype(int) - b.astype(int)).max() <= 1
    assert np.abs(alone[0].astype(int) - alone[3].astype(int)).max() > 10  # seeds matter


async def test_progress_is_monotonic_and_previews_arrive(engine):
    _, events = await image_of(engine, DiffusionJob("x", 64, 64, 5, seed=0, preview_every=2))
    progress = [e["step"] for e in events if e["type"] == "progress"]
    assert progress == [1, 2, 3, 4, 5]
    previews = [e for e in events if e["type"] == "latents"]
    assert [e["step"] for e in previews] == [2, 4] and previews[0]["latents"].ndim == 2


async def test_cancel_between_steps_stops_the_work(engine):
    job = DiffusionJob("a long one", 128, 128, 100, seed=0)
    gen = engine.generate(job)
    async for ev in gen:
        if ev["type"] == "progress" and ev["step"] >= 3:
            break
    await gen.aclose()
    await asyncio.sleep(0.3)
    stopped_at = job.step
    await asyncio.sleep(0.3)
    assert job.step == stopped_at < 100
    assert engine.load() == 0
    # the engine keeps serving
    img, _ = await image_of(engine, DiffusionJob("after", 64, 64, 2, seed=0))
    assert img.shape == (64, 64, 3)


async def test_bad_jobs_and_unsupported_pipelines_are_refused(engine, tmp_path):
    with pytest.raises(EngineError, match="multiples of 16"):
        await image_of(engine, DiffusionJob("x", 100, 64, 2, seed=0))
    with pytest.raises(EngineError, match="steps must be"):
        await image_of(engine, DiffusionJob("x", 64, 64, 0, seed=0))
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    other = DiffusersEngine(str(tmp_path), name="sd")
    with pytest.raises(EngineError, match="not supported by the step engine"):
        await other.start()
