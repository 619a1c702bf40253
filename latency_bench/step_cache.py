"""diffusers' step cache on the tiny video model, in process (no server).

The same clip (tiny Wan by default: 128x128, 17 frames, 30 steps, one seed) made by the
diffusers step engine without and with `engine_args.cache` (diffusers'
FirstBlockCacheConfig at `--threshold`), the two alternating `--repeat` times after a
warm-up. Reported: the median seconds of each (the whole clip, and its denoising loop:
until the last step, before the decode, which the cache does not touch), the
speed-ups (without ÷ with), and the
output difference of the cached clip from the uncached one (max and mean absolute
difference of the uint8 pixels, and the fraction of pixels more than 8 levels off).
Target: speed-up >= 1.3.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import numpy as np

from latency_bench import finish, machine_info, utc_now
from latency_bench.stats import ratio

SCHEMA = "omni-rt.latency_bench.step_cache/1"


async def _clip(eng: Any, job: Any) -> tuple[np.ndarray, float]:
    """The clip, and the seconds until its last denoising step (the loop a step cache
    speeds up; the decode after it is the same either way)."""
    t0 = time.perf_counter()
    loop_s = 0.0
    async for ev in eng.generate(job):
        if ev["type"] == "progress":
            loop_s = time.perf_counter() - t0
        elif ev["type"] == "video":
            frames: np.ndarray = ev["frames"]
            return frames, loop_s
        elif ev["type"] == "image":
            image: np.ndarray = ev["image"]
            return image, loop_s
    raise RuntimeError("the engine returned nothing")


async def run(model_dir: str, size: int, frames: int, steps: int, threshold: float, repeat: int) -> dict[str, Any]:
    from omni_rt.engines.diffusers_engine import DiffusersEngine, DiffusionJob

    engines = {
        "off": DiffusersEngine(model_dir, name="off", max_sequence_length=32),
        "on": DiffusersEngine(model_dir, name="on", max_sequence_length=32, cache={"type": "first_block", "threshold": threshold}),
    }
    for e in engines.values():
        await e.start()
    times: dict[str, list[float]] = {"off": [], "on": []}
    loops: dict[str, list[float]] = {"off": [], "on": []}
    clips: dict[str, np.ndarray] = {}
    try:
        for i in range(repeat + 1):
            for name, eng in engines.items():
                t = time.perf_counter()
                clips[name], loop_s = await _clip(eng, DiffusionJob("a paper boat on a river", size, size, steps, seed=0, frames=frames))
                if i:  # the first round warms up
                    times[name].append(time.perf_counter() - t)
                    loops[name].append(loop_s)
    finally:
        for e in engines.values():
            await e.stop()
    d = np.abs(clips["on"].astype(int) - clips["off"].astype(int))
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    loop_off, loop_on = statistics.median(loops["off"]), statistics.median(loops["on"])
    speedup = ratio(off, on)
    loop_speedup = ratio(loop_off, loop_on)
    return {
        "schema": SCHEMA, "created": utc_now(), "machine": machine_info(),
        "config": {"model": model_dir, "size": size, "frames": frames, "steps": steps, "threshold": threshold, "repeat": repeat},
        "seconds_off": times["off"], "seconds_on": times["on"], "median_s": {"off": off, "on": on},
        "denoising_median_s": {"off": loop_off, "on": loop_on},
        "difference": {"max_abs": int(d.max()), "mean_abs": float(d.mean()), "over_8_levels": float((d > 8).mean())},
        "targets": {
            "speedup": {"goal": ">= 1.3", "value": speedup, "met": speedup is not None and speedup >= 1.3},
            "denoising_speedup": {"goal": ">= 1.3", "value": loop_speedup, "met": loop_speedup is not None and loop_speedup >= 1.3},
        },
    }


def main_step_cache(args: Any) -> int:
    model = args.model
    if model is None:
        from omni_rt.specs import DeployOverlay
        from omni_server.app import models_dir
        from pipelines.tiny import build_tiny

        model = str(build_tiny(models_dir(DeployOverlay()))["video"])
    result = asyncio.run(run(model, args.size, args.frames, args.steps, args.threshold, args.repeat))
    m, lp, d = result["median_s"], result["denoising_median_s"], result["difference"]
    print(f"step cache (first_block, threshold {args.threshold}) on {args.size}x{args.size}, {args.frames} frames, {args.steps} steps: "
          f"{m['off']:.3f} s without, {m['on']:.3f} s with ({result['targets']['speedup']['value']}x); the denoising loop "
          f"{lp['off']:.3f} s vs {lp['on']:.3f} s ({result['targets']['denoising_speedup']['value']}x); "
          f"difference max {d['max_abs']} mean {d['mean_abs']:.2f} levels, {100 * d['over_8_levels']:.1f}% of pixels > 8")
    finish(args.json, result)
    return 0

