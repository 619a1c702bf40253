"""Diffusion forcing on the tiny SkyReels-V2 DF directory: the step engine's first
chunk equals the pipeline's own call; a chunk after it keeps its prefix (the clean
latents of the frames before it) unchanged and makes 4k new frames; chunks of two
videos at different points share forwards and equal their unbatched selves; the live
processor conditions each chunk on exactly the frames shown before it."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from omni_rt.engines.base import EngineError
from omni_rt.engines.diffusers_engine import DiffusersEngine, DiffusionJob
from omni_rt.payloads import Fence

pytestmark = pytest.mark.integration  # diffusers pipelines on the tiny checkpoints


@pytest.fixture
async def engine(models_dir):
    eng = DiffusersEngine(str(models_dir / "tiny-skyreels-df"), name="df", max_batch=8, max_sequence_length=32)
    await eng.start()
    yield eng
    await eng.stop()


async def chunk(eng: DiffusersEngine, job: DiffusionJob) -> dict[str, Any]:
    async for ev in eng.generate(job):
        if ev["type"] == "video":
            return ev
    raise AssertionError("no chunk")


def _diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())


async def test_the_first_chunk_equals_the_pipelines_own_call(engine):
    ev = await chunk(engine, DiffusionJob("a red cup", 64, 64, 6, seed=3, frames=9, fps=16))
    ref = await asyncio.to_thread(
        lambda: engine.pipe("a red cup", height=64, width=64, num_frames=9, num_inference_steps=6, guidance_scale=1.0, max_sequence_length=32,
                            fps=16, generator=torch.Generator().manual_seed(3), output_type="np").frames[0]
    )
    assert ev["frames"].shape == (9, 64, 64, 3) and _diff((ref * 255).round(), ev["frames"]) <= 1
    assert ev["latents"].shape == (16, 3, 8, 8)  # 1 + 2 latent frames


async def test_a_later_chunk_keeps_its_prefix_and_batches_with_other_videos(engine):
    first = await chunk(engine, DiffusionJob("a red cup", 64, 64, 6, seed=3, frames=9, fps=16))
    prefix = torch.from_numpy(first["latents"][:, -2:].copy())
    alone = await chunk(engine, DiffusionJob("a blue cup", 64, 64, 6, seed=4, frames=8, fps=16, prefix=prefix))
    assert alone["frames"].shape == (8, 64, 64, 3)  # the new frames only
    assert alone["latents"].shape == (16, 4, 8, 8) and np.array_equal(alone["latents"][:, :2], prefix.numpy())
    other_alone = await chunk(engine, DiffusionJob("a green sea", 64, 64, 6, seed=9, frames=8, fps=16, prefix=prefix[:, :1].clone()))
    steps0, rows0 = engine.steps, engine.rows
    a, b, c = await asyncio.gather(
        chunk(engine, DiffusionJob("a blue cup", 64, 64, 6, seed=4, frames=8, fps=16, prefix=prefix)),
        chunk(engine, DiffusionJob("a blue cup", 64, 64, 6, seed=5, frames=8, fps=16, prefix=prefix)),
        chunk(engine, DiffusionJob("a green sea", 64, 64, 6, seed=9, frames=8, fps=16, prefix=prefix[:, :1].clone())),
    )
    assert engine.rows - rows0 > engine.steps - steps0, "no forward carried two chunks"
    assert _diff(a["frames"], alone["frames"]) <= 1 and _diff(c["frames"], other_alone["frames"]) <= 1
    assert _diff(a["frames"], b["frames"]) > 2  # the seed matters (batched rows agree to 1 level)
    with pytest.raises(EngineError, match="4k frames"):
        await chunk(engine, DiffusionJob("x", 64, 64, 2, seed=0, frames=9, prefix=prefix))
    with pytest.raises(EngineError, match="do not fit"):
        await chunk(engine, DiffusionJob("x", 96, 64, 2, seed=0, frames=8, prefix=prefix))


class _Ctx:
    def __init__(self, params: dict[str, Any]) -> None:
        self.params = params
        self.fence = Fence("s")
        self.frames: list[tuple[int, np.ndarray, np.ndarray]] = []

    async def emit(self, payload: Any, last: bool = False) -> None:
        if "image" in payload.arrays:
            self.frames.append((payload.meta["frame_index"], payload.arrays["image"], payload.arrays["latents"]))

    def add_usage(self, **kw: Any) -> None:
        pass


async def test_the_live_processor_conditions_each_chunk_on_the_frames_shown(engine, monkeypatch):
    from omni_rt.specs import load_pipeline
    from pipelines import PIPELINE_DIR
    from pipelines.forcing import ForcingProcessor

    spec = load_pipeline(PIPELINE_DIR / "video_edit.yaml").profiles["default"].stages[0]
    proc = ForcingProcessor(spec, engine, {})
    d = proc.describe()
    assert d["frame_multiple"] == 4 and d["history_frames"] == 8
    seen: list[DiffusionJob] = []
    generate = engine.generate

    def spy(job: DiffusionJob) -> Any:
        seen.append(job)
        return generate(job)

    monkeypatch.setattr(engine, "generate", spy)
    base = {"prompt": "a cat", "width": 64, "height": 64, "steps": 3, "seed": 1}
    one = _Ctx({**base, "frames": 4, "frames_left": 12, "start_frame": 0, "history": []})
    await proc.run(one)  # type: ignore[arg-type]  # 4 asked: the first chunk makes 1 + 4 frames, all shown
    assert [f for f, _, _ in one.frames] == [0, 1, 2, 3, 4] and seen[0].prefix is None
    history = [lat for _, _, lat in one.frames][-d["history_frames"] :]
    two = _Ctx({**base, "prompt": "a dog", "frames": 4, "frames_left": 7, "start_frame": 5, "history": history})
    await proc.run(two)  # type: ignore[arg-type]
    # the prefix is the last two latent frames of what was shown: frame 0's and frames 1-4's
    assert seen[1].prefix is not None and seen[1].prefix.shape[1] == 2
    assert np.array_equal(seen[1].prefix[:, 0].numpy(), one.frames[0][2]) and np.array_equal(seen[1].prefix[:, 1].numpy(), one.frames[4][2])
    assert [f for f, _, _ in two.frames] == [5, 6, 7, 8]
    three = _Ctx({**base, "frames": 3, "frames_left": 3, "start_frame": 9, "history": (history + [lat for _, _, lat in two.frames])[-8:]})
    await proc.run(three)  # type: ignore[arg-type]  # 4 made, 3 shown: the video ends at 12 frames
    assert [f for f, _, _ in three.frames] == [9, 10, 11]
    assert np.array_equal(seen[2].prefix[:, 1].numpy(), two.frames[-1][2])


async def test_the_live_processor_refuses_a_directory_that_is_not_diffusion_forcing(models_dir):
    from omni_rt.errors import StageError
    from pipelines.forcing import ForcingProcessor

    with pytest.raises(StageError, match="names WanPipeline, not a diffusion-forcing pipeline"):
        ForcingProcessor.check_model(str(models_dir / "tiny-wan"))


async def test_the_world_model_steps_on_the_forcing_backbone_with_its_action_module(models_dir):
    from omni_rt.errors import StageError
    from omni_rt.specs import load_pipeline
    from pipelines import PIPELINE_DIR
    from pipelines.world import ForcingWorldProcessor

    d = models_dir / "tiny-skyreels-world"
    spec = load_pipeline(PIPELINE_DIR / "world.yaml").profiles["default"].stages[0].model_copy(update={"model": str(d)})
    ForcingWorldProcessor.check_model(str(d))
    with pytest.raises(StageError, match="no action.json"):
        ForcingWorldProcessor.check_model(str(models_dir / "tiny-skyreels-df"))
    eng = DiffusersEngine(str(d), name="world", max_sequence_length=32)
    await eng.start()
    try:
        proc = ForcingWorldProcessor(spec, eng, {})
        desc = proc.describe()
        assert desc["action_dim"] == 4 and desc["frames_per_step"] == 4 and desc["history_frames"] == 8
        base = {"prompt": "a forest path", "width": 64, "height": 64, "steps": 3, "seed": 2}
        first = _Ctx({**base, "frame_index": 0, "history": [], "action": [1.0, 0.0, 0.0, 0.0]})
        await proc.run(first)  # type: ignore[arg-type]
        assert [f for f, _, _ in first.frames] == [0]  # the rollout's first frame
        history = [lat for _, _, lat in first.frames]
        outs = []
        for action in ([0.0, 1.0, 0.0, 0.0], [0.0, -1.0, 3.0, 0.0], [0.0, 1.0, 0.0, 0.0]):
            ctx = _Ctx({**base, "frame_index": 1, "history": history, "action": action})
            await proc.run(ctx)  # type: ignore[arg-type]
            assert [f for f, _, _ in ctx.frames] == [1, 2, 3, 4]
            # the step's latents: the history's frame first (the prefix), then the new one
            assert all(np.array_equal(lat, ctx.frames[0][2]) for _, _, lat in ctx.frames)
            outs.append(np.stack([img for _, img, _ in ctx.frames]))
        assert _diff(outs[0], outs[2]) == 0  # reproducible from seed, history and action
        assert _diff(outs[0], outs[1]) > 0  # the action enters the backbone
        with pytest.raises(StageError, match="action must be 4"):
            await proc.run(_Ctx({**base, "frame_index": 0, "history": [], "action": [1.0]}))  # type: ignore[arg-type]
    finally:
        await eng.stop()
