"""The diffusers step engine on the tiny StableDiffusion3Pipeline directory: equal to
the pipeline's own __call__ (with and without classifier-free guidance), batched ==
unbatched for the same seeds with jobs joining running steps, and the image stage
takes the directory."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from omni_rt.engines.diffusers_engine import DiffusersEngine, DiffusionJob
from testkit.diffusion import output_of, staggered

pytestmark = pytest.mark.integration  # diffusers pipelines on the tiny checkpoints


@pytest.fixture
async def engine(models_dir):
    eng = DiffusersEngine(str(models_dir / "tiny-sd3"), name="sd3", max_batch=8, max_sequence_length=32)
    await eng.start()
    yield eng
    await eng.stop()


async def image_of(eng: DiffusersEngine, job: DiffusionJob) -> np.ndarray:
    async for ev in eng.generate(job):
        if (img := output_of(ev)) is not None:
            return img
    raise AssertionError("no image")


def _diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


async def test_sd3_equals_the_pipelines_own_call(engine):
    assert not engine.video and engine.size_multiple == 16
    # the prompt limit counts T5's tokens (max_sequence_length caps T5; the CLIPs stop at 77)
    assert engine.prompt_tokens("a red cup") == len(engine.pipe.tokenizer_3("a red cup").input_ids)
    for guidance, negative in ((1.0, None), (4.0, "blurry")):
        img = await image_of(engine, DiffusionJob("a red cup", 128, 192, 6, seed=3, guidance_scale=guidance, negative_prompt=negative))
        ref = await asyncio.to_thread(
            engine.pipe, "a red cup", negative_prompt=negative, height=128, width=192, num_inference_steps=6, guidance_scale=guidance,
            max_sequence_length=32, generator=torch.Generator().manual_seed(3), output_type="np",
        )
        ref = ref.images[0]
        assert img.shape == (128, 192, 3) and _diff((ref * 255).round(), img) <= 1


async def test_sd3_jobs_joining_running_steps_equal_their_unbatched_selves(engine):
    jobs = [("a red cup", 1), ("a blue sea", 2), ("a red cup", 3)]
    alone = [await image_of(engine, DiffusionJob(p, 64, 64, 12, seed=s)) for p, s in jobs]
    steps0, rows0 = engine.steps, engine.rows
    together = await staggered(engine, [DiffusionJob(p, 64, 64, 12, seed=s) for p, s in jobs])
    assert engine.rows - rows0 > engine.steps - steps0, "no forward carried more than one job"
    assert all(_diff(a, b) <= 1 for a, b in zip(alone, together, strict=True))
    assert _diff(alone[0], alone[2]) > 10


def test_the_image_stage_takes_an_sd3_directory_and_refuses_a_video_one(models_dir):
    from omni_rt.errors import StageError
    from pipelines.image import ImageProcessor

    ImageProcessor.check_model(str(models_dir / "tiny-sd3"))
    with pytest.raises(StageError, match=r"names WanPipeline, not an image pipeline this server runs \(FluxPipeline, StableDiffusion3Pipeline\)"):
        ImageProcessor.check_model(str(models_dir / "tiny-wan"))
