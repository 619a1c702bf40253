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

from pydantic import Field, model_validator

from omni_rt.engines.base import DiffusionEngine, Engine
from omni_rt.engines.diffusers_engine import DiffusionJob
from omni_rt.payloads import Payload, PayloadKind
from omni_rt.specs import StageSpec
from omni_rt.stage import ProcessorArgs, StageContext, StageProcessor
from pipelines.checkpoint import check_diffusers_family


class ImageArgs(ProcessorArgs):
    default_size: str = Field(default="1024x1024", pattern=r"^\d{1,5}x\d{1,5}$")
    default_steps: int = Field(default=28, ge=1)
    max_steps: int = Field(default=100, ge=1)
    max_n: int = Field(default=10, ge=1, description="images one request may ask for")
    max_side: int = Field(default=2048, ge=64)
    guidance_scale: float = Field(default=1.0, ge=0.0)

    @model_validator(mode="after")
    def _steps_fit(self) -> ImageArgs:
        if self.default_steps > self.max_steps:
            raise ValueError(f"default_steps {self.default_steps} is over max_steps {self.max_steps}")
        return self


class ImageProcessor(StageProcessor):
    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        self.dit = self.engine_as(DiffusionEngine)
        self.args = ImageArgs.parse(spec.processor_args, "image")
        self.default_size = self.args.default_size
        self.default_steps = self.args.default_steps
        self.max_steps = self.args.max_steps
        self.max_n = self.args.max_n
        self.max_side = self.args.max_side
        self.guidance_scale = self.args.guidance_scale

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
