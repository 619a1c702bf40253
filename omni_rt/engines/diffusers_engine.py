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
- Jobs that finish together are decoded together; a finished job whose decode could
  join that of a job one step from its end waits for that step (once), so that
  sessions one step out of phase (a world rollout's, a live video's) share a decode.
- Prompt encodings are kept (the last `prompt_cache` prompts, least recently used
  out): a world rollout or a live video asks for the same prompt every step or chunk,
  and a real text encoder (T5-XXL, UMT5-XXL) costs more than a step.
- Step caches are diffusers' own hooks (`engine_args.cache: {type: first_block,
  threshold}`), applied to the transformer; a batch whose rows changed starts from a
  full forward.

How each family encodes prompts, draws noise, steps and decodes lives in
`omni_rt.engines.diffusion_families` (`FAMILIES`: Flux and SD3 for images; Wan, LTX
and SkyReels-V2 diffusion forcing for video). Image jobs end with an `image` event,
video jobs with a `video` event (all frames).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omni_rt import metrics
from omni_rt.engines.base import Engine, EngineError, EngineRequestError
from omni_rt.engines.diffusion_families import FAMILIES, Family

log = logging.getLogger("omni_rt.engines.diffusers")

CACHES = ("first_block",)


def _cache_config(cache: Mapping[str, Any] | None) -> Any:
    """`engine_args.cache` -> the diffusers cache config: `{type: first_block,
    threshold: 0.05}` (diffusers' FirstBlockCacheConfig: the rest of the transformer is
    skipped while the first block's residual changes less than `threshold`)."""
    if not cache:
        return None
    args = dict(cache)
    kind = args.pop("type", None)
    if kind not in CACHES:
        raise ValueError(f"engine_args.cache.type must be one of {', '.join(CACHES)}, got {kind!r}")
    from diffusers import FirstBlockCacheConfig

    bad = set(args) - {"threshold"}
    if bad:
        raise ValueError(f"unknown engine_args.cache keys {sorted(bad)} for first_block; known: ['threshold', 'type']")
    return FirstBlockCacheConfig(threshold=float(args.get("threshold", 0.05)))

SUPPORTED = tuple(FAMILIES)
# the pipeline parts that compute in the engine's dtype (SD3: T5-XXL is the third text encoder); the rest float32
ENGINE_DTYPE_PARTS = ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3")


def _supported(cls_name: str) -> None:
    if cls_name not in SUPPORTED:
        raise EngineError(f"pipeline class {cls_name} is not supported by the step engine; supported: {', '.join(SUPPORTED)}")


@dataclass(eq=False)  # jobs are compared by identity (their fields hold tensors)
class DiffusionJob:
    """One image, or one clip of `frames` frames (video families), to denoise.
    `height`/`width` in pixels."""

    prompt: str
    height: int
    width: int
    steps: int
    seed: int
    guidance_scale: float = 1.0
    frames: int = 1
    fps: float = 25.0  # the frame rate the clip is made for (LTX scales its rope by it)
    # diffusion forcing: the clean latents [C, P, h, w] of the frames before this chunk
    prefix: torch.Tensor | None = None
    negative_prompt: str | None = None
    preview_every: int = 0
    # Extra conditioning (e.g. a world model's action): tokens appended to the text
    # tokens [T, text_dim].
    context: torch.Tensor | None = None
    # --- engine state ---
    id: int = 0
    arrived: float = 0.0
    step: int = 0
    cancelled: bool = False
    events: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)
    latents: torch.Tensor | None = None  # the family's layout (Flux: packed [tokens, channels])
    cond: tuple[torch.Tensor, ...] | None = None  # the family's text conditioning (Flux: embeds [L, D], pooled [P])
    uncond: tuple[torch.Tensor, ...] | None = None
    state: dict[str, Any] = field(default_factory=dict)  # the family's per-job state (schedule, scheduler copy)

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
        dtype: str = "float32",
        max_sequence_length: int = 128,
        cache: Mapping[str, Any] | None = None,
        prompt_cache: int = 32,
        pipeline: Any = None,
    ) -> None:
        """`pipeline`: a diffusers pipeline built in process (the shapes bench's random
        weights) instead of the one in `model_dir`."""
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if prompt_cache < 0:
            raise ValueError("prompt_cache must be >= 0 (0: encode every prompt)")
        self.name = name
        self.model_dir = model_dir
        self.max_batch = max_batch
        self.threads = threads
        self.device = torch.device(device)
        # the transformer's and text encoders' dtype (bfloat16 on a GPU); the VAE, the
        # noise and the scheduler stay float32, as the pipelines recommend
        self.dtype = getattr(torch, dtype, None)
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be a torch floating dtype name (float32, bfloat16, float16), got {dtype!r}")
        self.max_sequence_length = max_sequence_length
        self.cache = _cache_config(cache)
        self._cached_batch: tuple[tuple[int, bool], ...] | None = None
        self.pipe: Any = None
        self._built = pipeline
        self.family: Family | None = None
        self.prompt_cache = prompt_cache
        self._prompts: OrderedDict[str, tuple[torch.Tensor, ...]] = OrderedDict()  # only the engine thread touches it
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
        self.family = FAMILIES[type(self.pipe).__name__](self.pipe, self.device, self.max_sequence_length)
        self._new = asyncio.Queue()
        self._task = loop.create_task(self._loop(), name=f"diffusers-engine-{self.name}")

    def _load(self) -> Any:
        import diffusers

        if self.threads is not None:
            torch.set_num_threads(self.threads)
        if self._built is not None:
            pipe = self._built
            _supported(type(pipe).__name__)
            # built in process: the dtypes from_pretrained gives below (each model's float32 modules kept)
            for name in ENGINE_DTYPE_PARTS:
                part = getattr(pipe, name, None)
                if part is None:
                    continue
                keep = getattr(part, "_keep_in_fp32_modules", None) or []
                for key, t in [*part.named_parameters(), *part.named_buffers()]:
                    if t.is_floating_point():
                        t.data = t.data.to(torch.float32 if any(k in key.split(".") for k in keep) else self.dtype)
            return self._place(pipe)
        try:
            cls_name = diffusers.DiffusionPipeline.load_config(self.model_dir, local_files_only=True)["_class_name"]
        except Exception as exc:  # noqa: BLE001 - reported with the directory's name
            raise EngineError(f"{self.model_dir} is not a diffusers pipeline directory: {exc}") from None
        _supported(cls_name)
        # the transformer and text encoders in the engine's dtype (each model's own
        # float32 modules kept, as from_pretrained keeps them); the rest float32
        dtypes = {name: self.dtype for name in ENGINE_DTYPE_PARTS}
        pipe = getattr(diffusers, cls_name).from_pretrained(self.model_dir, local_files_only=True, dtype={**dtypes, "default": torch.float32})
        return self._place(pipe)

    def _place(self, pipe: Any) -> Any:
        pipe.set_progress_bar_config(disable=True)
        pipe.to(self.device)
        if self.cache is not None:
            if not hasattr(pipe.transformer, "enable_cache"):
                raise EngineError(f"{type(pipe.transformer).__name__} has no diffusers cache hooks; drop engine_args.cache")
            pipe.transformer.enable_cache(self.cache)
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
    def size_multiple(self) -> int:
        # before the pipeline is loaded, Flux's and Wan's (8x VAE, 2x2 patches)
        return self.family.size_multiple if self.family is not None else 16

    def prompt_tokens(self, prompt: str) -> int:
        """How many text tokens `prompt` is for the text encoder whose length the engine
        caps at `max_sequence_length` (longer prompts are truncated, as the pipelines do)."""
        if self.family is None:
            raise EngineError(f"engine {self.name} is not running")
        return len(self.family.tokenizer(prompt, add_special_tokens=True).input_ids)

    @property
    def video(self) -> bool:
        """The pipeline makes clips (`frames` per job) rather than single images."""
        return self.family is not None and self.family.video

    @property
    def frame_multiple(self) -> int:
        """Clips are `frame_multiple`·k + 1 frames long (1 for image families)."""
        return self.family.frame_multiple if self.family is not None else 1

    # ---- requests -------------------------------------------------------------------------
    async def generate(self, job: DiffusionJob) -> AsyncIterator[dict[str, Any]]:
        """Events of one job: `progress {step, steps}` after each step, `latents
        {step, latents}` every `preview_every` steps, then `image {image: uint8 HWC,
        latents: the final latents}` (image families) or `video {frames: uint8
        [frames, H, W, 3], latents}` (video families).
        Leaving the iteration early cancels the job at the next step boundary."""
        self.require_alive()
        if self._new is None or self._task is None or self._task.done() or self.family is None:
            raise EngineError(f"engine {self.name} is not running")
        self.family.check(job)
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
                if ev["type"] in ("image", "video"):
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
            if batch:
                started = time.monotonic()
                try:
                    await loop.run_in_executor(self._executor, self._step, batch)
                except Exception as exc:  # noqa: BLE001
                    log.exception("engine %s: a step failed", self.name)
                    self._fail(batch, exc)
                    continue
                self.steps += 1
                self.rows += sum(j.rows for j in batch)
                metrics.ENGINE_BATCH.labels(engine=self.name).observe(sum(j.rows for j in batch))
                metrics.ENGINE_STEP_SECONDS.labels(engine=self.name).observe(time.monotonic() - started)
                for j in batch:
                    j.events.put_nowait({"type": "progress", "step": j.step, "steps": j.steps})
                    if j.preview_every and j.step % j.preview_every == 0 and j.step < j.steps:
                        assert j.latents is not None
                        j.events.put_nowait({"type": "latents", "step": j.step, "latents": j.latents.detach().cpu().numpy().copy()})
            done = [j for j in self._active if j.latents is not None and not j.cancelled and j.step >= j.steps]
            if not done:
                if not batch:
                    continue
            elif batch and not any(j.state.get("held") for j in done) and self._one_step_behind():
                for j in done:  # decoded with it after its last step (held once: the next round decodes)
                    j.state["held"] = True
            else:
                try:
                    images = await loop.run_in_executor(self._executor, self._decode, done)
                except Exception as exc:  # noqa: BLE001
                    log.exception("engine %s: decoding failed", self.name)
                    self._fail(done, exc)
                    continue
                for j, out in zip(done, images, strict=True):
                    assert j.latents is not None
                    latents = j.latents.detach().cpu().numpy().copy()
                    if self.video:
                        j.events.put_nowait({"type": "video", "frames": out, "latents": latents})
                    else:
                        j.events.put_nowait({"type": "image", "image": out, "latents": latents})
                    j.latents = None
                    j.state.clear()
                self._active = [j for j in self._active if j not in done]
            # let the consumers run (and cancel) before the next step
            await asyncio.sleep(0)

    def _fail(self, jobs: list[DiffusionJob], exc: Exception) -> None:
        for j in jobs:
            j.events.put_nowait({"type": "error", "error": f"engine {self.name} failed: {exc}"})
        self._active = [j for j in self._active if j not in jobs]

    def _one_step_behind(self) -> bool:
        """A running job is one step from its end: waiting that step lets the jobs
        that just finished share its decode. (Steps run the oldest job's shape first,
        so a job that close is one of theirs.)"""
        return any(j.steps - j.step == 1 for j in self._running())

    def _running(self) -> list[DiffusionJob]:
        return [j for j in self._active if j.latents is not None and not j.cancelled and j.step < j.steps]

    def _next_batch(self) -> list[DiffusionJob]:
        """Running jobs of the oldest job's shape, oldest first, up to max_batch rows."""
        ready = sorted(self._running(), key=lambda j: j.arrived)
        if not ready:
            return []
        assert self.family is not None
        key = self.family.key(ready[0])
        batch: list[DiffusionJob] = []
        rows = 0
        for j in ready:
            if self.family.key(j) == key and (rows + j.rows <= self.max_batch or not batch):
                batch.append(j)
                rows += j.rows
        return batch

    # ---- on the engine thread ----------------------------------------------------------------
    def _prepare(self, jobs: list[DiffusionJob]) -> None:
        """Text conditioning, starting noise and the schedule of new jobs."""
        fam = self.family
        assert fam is not None
        encoded = self._encode([j.prompt for j in jobs] + [j.negative_prompt or "" for j in jobs if fam.uses_cfg(j)])
        for j in jobs:
            j.cond = encoded[j.prompt]
            j.uncond = encoded[j.negative_prompt or ""] if fam.uses_cfg(j) else None
            fam.prepare(j)

    def _encode(self, prompts: list[str]) -> dict[str, tuple[torch.Tensor, ...]]:
        """The family's text conditioning of each distinct prompt: the kept ones from the
        cache, the others encoded in one batch (and kept, the least recently used out).
        The tensors are shared: nothing writes to them."""
        assert self.family is not None
        out = {p: self._prompts[p] for p in prompts if p in self._prompts}
        for p in out:
            self._prompts.move_to_end(p)
        new = list(dict.fromkeys(p for p in prompts if p not in out))
        if new:
            out.update(zip(new, self.family.encode(new), strict=True))
            if self.prompt_cache:
                for p in new:
                    self._prompts[p] = out[p]
                while len(self._prompts) > self.prompt_cache:
                    self._prompts.popitem(last=False)
        return out

    def _step(self, batch: list[DiffusionJob]) -> None:
        assert self.family is not None
        if self.cache is None:
            self.family.step(batch)
            return
        # diffusers' cache hooks compare each forward with the previous one of the same
        # rows: a batch whose jobs changed (one joined, left, or another shape ran in
        # between) starts from a full forward
        rows = tuple((j.id, j.cfg) for j in batch)
        tf = self.pipe.transformer
        if rows != self._cached_batch:
            tf._reset_stateful_cache()
            self._cached_batch = rows
        with tf.cache_context("batch"):
            self.family.step(batch)

    def _decode(self, jobs: list[DiffusionJob]) -> list[np.ndarray]:
        assert self.family is not None
        return self.family.decode(jobs)
