"""Scripted stand-ins for the engines, with the real engines' contracts
(`omni_rt.engines.base`): what a processor can do with a real engine it can do with
these, deterministically and fast (`step_s` of wall time per step: the speed factor).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import numpy as np

from omni_rt.engines.base import Engine
from omni_rt.errors import EngineRequestError


class FakeArEngine(Engine):
    """An AR engine: `generate` yields new token ids per step until `max_tokens` or a
    stop token, and forgets the request when the consumer stops early (as vLLM
    aborts it). Tokens come from a seeded generator (the seed, else the prompt), drawn
    from `allowed_token_ranges` / `allowed_token_ids` minus the stop tokens."""

    def __init__(
        self, name: str = "fake", vocab_size: int = 1000, step_ms: float = 0.0, tokens_per_step: int = 1, max_model_len: int | None = None
    ) -> None:
        self.name = name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.step = step_ms / 1000.0
        self.tokens_per_step = tokens_per_step
        self.running: set[str] = set()
        self.started: list[str] = []
        self.aborted: list[str] = []
        self.prompts: dict[str, dict[str, Any]] = {}  # request id -> what it was asked (tests read it)

    def load(self) -> int:
        return len(self.running)

    def running_requests(self) -> set[str]:
        return set(self.running)

    async def generate(
        self,
        request_id: str,
        *,
        prompt_token_ids: list[int] | None = None,
        prompt_embeds: Any = None,
        encoder_audio: tuple[Any, int] | None = None,
        multi_modal_data: Mapping[str, Any] | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
        sampling: dict[str, Any],
    ) -> AsyncIterator[list[int]]:
        self.require_alive()
        if (prompt_token_ids is None) == (prompt_embeds is None):
            raise EngineRequestError(f"{self.name}: pass exactly one of prompt_token_ids / prompt_embeds")
        if request_id in self.running:
            raise EngineRequestError(f"{self.name}: request {request_id!r} already running")
        self.check_prompt_length(len(prompt_token_ids) if prompt_token_ids is not None else len(prompt_embeds))
        self.prompts[request_id] = {"prompt_token_ids": prompt_token_ids, "prompt_embeds": prompt_embeds, "multi_modal_data": multi_modal_data, "sampling": dict(sampling)}
        seed = sampling.get("seed")
        prompt = list(prompt_token_ids or [])
        rng = np.random.default_rng(seed if seed is not None else (hash(tuple(prompt)) & 0xFFFFFFFF))
        allowed = sampling.get("allowed_token_ids")
        ranges = sampling.get("allowed_token_ranges")
        if ranges:
            allowed = [t for lo, hi in ranges for t in range(lo, hi)]
        pool = np.asarray(allowed if allowed else range(self.vocab_size))
        stop = set(sampling.get("stop_token_ids") or [])
        pool = pool[~np.isin(pool, list(stop))] if stop else pool
        remaining = int(sampling.get("max_tokens", 16))
        self.running.add(request_id)
        self.started.append(request_id)
        finished = False
        try:
            while remaining > 0:
                await asyncio.sleep(self.step)
                n = min(self.tokens_per_step, remaining)
                remaining -= n
                yield [int(t) for t in rng.choice(pool, size=n)]
            finished = True
        finally:
            self.running.discard(request_id)
            if not finished:
                self.aborted.append(request_id)

    async def abort(self, request_id: str) -> None:
        self.running.discard(request_id)


class FakeStepEngine(Engine):
    """A step engine: `run(x, priority, op)` answers `fn(op, x)` after `step_s`."""

    def __init__(self, fn: Callable[[str | None, Any], Any], name: str = "fake-steps", step_s: float = 0.0) -> None:
        self.name = name
        self.fn = fn
        self.step_s = step_s
        self.items = 0
        self._running = 0

    def load(self) -> int:
        return self._running

    def queue_depth(self) -> int:
        return 0  # every item starts at once: nothing waits

    async def run(self, x: Any, priority: int = 1, op: str | None = None, deadline: float | None = None) -> Any:
        self.require_alive()
        self._running += 1
        try:
            await asyncio.sleep(self.step_s)
            self.items += 1
            return self.fn(op, x)
        finally:
            self._running -= 1


class FakeDiffusionEngine(Engine):
    """A diffusion engine: `generate(job)` yields `progress` after each of the job's
    steps, then `image` (uint8 [H, W, 3], a colour from the job's seed and prompt)
    with its `latents` ([tokens, 4] float32); leaving the iteration cancels it."""

    size_multiple = 16
    max_sequence_length = 32

    def __init__(self, name: str = "fake-dit", step_s: float = 0.0) -> None:
        self.name = name
        self.step_s = step_s
        self.active = 0
        self.cancelled = 0

    def load(self) -> int:
        return self.active

    @staticmethod
    def prompt_tokens(prompt: str) -> int:
        return len(prompt.split())  # a word a token

    async def generate(self, job: Any) -> AsyncIterator[dict[str, Any]]:
        self.require_alive()
        m = self.size_multiple
        if job.height % m or job.width % m or job.height < m or job.width < m:
            raise EngineRequestError(f"height and width must be positive multiples of {m}, got {job.width}x{job.height}")
        self.active += 1
        done = False
        try:
            for step in range(1, int(job.steps) + 1):
                await asyncio.sleep(self.step_s)
                yield {"type": "progress", "step": step, "steps": job.steps}
            rng = np.random.default_rng([int(job.seed) & 0xFFFFFFFF, len(str(job.prompt))])
            colour = rng.integers(0, 256, 3, dtype=np.uint8)
            image = np.broadcast_to(colour, (job.height, job.width, 3)).copy()
            tokens = (job.height // m) * (job.width // m)
            done = True
            yield {"type": "image", "image": image, "latents": rng.standard_normal((tokens, 4), dtype=np.float32)}
        finally:
            self.active -= 1
            if not done:
                self.cancelled += 1


class FakeVideoDiffusionEngine(FakeDiffusionEngine):
    """A video-family diffusion engine: clips of `frame_multiple`·k + 1 frames, or, for
    a diffusion-forcing chunk (`job.prefix`: latents [C, P, h, w]), `frame_multiple`·k
    new frames; `generate(job)` yields `progress` after each step, then `video` (uint8
    [frames, H, W, 3], frame i a colour from the job's seed, prompt and i) with latents
    [4, latent frames, h, w] (a chunk's prefix first, unchanged)."""

    video = True
    frame_multiple = 4

    async def generate(self, job: Any) -> AsyncIterator[dict[str, Any]]:
        self.require_alive()
        m, f = self.frame_multiple, int(job.frames)
        prefix = getattr(job, "prefix", None)
        if prefix is None and (f < 1 or (f - 1) % m):
            raise EngineRequestError(f"this model makes {m}k+1 frames, got {f}")
        if prefix is not None and (f < m or f % m):
            raise EngineRequestError(f"a chunk after the first is {m}k frames, got {f}")
        async for ev in super().generate(job):
            if ev["type"] != "image":
                yield ev
                continue
            rng = np.random.default_rng([int(job.seed) & 0xFFFFFFFF, len(str(job.prompt))])
            colours = rng.integers(0, 256, (f, 1, 1, 3), dtype=np.uint8)
            frames = np.broadcast_to(colours, (f, job.height, job.width, 3)).copy()
            new = f // m if prefix is not None else (f - 1) // m + 1
            s = self.size_multiple // 2
            latents = rng.standard_normal((4, new, job.height // s, job.width // s), dtype=np.float32)
            if prefix is not None:
                latents = np.concatenate([np.asarray(prefix, np.float32), latents], axis=1)
            yield {"type": "video", "frames": frames, "latents": latents}
