"""A deterministic stand-in for an AR engine (tests, benches of the runtime itself).

Same `generate` contract as `VllmEngine`: an async generator of new token ids that
stops at `max_tokens` or a stop token and forgets the request when the consumer
stops early.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import numpy as np

from omni_rt.engines.base import Engine


class FakeArEngine(Engine):
    def __init__(self, name: str = "fake", vocab_size: int = 1000, step_ms: float = 0.0, tokens_per_step: int = 1) -> None:
        self.name = name
        self.vocab_size = vocab_size
        self.step = step_ms / 1000.0
        self.tokens_per_step = tokens_per_step
        self.running: set[str] = set()
        self.started: list[str] = []
        self.aborted: list[str] = []

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
        sampling: dict[str, Any],
    ) -> AsyncIterator[list[int]]:
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
