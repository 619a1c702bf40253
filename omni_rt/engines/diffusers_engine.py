"""Diffusers engine: a real diffusers pipeline directory, with the denoising loop run
here so that concurrent requests share each step.

The pipeline loads with `from_pretrained(dir, local_files_only=True)` (weights never
come from a hub at run time). Its components (text encoders, transformer, VAE,
scheduler settings) are used directly; the engine owns the loop:

- Continuous batching between steps: every step takes the running requests of one
  shape (image size, guidance on or off), up to `max_batch` rows, and runs one
  transformer forward with a timestep per row. A request that arrives mid-loop joins
  at the next step; one that finishes leaves.
- Per-request seeds: each request's starting noise comes from its own generator
  (`torch.Generator().manual_seed(seed)`), as the diffusers pipeline makes it, so a
  batched result equals the unbatched one and the pipeline's own `__call__`.
- Cancel between steps (the consumer of `generate` goes away or calls `cancel`),
  progress after every step, intermediate latents every `preview_every` steps.
- Everything heavy runs on the engine's own thread, never on the event loop.

Supported pipeline classes: `FluxPipeline` (flow matching, packed latents, optional
true classifier-free guidance with a negative prompt).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omni_rt import metrics
from omni_rt.engines.base import Engine, EngineError, EngineRequestError

log = logging.getLogger("omni_rt.engines.diffusers")

SUPPORTED = ("FluxPipeline",)


@dataclass(eq=False)  # jobs are compared by identity (their fields hold tensors)
class DiffusionJob:
    """One image (or frame) to denoise. `height`/`width` in pixels."""

    prompt: str
    height: int
    width: int
    steps: int
    seed: int
    guidance_scale: float = 1.0
    negative_prompt: str | None = None
    preview_every: int = 0
    # Extra conditioning (e.g. a world model's history and action): tokens appended to
    # the text tokens [T, joint_dim], and a vector added to the pooled text embedding.
    context: torch.Tensor | None = None
    pooled_bias: torch.Tensor | None = None
    # --- engine state ---
    id: int = 0
    arrived: float = 0.0
    step: int = 0
    cancelled: bool = False
    events: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)
    latents: torch.Tensor | None = None  # packed [tokens, channels]
    sigmas: list[float] = field(default_factory=list)
    cond: tuple[torch.Tensor, torch.Tensor] | None = None  # (text embeds [L, D], pooled [P])
    uncond: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def cfg(self) -> bool:
        return self.uncond is not None

    @property
    def rows(self) -> int:
        return 2 if self.cfg else 1


class DiffusersEngine(Engine):
    def __init__(
        self,
        model_dir: str,
        *,
        name: str = "diffusers",
        max_batch: int = 8,
        threads: int | None = None,
        device: str = "cpu",
        max_sequence_length: int = 128,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.name = name
        self.model_dir = model_dir
        self.max_batch = max_batch
        self.threads = threads
        self.device = torch.device(device)
        self.max_sequence_length = max_sequence_length
        self.pipe: Any = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"diffusers-{name}")
        self._new: asyncio.Queue[DiffusionJob] | None = None
        self._active: list[DiffusionJob] = []
        self._task: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self.steps = 0  # transformer forwards run
        self.rows = 0  # rows those forwards carried

    # ---- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.pipe = await loop.run_in_executor(self._executor, self._load)
        self._new = asyncio.Queue()
        self._task = loop.create_task(self._loop(), name=f"diffusers-engine-{self.name}")

    def _load(self) -> Any:
        import diffusers

        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            cls_name = diffusers.DiffusionPipeline.load_config(self.model_dir, local_files_only=True)["_class_name"]
        except Exception as exc:  # noqa: BLE001 - reported with the directory's name
            raise EngineError(f"{self.model_dir} is not a diffusers pipeline directory: {exc}") from None
        if cls_name not in SUPPORTED:
            raise EngineError(f"pipeline class {cls_name} is not supported by the step engine; supported: {', '.join(SUPPORTED)}")
        pipe = getattr(diffusers, cls_name).from_pretrained(self.model_dir, local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        pipe.to(self.device)
        return pipe

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        waiting = list(self._active)
        while self._new is not None and not self._new.empty():
            waiting.append(self._new.get_nowait())
        for job in waiting:
            job.events.put_nowait({"type": "error", "error": f"engine {self.name} stopped"})
        self._active.clear()
        self._executor.shutdown(wait=True, cancel_futures=True)

    def load(self) -> int:
        return len(self._active) + (self._new.qsize() if self._new is not None else 0)

    def queue_depth(self) -> int:
        return self._new.qsize() if self._new is not None else 0

    # ---- what the pipeline offers --------------------------------------------------------
    @property
    def vae_scale_factor(self) -> int:
        return int(self.pipe.vae_scale_factor)

    @property
    def size_multiple(self) -> int:
        # latents are packed 2x2; before the pipeline is loaded, Flux's (8x VAE)
        return 2 * self.vae_scale_factor if self.pipe is not None else 16

    # ---- requests -------------------------------------------------------------------------
    async def generate(self, job: DiffusionJob) -> AsyncIterator[dict[str, Any]]:
        """Events of one job: `progress {step, steps}` after each step, `latents
        {step, latents}` every `preview_every` steps, then `image {image: uint8 HWC,
        latents: the final packed latents}`.
        Leaving the iteration early cancels the job at the next step boundary."""
        self.require_alive()
        if self._new is None or self._task is None or self._task.done():
            raise EngineError(f"engine {self.name} is not running")
        m = self.size_multiple
        if job.height % m or job.width % m or job.height < m or job.width < m:
            raise EngineRequestError(f"height and width must be positive multiples of {m}, got {job.width}x{job.height}")
        if job.steps < 1:
            raise EngineRequestError("steps must be >= 1")
        job.id = next(self._ids)
        job.arrived = time.monotonic()
        self._new.put_nowait(job)
        try:
            while True:
                ev = await job.events.get()
                if ev["type"] == "error":
                    raise EngineError(ev["error"])
                yield ev
                if ev["type"] == "image":
                    return
        finally:
            job.cancelled = True  # a no-op once it finished

    # ---- the step loop ----------------------------------------------------------------------
    async def _loop(self) -> None:
        try:
            await self._run_loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: every waiting job hears of it instead of hanging
            log.exception("engine %s: the step loop stopped", self.name)
            self.mark_dead(f"step loop died: {type(exc).__name__}")
            assert self._new is not None
            while not self._new.empty():
                self._active.append(self._new.get_nowait())
            self._fail(list(self._active), exc)
            raise

    async def _run_loop(self) -> None:
        assert self._new is not None
        loop = asyncio.get_running_loop()
        while True:
            if not self._active and self._new.empty():
                self._active.append(await self._new.get())
            while not self._new.empty():
                self._active.append(self._new.get_nowait())
            self._active = [j for j in self._active if not j.cancelled]
            fresh = [j for j in self._active if j.latents is None]
            if fresh:
                try:
                    await loop.run_in_executor(self._executor, self._prepare, fresh)
                except Exception as exc:  # noqa: BLE001 - reported to the jobs concerned
                    log.exception("engine %s: preparing %d job(s) failed", self.name, len(fresh))
                    self._fail(fresh, exc)
                    continue
            batch = self._next_batch()
            if not batch:
                continue
            try:
                await loop.run_in_executor(self._executor, self._step, batch)
            except Exception as exc:  # noqa: BLE001
                log.exception("engine %s: a step failed", self.name)
                self._fail(batch, exc)
                continue
            self.steps += 1
            self.rows += sum(j.rows for j in batch)
            metrics.ENGINE_BATCH.labels(engine=self.name).observe(sum(j.rows for j in batch))
            done = []
            for j in batch:
                j.events.put_nowait({"type": "progress", "step": j.step, "steps": j.steps})
                if j.preview_every and j.step % j.preview_every == 0 and j.step < j.steps:
                    assert j.latents is not None
                    j.events.put_nowait({"type": "latents", "step": j.step, "latents": j.latents.detach().cpu().numpy().copy()})
                if j.step >= j.steps:
                    done.append(j)
            if done:
                try:
                    images = await loop.run_in_executor(self._executor, self._decode, done)
                except Exception as exc:  # noqa: BLE001
                    log.exception("engine %s: decoding failed", self.name)
                    self._fail(done, exc)
                    continue
                for j, img in zip(done, images, strict=True):
                    assert j.latents is not None
                    j.events.put_nowait({"type": "image", "image": img, "latents": j.latents.detach().cpu().numpy().copy()})
                    j.latents = None
                self._active = [j for j in self._active if j not in done]
            # let the consumers run (and cancel) before the next step
            await asyncio.sleep(0)

    def _fail(self, jobs: list[DiffusionJob], exc: Exception) -> None:
        for j in jobs:
            j.events.put_nowait({"type": "error", "error": f"engine {self.name} failed: {exc}"})
        self._active = [j for j in self._active if j not in jobs]

    def _next_batch(self) -> list[DiffusionJob]:
        """Running jobs of the oldest job's shape, oldest first, up to max_batch rows."""
        ready = sorted((j for j in self._active if j.latents is not None and not j.cancelled), key=lambda j: j.arrived)
        if not ready:
            return []
        key = self._shape(ready[0])
        batch: list[DiffusionJob] = []
        rows = 0
        for j in ready:
            if self._shape(j) == key and (rows + j.rows <= self.max_batch or not batch):
                batch.append(j)
                rows += j.rows
        return batch

    @staticmethod
    def _shape(j: DiffusionJob) -> tuple[int, int, bool, int]:
        return (j.height, j.width, j.cfg, 0 if j.context is None else int(j.context.shape[0]))

    # ---- on the engine thread ----------------------------------------------------------------
    def _encode(self, prompts: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        with torch.inference_mode():
            embeds, pooled, _ids = self.pipe.encode_prompt(
                prompt=prompts, prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length
            )
        return [(embeds[i], pooled[i]) for i in range(len(prompts))]

    def _prepare(self, jobs: list[DiffusionJob]) -> None:
        """Text embeddings, starting noise and the sigma schedule of new jobs."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        pipe = self.pipe
        conds = self._encode([j.prompt for j in jobs])
        cfg_jobs = [j for j in jobs if j.guidance_scale > 1.0]
        unconds = dict(zip((j.id for j in cfg_jobs), self._encode([j.negative_prompt or "" for j in cfg_jobs]), strict=True)) if cfg_jobs else {}
        channels = pipe.transformer.config.in_channels // 4
        cfg = pipe.scheduler.config
        for j, cond in zip(jobs, conds, strict=True):
            j.cond = self._condition(j, cond)
            j.uncond = self._condition(j, unconds[j.id]) if j.id in unconds else None
            h = 2 * (j.height // self.size_multiple)
            w = 2 * (j.width // self.size_multiple)
            gen = torch.Generator(device="cpu").manual_seed(j.seed)
            noise = torch.randn((1, channels, h, w), generator=gen, dtype=torch.float32)
            j.latents = pipe._pack_latents(noise, 1, channels, h, w)[0].to(self.device)
            seq = j.latents.shape[0]
            mu = calculate_shift(
                seq, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15)
            )
            sigmas = np.linspace(1.0, 1 / j.steps, j.steps)
            pipe.scheduler.set_timesteps(j.steps, device="cpu", sigmas=sigmas, mu=mu)
            j.sigmas = [float(s) for s in pipe.scheduler.sigmas]  # steps + 1, ending at 0

    @staticmethod
    def _condition(j: DiffusionJob, cond: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, pooled = cond
        if j.context is not None:
            embeds = torch.cat([embeds, j.context.to(embeds.device, embeds.dtype)], dim=0)
        if j.pooled_bias is not None:
            pooled = pooled + j.pooled_bias.to(pooled.device, pooled.dtype)
        return embeds, pooled

    def _step(self, batch: list[DiffusionJob]) -> None:
        pipe = self.pipe
        first = batch[0]
        h = 2 * (first.height // self.size_multiple)
        w = 2 * (first.width // self.size_multiple)
        rows: list[tuple[DiffusionJob, bool]] = [(j, False) for j in batch] + [(j, True) for j in batch if j.cfg]
        latents = torch.stack([j.latents for j, _ in rows])
        sigma = torch.tensor([j.sigmas[j.step] for j, _ in rows], dtype=torch.float32)
        embeds = torch.stack([(j.uncond if neg else j.cond)[0] for j, neg in rows])  # type: ignore[index]
        pooled = torch.stack([(j.uncond if neg else j.cond)[1] for j, neg in rows])  # type: ignore[index]
        img_ids = pipe._prepare_latent_image_ids(1, h // 2, w // 2, self.device, torch.float32)
        txt_ids = torch.zeros(embeds.shape[1], 3, dtype=torch.float32, device=self.device)
        guidance = None
        if pipe.transformer.config.guidance_embeds:
            guidance = torch.tensor([j.guidance_scale for j, _ in rows], dtype=torch.float32, device=self.device)
        with torch.inference_mode():
            v = pipe.transformer(
                hidden_states=latents,
                timestep=sigma.to(self.device),  # the pipeline passes timestep / 1000 = sigma
                guidance=guidance,
                pooled_projections=pooled,
                encoder_hidden_states=embeds,
                txt_ids=txt_ids,
                img_ids=img_ids,
                return_dict=False,
            )[0]
        n = len(batch)
        for i, j in enumerate(batch):
            vi = v[i]
            if j.cfg:
                k = n + [b for b in batch if b.cfg].index(j)
                vi = v[k] + j.guidance_scale * (vi - v[k])
            # flow-matching Euler step, as FlowMatchEulerDiscreteScheduler.step
            j.latents = j.latents + (j.sigmas[j.step + 1] - j.sigmas[j.step]) * vi
            j.step += 1

    def _decode(self, jobs: list[DiffusionJob]) -> list[np.ndarray]:
        pipe = self.pipe
        out: list[np.ndarray] = []
        by_size: dict[tuple[int, int], list[int]] = {}
        for i, j in enumerate(jobs):
            by_size.setdefault((j.height, j.width), []).append(i)
        images: dict[int, np.ndarray] = {}
        for (height, width), idx in by_size.items():
            lat = torch.stack([jobs[i].latents for i in idx])
            lat = pipe._unpack_latents(lat, height, width, self.vae_scale_factor)
            lat = lat / pipe.vae.config.scaling_factor + (pipe.vae.config.shift_factor or 0.0)
            with torch.inference_mode():
                pixels = pipe.vae.decode(lat, return_dict=False)[0]
            arr = pipe.image_processor.postprocess(pixels, output_type="np")
            for i, a in zip(idx, arr, strict=True):
                images[i] = (a * 255).round().astype(np.uint8)
        out = [images[i] for i in range(len(jobs))]
        return out
