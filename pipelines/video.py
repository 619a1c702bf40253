"""Video stages.

`ClipProcessor` (the `video` pipeline, `/v1/videos` jobs): text to video on a real
diffusers video family (Wan), a whole clip per request.

A request renders `frames` frames from `start_frame` on (`params["history"]`: the
latents of the frames before it), emitting each frame as soon as it is decoded, with
progress in between. Live editing sends one request per chunk of frames with the
prompt of the moment, so an edit takes effect at the next chunk (or, when the running
chunk is cancelled, at the next frame); jobs render the whole clip in one request.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field

from omni_rt.engines.base import Engine
from omni_rt.engines.diffusers_engine import DiffusionJob
from omni_rt.errors import StageError
from omni_rt.payloads import Payload, PayloadKind
from omni_rt.specs import StageSpec
from omni_rt.stage import StageContext
from pipelines.checkpoint import check_diffusers_family
from pipelines.video_stage import VideoArgs, VideoStage


class ClipArgs(VideoArgs):
    default_size: int = Field(default=128, ge=16)
    default_steps: int = Field(default=8, ge=1)
    max_frames: int = Field(default=81, ge=1, description="frames the model makes in one clip at most (Wan 2.1: 81)")


class ClipProcessor(VideoStage):
    """Text to video on a video family of the diffusers step engine (Wan): a request
    renders a whole clip in one engine job. `frames` is what the caller asked for; the
    model makes `frame_multiple`·k + 1 frames, so the job asks for the smallest such
    count at or above it and the first `frames` are emitted (IMAGE payloads with
    `frame_index`, progress in between). Clips of the same size and length share every
    denoising step with those of other requests."""

    ARGS = ClipArgs

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        self.max_frames = self.args.max_frames

    @classmethod
    def check_model(cls, model_dir: str) -> None:
        check_diffusers_family(model_dir, video=True)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "max_frames": self.max_frames}

    def clip_frames(self, frames: int) -> int:
        """The model's frame count for a request of `frames` frames."""
        m = self.frame_multiple
        return frames if m <= 1 else 1 + -(-(frames - 1) // m) * m

    async def run(self, ctx: StageContext) -> None:
        p = ctx.params
        frames = int(p["frames"])
        if not 1 <= frames <= self.max_frames:
            raise StageError(f"this model makes clips of 1 to {self.max_frames} frames, asked for {frames}")
        steps = int(p.get("steps") or self.default_steps)
        job = DiffusionJob(
            prompt=str(p.get("prompt") or ""),
            height=int(p["height"]),
            width=int(p["width"]),
            steps=steps,
            seed=int(p.get("seed", 0)),
            frames=self.clip_frames(frames),
            fps=float(p.get("fps") or 25),
            guidance_scale=float(self.guidance_scale if p.get("guidance_scale") is None else p["guidance_scale"]),
            negative_prompt=p.get("negative_prompt", self.negative_prompt),
        )
        async for ev in self.dit.generate(job):
            if ev["type"] == "progress":
                await ctx.emit(Payload(PayloadKind.IMAGE, ctx.fence, meta={"progress": ev["step"], "total": steps}))
            elif ev["type"] == "video":
                clip = ev["frames"]
                for k in range(frames):
                    await ctx.emit(Payload(PayloadKind.IMAGE, ctx.fence, arrays={"image": clip[k]}, meta={"frame_index": k}), last=k == frames - 1)
                ctx.add_usage(frames=frames, steps=steps)
                return
        raise StageError("the engine returned no clip")

