"""The `video_edit` pipeline: video as an autoregressive rollout of the world model
with no action — each frame conditioned on the prompt and the frames before it.

A request renders `frames` frames from `start_frame` on (`params["history"]`: the
latents of the frames before it), emitting each frame as soon as it is decoded, with
progress in between. Live editing sends one request per chunk of frames with the
prompt of the moment, so an edit takes effect at the next chunk (or, when the running
chunk is cancelled, at the next frame); jobs render the whole clip in one request.
"""

from __future__ import annotations

import numpy as np

from omni_rt.stage import StageContext
from pipelines.world import WorldProcessor


class VideoProcessor(WorldProcessor):
    async def run(self, ctx: StageContext) -> None:
        p = ctx.params
        frames, start = int(p["frames"]), int(p.get("start_frame", 0))
        history = list(p.get("history") or [])
        still = np.zeros(self.action_dim, np.float32)
        steps = int(p.get("steps") or self.default_steps)
        for k in range(frames):
            job = self.frame_job(p, history, still, start + k)
            latents = await self.render(ctx, job, start + k, k * steps, frames * steps, last=k == frames - 1)
            history = (history + [latents])[-self.history_frames :]
        ctx.add_usage(frames=frames, steps=frames * steps)
