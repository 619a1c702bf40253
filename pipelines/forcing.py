"""Diffusion forcing: a long video chunk by chunk on a
`SkyReelsV2DiffusionForcingPipeline` directory, each chunk conditioned on the clean
latents of the frames shown before it. `ForcingProcessor` serves live video (the
`video_edit` pipeline); the world model (`pipelines.world.ForcingWorldProcessor`)
builds on it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from pydantic import Field

from omni_rt.engines.base import Engine
from omni_rt.engines.diffusers_engine import DiffusionJob
from omni_rt.errors import StageError
from omni_rt.payloads import Payload, PayloadKind
from omni_rt.specs import StageSpec
from omni_rt.stage import StageContext
from pipelines.checkpoint import diffusers_class
from pipelines.video_stage import VideoArgs, VideoStage


class ForcingArgs(VideoArgs):
    history_latent_frames: int = Field(default=2, ge=1, description="the clean latent frames that condition each chunk")
    fps: int = Field(default=16, ge=1, description="the frame rate the video is made for")


class ForcingProcessor(VideoStage):
    """Live video on diffusion forcing (the `video_edit` pipeline on a
    SkyReels-V2 DF directory): each request renders the next chunk of a long video,
    conditioned on the clean latents of the frames before it — the session's
    `history` (one latent frame per frame shown, as `latents` on each frame's payload;
    the last `history_latent_frames` distinct ones are the prefix) — under the prompt of
    the moment. The model makes `frame_multiple` frames per latent frame (the video's
    first frame alone), so a chunk asked for `frames` makes whole latent frames: at
    least `frames`, and every one of them is shown (up to `frames_left`, the frames the
    generation still needs) so that the next chunk continues from exactly what was
    seen. Chunks of different sessions of one size share the engine's steps."""

    ARGS = ForcingArgs
    WHAT = "forcing"

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        self.history_latent_frames = self.args.history_latent_frames
        self.fps = self.args.fps

    @classmethod
    def check_model(cls, model_dir: str) -> None:
        name = diffusers_class(model_dir)
        if name != "SkyReelsV2DiffusionForcingPipeline":
            raise StageError(f"{model_dir}: model_index.json names {name}, not a diffusion-forcing pipeline (SkyReelsV2DiffusionForcingPipeline)")

    def describe(self) -> dict[str, Any]:
        # frames whose latents the session keeps: enough to hold the prefix
        return {**super().describe(), "history_frames": self.history_latent_frames * self.frame_multiple}

    def prefix(self, history: list[Any]) -> Any:
        """The last `history_latent_frames` distinct latent frames of the history
        ([C, P, h, w]), or None at the start of a video."""
        import torch

        distinct: list[np.ndarray] = []
        for lat in history:
            a = np.asarray(lat, np.float32)
            if not distinct or a.shape != distinct[-1].shape or not np.array_equal(a, distinct[-1]):
                distinct.append(a)
        if not distinct:
            return None
        return torch.from_numpy(np.stack(distinct[-self.history_latent_frames :], axis=1))

    async def run(self, ctx: StageContext) -> None:
        p = ctx.params
        n, start = int(p["frames"]), int(p.get("start_frame", 0))
        prefix = self.prefix(list(p.get("history") or [])) if start > 0 else None
        m = self.frame_multiple
        made = m * -(-n // m) if prefix is not None else 1 + m * -(-(n - 1) // m)
        await self.render(ctx, p, start, made, prefix, max(n, int(p.get("frames_left", n))))

    async def render(self, ctx: StageContext, p: Mapping[str, Any], start: int, made: int, prefix: Any, left: int, context: Any = None) -> None:
        """One engine job of `made` frames after `prefix` (None: the video's start),
        with extra conditioning tokens `context`; its frames from `start` on are
        emitted (at most `left`), each with the latent frame it belongs to."""
        steps = int(p.get("steps") or self.default_steps)
        job = DiffusionJob(
            prompt=str(p.get("prompt") or ""),
            height=int(p["height"]),
            width=int(p["width"]),
            steps=steps,
            seed=int(p.get("seed", 0)) + start,
            frames=made,
            fps=float(p.get("fps") or self.fps),
            prefix=prefix,
            context=context,
            guidance_scale=self.guidance_scale,
            negative_prompt=self.negative_prompt,
        )
        m = self.frame_multiple
        p0 = 0 if prefix is None else int(prefix.shape[1])
        async for ev in self.dit.generate(job):
            if ev["type"] == "progress":
                await ctx.emit(Payload(PayloadKind.IMAGE, ctx.fence, meta={"progress": ev["step"], "total": ev["steps"]}))
            elif ev["type"] == "video":
                clip, latents = ev["frames"], ev["latents"]
                count = min(len(clip), left)
                for j in range(count):
                    li = p0 + j // m if prefix is not None else (0 if j == 0 else 1 + (j - 1) // m)
                    await ctx.emit(
                        Payload(PayloadKind.IMAGE, ctx.fence, arrays={"image": clip[j], "latents": latents[:, li]}, meta={"frame_index": start + j}),
                        last=j == count - 1,
                    )
                ctx.add_usage(frames=count, steps=job.steps)
                return
        raise StageError("the engine returned no chunk")
