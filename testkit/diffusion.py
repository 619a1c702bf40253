"""Helpers of the diffusers step-engine tests: a job's final output, and jobs that
join steps already running."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np


def output_of(ev: dict[str, Any]) -> np.ndarray | None:
    """The pixels of a job's last event (an image family's `image`, a video family's
    `video`), None for the events before it."""
    if ev["type"] == "image":
        image: np.ndarray = ev["image"]
        return image
    if ev["type"] == "video":
        frames: np.ndarray = ev["frames"]
        return frames
    return None


async def staggered(engine: Any, jobs: list[Any]) -> list[np.ndarray]:
    """Run `jobs` so that job i+1 starts once job i has run a step (each joins the
    running loop mid-way); their outputs, in order."""
    started = [asyncio.Event() for _ in jobs]

    async def run(i: int, job: Any) -> np.ndarray:
        if i:
            await started[i - 1].wait()
        async for ev in engine.generate(job):
            if ev["type"] == "progress":
                started[i].set()
            elif (out := output_of(ev)) is not None:
                return out
        raise AssertionError("the job ended without its output")

    return list(await asyncio.gather(*(run(i, j) for i, j in enumerate(jobs))))
