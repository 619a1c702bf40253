"""World-model bench: S concurrent `/v1/world` rollouts, steps back to back.

Per level S, S sessions (64x64 frames unless `--size`, the pipeline's default steps
unless `--steps`) each send `world.step` with a varying action and wait for
`world.step.done`, for `duration` seconds. Per level: step latency (sent → frame
received, and → done), frames/s per session and in all (every frame counts: a model may
render several a step).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from clients.world import WorldClient, WorldError
from latency_bench import finish, machine_info, utc_now
from latency_bench.stats import ratio, summarize

SCHEMA = "omni-rt.latency_bench.world/1"


async def _session(url: str, api_key: str | None, i: int, duration: float, size: int, steps: int | None) -> dict[str, Any]:
    try:
        w = await WorldClient.connect(url, api_key)
    except (WorldError, OSError) as exc:
        return {"ok": False, "error": str(exc), "frame_s": [], "step_s": [], "frames": 0}
    frame_s: list[float] = []
    step_s: list[float] = []
    frames = 0
    async with w:
        try:
            await w.update(prompt=f"a rollout {i}", width=size, height=size, seed=i, **({"steps": steps} if steps else {}))
            dim = int(w.session["action_dim"])
            await w.step([0.0] * dim)  # warm-up frame
            t_start = time.perf_counter()
            k = 0
            while time.perf_counter() - t_start < duration:
                action = [math.sin(k + j) for j in range(dim)]
                t = time.perf_counter()
                await w.send("world.step", action=action)
                await w.until("world.frame")
                frame_s.append(time.perf_counter() - t)
                frames += 1
                while (await w.until({"world.frame", "world.step.done"}))["type"] == "world.frame":
                    frames += 1  # a model may render several frames a step
                step_s.append(time.perf_counter() - t)
                k += 1
            wall = time.perf_counter() - t_start
        except (WorldError, OSError, asyncio.TimeoutError) as exc:
            return {"ok": False, "error": str(exc), "frame_s": frame_s, "step_s": step_s, "frames": frames}
    return {"ok": True, "frame_s": frame_s, "step_s": step_s, "wall_s": wall, "frames": frames}


async def run_level(url: str, api_key: str | None, sessions: int, duration: float, size: int, steps: int | None) -> dict[str, Any]:
    results = await asyncio.gather(*(_session(url, api_key, i, duration, size, steps) for i in range(sessions)))
    ok = [r for r in results if r["ok"]]
    per = [r["frames"] / r["wall_s"] for r in ok if r["wall_s"] > 0]
    return {
        "sessions": sessions,
        "steps": sum(len(r["step_s"]) for r in results),
        "frames": sum(r["frames"] for r in results),
        "failed_sessions": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]}),
        "step_to_frame_s": summarize([x for r in results for x in r["frame_s"]]),
        "step_s": summarize([x for r in results for x in r["step_s"]]),
        "frames_per_s_per_session": round(sum(per) / len(per), 3) if per else None,
        "frames_per_s": round(sum(per), 3) if per else None,
    }


def main_world(args: Any) -> int:
    levels = [int(x) for x in str(args.sessions).split(",") if x.strip()]
    if not levels or min(levels) < 1 or args.duration <= 0:
        print("error: --sessions levels must be >= 1 and --duration > 0")
        return 2
    from latency_bench.server import bench_url

    with bench_url(args, "world", "ws", "/v1/world") as url:
        lv = asyncio.run(_levels(url, args.api_key, levels, args.duration, args.size, args.steps))
    by = {x["sessions"]: x for x in lv}
    result = {"schema": SCHEMA, "created": utc_now(), "machine": machine_info(), "url": url, "size": args.size, "steps": args.steps,
              "duration_s": args.duration, "levels": lv,
              "scaling": {"frames_per_s_4_over_1": ratio(by[4]["frames_per_s"], by[1]["frames_per_s"])} if 1 in by and 4 in by else {}}
    print(f"{'S':>3} {'frames':>7} {'fail':>5} {'step→frame p50':>15} {'p99':>7} {'frames/s/session':>17} {'frames/s':>9}")
    for x in lv:
        f = lambda d, k: f"{d[k]:.3f}" if d.get(k) is not None else "-"  # noqa: E731
        print(f"{x['sessions']:>3} {x['frames']:>7} {x['failed_sessions']:>5} {f(x['step_to_frame_s'], 'p50'):>15} "
              f"{f(x['step_to_frame_s'], 'p99'):>7} {x['frames_per_s_per_session']!s:>17} {x['frames_per_s']!s:>9}")
    finish(args.json, result)
    return 1 if any(x["failed_sessions"] for x in lv) else 0


async def _levels(url: str, api_key: str | None, levels: list[int], duration: float, size: int, steps: int | None) -> list[dict[str, Any]]:
    return [await run_level(url, api_key, s, duration, size, steps) for s in levels]
