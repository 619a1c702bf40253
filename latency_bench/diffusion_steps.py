"""The diffusers step engine's own costs, in process (no server): the median time of
one denoising step carrying R rows and of decoding R images, per frame size, for a
diffusers pipeline directory (the tiny Flux image model by default). `batching_ceiling`
= R x the 1-row step over the R-row step: the most that sharing steps can give at that
size, before the per-request work (text encoding, decoding, encoding the PNG, HTTP)
that does not batch.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from latency_bench import finish, machine_info, utc_now
from latency_bench.stats import ratio


def step_timings(model_dir: str, sizes: list[int], rows: list[int], repeat: int) -> dict[str, Any]:
    """The diffusers step engine's own step and decode, in process: the median time of
    one denoising step (one transformer forward and the scheduler steps) carrying R
    rows, and of decoding R images, per frame size. What batching can give at most at
    a size: R x the 1-row step over the R-row step."""
    from omni_rt.engines.diffusers_engine import DiffusersEngine, DiffusionJob

    async def go() -> dict[str, Any]:
        eng = DiffusersEngine(model_dir, name="steps", max_sequence_length=32)
        await eng.start()
        out: dict[str, Any] = {}
        ids = iter(range(1, 1 << 30))
        try:
            for size in sizes:
                entry: dict[str, Any] = {"step_ms": {}, "decode_ms": {}}
                for r in rows:
                    jobs = [DiffusionJob(f"prompt {i}", size, size, 10**6, seed=i) for i in range(r)]
                    for j in jobs:
                        j.id = next(ids)
                    eng._prepare(jobs)
                    for _ in range(2):
                        eng._step(jobs)
                    ts = []
                    for _ in range(repeat):
                        t = time.perf_counter()
                        eng._step(jobs)
                        ts.append(time.perf_counter() - t)
                    entry["step_ms"][str(r)] = round(statistics.median(ts) * 1000, 3)
                    t = time.perf_counter()
                    eng._decode(jobs)
                    entry["decode_ms"][str(r)] = round((time.perf_counter() - t) * 1000, 3)
                top = str(max(rows))
                entry["batching_ceiling"] = ratio(max(rows) * entry["step_ms"]["1"], entry["step_ms"][top]) if "1" in entry["step_ms"] else None
                out[str(size)] = entry
        finally:
            await eng.stop()
        return out

    return {"schema": "omni-rt.latency_bench.diffusion_steps/1", "created": utc_now(), "machine": machine_info(),
            "config": {"model": model_dir, "sizes": sizes, "rows": rows, "repeat": repeat}, "sizes": asyncio.run(go())}


def main_diffusion_steps(args: Any) -> int:
    model = args.model
    if model is None:
        from omni_rt.specs import DeployOverlay
        from omni_server.app import models_dir
        from pipelines.tiny import build_tiny

        model = str(build_tiny(models_dir(DeployOverlay()))["image"])
    sizes = [int(x) for x in str(args.sizes).split(",") if x.strip()]
    rows = [int(x) for x in str(args.rows).split(",") if x.strip()]
    result = step_timings(model, sizes, rows, args.repeat)
    print(f"{'size':>6} " + " ".join(f"{'step ms R=' + str(r):>13}" for r in rows) + " " + " ".join(f"{'decode R=' + str(r):>11}" for r in rows) + "  ceiling")
    for size, e in result["sizes"].items():
        print(f"{size:>6} " + " ".join(f"{e['step_ms'][str(r)]:>13}" for r in rows) + " " + " ".join(f"{e['decode_ms'][str(r)]:>11}" for r in rows)
              + f"  {e['batching_ceiling']}")
    finish(args.json, result)
    return 0
