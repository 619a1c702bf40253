"""The `image` pipeline: one diffusion stage (the diffusers step engine) that turns a
prompt into `n` images.

The request's params carry the prompt and settings (`prompt`, `n`, `width`,
`height`, `steps`, `guidance_scale`, `negative_prompt`, `seed`). Image `i` uses seed
`seed + i`; without a seed each image gets a random one. All `n` images go to the
engine at once and share its steps (with those of every other request of the same
shape). Each finished image is emitted as an IMAGE payload (`uint8 [H, W, 3]`, meta
`index`, `seed`); progress as payloads without arrays (meta `progress`: steps done
over all images, `total`).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Mapping
from typing import Any

from omni_rt.engines.base import DiffusionEngine, Engine
from omni_rt.engines.diffusers_engine import DiffusionJob
from omni_rt.payloads import Payload, PayloadKind
from omni_rt.specs import StageSpec
from omni_rt.stage import StageContext, StageProcessor
from pipelines.checkpoint import check_diffusers_family


class ImageProcessor(StageProcessor):
    ARGS = {"default_size", "default_steps", "max_steps", "max_n", "max_side", "guidance_scale"}

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        self.dit = self.engine_as(DiffusionEngine)
        args = dict(spec.processor_args)
        bad = set(args) - self.ARGS
        if bad:
            raise ValueError(f"unknown image processor_args {sorted(bad)}; known: {sorted(self.ARGS)}")
        self.default_size = str(args.get("default_size", "1024x1024"))
        self.default_steps = int(args.get("default_steps", 28))
        self.max_steps = int(args.get("max_steps", 100))
        self.max_n = int(args.get("max_n", 10))
        self.max_side = int(args.get("max_side", 2048))
        self.guidance_scale = float(args.get("guidance_scale", 1.0))
        if not (1 <= self.default_steps <= self.max_steps and self.max_n >= 1 and self.max_side >= 64):
            raise ValueError("image processor_args: 1 <= default_steps <= max_steps, max_n >= 1, max_side >= 64")

    @classmethod
    def check_model(cls, model_dir: str) -> None:
        check_diffusers_family(model_dir, video=False)

    def limits(self) -> dict[str, Any]:
        """What the HTTP adapter validates requests against."""
        return {
            "default_size": self.default_size,
            "default_steps": self.default_steps,
            "max_steps": self.max_steps,
            "max_n": self.max_n,
            "max_side": self.max_side,
            "size_multiple": self.dit.size_multiple,
            "guidance_scale": self.guidance_scale,
        }

    async def run(self, ctx: StageContext) -> None:
        p = ctx.params
        n = int(p.get("n", 1))
        seed = p.get("seed")
        seeds = [int(seed) + i for i in range(n)] if seed is not None else [secrets.randbelow(2**31) for _ in range(n)]
        steps = int(p.get("steps") or self.default_steps)
        jobs = [
            DiffusionJob(
                prompt=str(p["prompt"]),
                height=int(p["height"]),
                width=int(p["width"]),
                steps=steps,
                seed=s,
                guidance_scale=float(self.guidance_scale if p.get("guidance_scale") is None else p["guidance_scale"]),
                negative_prompt=p.get("negative_prompt"),
            )
            for s in seeds
        ]
        done_steps = [0] * n

        async def one(i: int, job: DiffusionJob) -> None:
            async for ev in self.dit.generate(job):
                if ev["type"] == "progress":
                    done_steps[i] = ev["step"]
                    await ctx.emit(Payload(PayloadKind.IMAGE, ctx.fence, meta={"progress": sum(done_steps), "total": steps * n}))
                elif ev["type"] == "image":
                    await ctx.emit(Payload(PayloadKind.IMAGE, ctx.fence, arrays={"image": ev["image"]}, meta={"index": i, "seed": job.seed}))

        tasks = [asyncio.ensure_future(one(i, j)) for i, j in enumerate(jobs)]
        try:
            await asyncio.gather(*tasks)
        finally:  # one image failing (or the request aborted) stops the others' engine jobs
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        ctx.add_usage(images=n, steps=steps * n)
