"""Image bench: closed loop of C concurrent `/v1/images/generations` callers.

For each level C, C workers send requests back to back (n=1, the pipeline's default
size and steps unless given) for `duration` seconds. Per level: requests/s, latency
percentiles, the engine's mean batch (rows per transformer step, from /metrics).
Target: requests/s at C=4 / at C=1 >= 1.9 (step batching: concurrent requests share
each denoising step).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from clients.images import ImageClient, ImageError
from latency_bench import finish, machine_info, utc_now
from latency_bench.machine import histogram
from latency_bench.stats import scaling_target, summarize

SCHEMA = "omni-rt.latency_bench.image/1"


def _batch_stats(base_url: str, api_key: str | None) -> tuple[float, float]:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    h = histogram(httpx.get(f"{base_url}/metrics", headers=headers, timeout=30).text, "omni_rt_engine_batch_size", engine="dit")
    return h.get("_count", 0.0), h.get("_sum", 0.0)


async def run_level(base_url: str, api_key: str | None, c: int, duration: float, fields: dict[str, Any]) -> dict[str, Any]:
    lat: list[float] = []
    errors: list[str] = []
    steps0, rows0 = _batch_stats(base_url, api_key)

    async def worker(i: int) -> None:
        async with ImageClient(base_url, api_key) as client:
            end = time.perf_counter() + duration
            k = 0
            while time.perf_counter() < end:
                t = time.perf_counter()
                try:
                    await client.generate_raw(f"a lighthouse at dusk, variation {i}-{k}", seed=1000 * i + k, **fields)
                    lat.append(time.perf_counter() - t)
                except (ImageError, httpx.HTTPError) as exc:
                    errors.append(str(exc))
                k += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(c)))
    wall = time.perf_counter() - t0
    steps1, rows1 = _batch_stats(base_url, api_key)
    return {
        "concurrency": c,
        "requests": len(lat),
        "failed": len(errors),
        "errors": sorted(set(errors))[:5],
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(lat) / wall, 3) if wall > 0 else None,
        "latency_s": summarize(lat),
        "mean_rows_per_step": round((rows1 - rows0) / (steps1 - steps0), 2) if steps1 > steps0 else None,
    }


def run(base_url: str, api_key: str | None, levels: list[int], duration: float, warmup: int, fields: dict[str, Any]) -> dict[str, Any]:
    async def go() -> list[dict[str, Any]]:
        async with ImageClient(base_url, api_key) as client:
            for k in range(warmup):
                await client.generate_raw("warm up", seed=k, **fields)
        return [await run_level(base_url, api_key, c, duration, fields) for c in levels]

    lv = asyncio.run(go())
    by = {x["concurrency"]: x for x in lv}
    targets = scaling_target(by, "requests_per_s", 4, 1, 1.9)
    return {"schema": SCHEMA, "created": utc_now(), "machine": machine_info(), "url": base_url, "request": fields,
            "duration_s": duration, "levels": lv, "targets": targets}


def main_image(args: Any) -> int:
    levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    if not levels or min(levels) < 1 or args.duration <= 0:
        print("error: --concurrency levels must be >= 1 and --duration > 0")
        return 2
    fields = {k: v for k, v in (("size", args.size), ("num_inference_steps", args.steps)) if v is not None}
    from latency_bench.server import bench_url

    with bench_url(args, "image") as url:
        result = run(url, args.api_key, levels, args.duration, args.warmup, fields)
    print(f"{'C':>3} {'requests':>9} {'fail':>5} {'req/s':>7} {'lat p50':>8} {'lat p99':>8} {'rows/step':>9}")
    for lvl in result["levels"]:
        f = lambda d, k: f"{d[k]:.3f}" if d.get(k) is not None else "-"  # noqa: E731
        print(f"{lvl['concurrency']:>3} {lvl['requests']:>9} {lvl['failed']:>5} {lvl['requests_per_s']:>7} "
              f"{f(lvl['latency_s'], 'p50'):>8} {f(lvl['latency_s'], 'p99'):>8} {lvl['mean_rows_per_step']!s:>9}")
    finish(args.json, result)
    return 1 if any(lvl["failed"] for lvl in result["levels"]) else 0
