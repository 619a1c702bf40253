"""Session admission bench: open+close cycles per second and admission latency.

Runs a `SessionManager` in this process against the chosen store (`memory`, or
`redis` on loopback) with no pipeline behind it, so it measures the session layer
itself: cap check, slot lease and directory write on open; resource release, slot
return and directory removal on close. For each concurrency level C, C workers each
loop open → close until N cycles in total are done. Reported per level: cycles per
second (wall clock), admission latency (the `open` call) p50/p90/p99/max, close
latency p50/p99, and how many opens were refused (the cap is set to C, so a correct
store never refuses here). Targets (open+close/s: memory ≥ 5,000, redis ≥ 1,000;
p99 admission < 5 ms on redis) are checked against the best level and reported with
the figures. `sessions` is imported only when this bench runs.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from latency_bench import finish, machine_info, utc_now
from latency_bench.stats import percentile

SCHEMA = "omni-rt.latency_bench.sessions/1"
TARGETS = {"memory": {"cycles_per_s": 5000.0}, "redis": {"cycles_per_s": 1000.0, "p99_admission_ms": 5.0}}


async def _level(store: str, redis_url: str, concurrency: int, cycles: int, warmup: int) -> dict[str, Any]:
    from omni_rt.specs import SessionsSpec
    from sessions import SessionLimit, SessionManager

    prefix = f"omni-rt-bench:{uuid.uuid4().hex[:8]}"
    spec = SessionsSpec(
        max_total=concurrency,
        store=store,
        redis_url=redis_url,
        redis_prefix=prefix,
        reaper_interval_s=60,
        slot_lease_ttl_s=600,
    )
    m = SessionManager(spec, node_id="bench")
    await m.start()
    open_s: list[float] = []
    close_s: list[float] = []
    refused = 0
    remaining = 0

    async def worker(record: bool) -> None:
        nonlocal remaining, refused
        while remaining > 0:
            remaining -= 1
            t0 = time.perf_counter()
            try:
                s = await m.open("oneshot", principal="bench")
            except SessionLimit:
                refused += 1
                continue
            t1 = time.perf_counter()
            await m.close(s.id)
            if record:
                open_s.append(t1 - t0)
                close_s.append(time.perf_counter() - t1)

    try:
        remaining = warmup  # untimed: connections opened, scripts loaded
        await worker(record=False)
        remaining = cycles
        t_start = time.perf_counter()
        await asyncio.gather(*(worker(record=True) for _ in range(concurrency)))
        wall = time.perf_counter() - t_start
        left = (await m.counts())["total"]
    finally:
        await m.stop()
    ms = [x * 1000 for x in open_s]
    cms = [x * 1000 for x in close_s]
    return {
        "concurrency": concurrency,
        "cycles": len(open_s),
        "refused": refused,
        "slots_left": left,
        "wall_s": round(wall, 4),
        "cycles_per_s": round(len(open_s) / wall, 1) if wall > 0 else None,
        "admission_ms": {
            "p50": _round(percentile(ms, 50)),
            "p90": _round(percentile(ms, 90)),
            "p99": _round(percentile(ms, 99)),
            "max": round(max(ms), 4),
        },
        "close_ms": {"p50": _round(percentile(cms, 50)), "p99": _round(percentile(cms, 99))},
    }


def run(store: str, redis_url: str, levels: list[int], cycles: int, warmup: int) -> dict[str, Any]:
    results = [asyncio.run(_level(store, redis_url, c, cycles, warmup)) for c in levels]
    best = max(results, key=lambda r: r["cycles_per_s"] or 0)
    target = TARGETS[store]
    checks: dict[str, Any] = {
        "cycles_per_s": {"goal": f">= {target['cycles_per_s']:g}", "value": best["cycles_per_s"], "concurrency": best["concurrency"],
                         "met": (best["cycles_per_s"] or 0) >= target["cycles_per_s"]},
    }
    if "p99_admission_ms" in target:
        worst = max(r["admission_ms"]["p99"] for r in results)
        checks["p99_admission_ms"] = {"goal": f"< {target['p99_admission_ms']:g}", "value": worst, "met": worst < target["p99_admission_ms"]}
    checks["no_refusals_no_leftover_slots"] = {"met": all(r["refused"] == 0 and r["slots_left"] == 0 for r in results)}
    return {
        "schema": SCHEMA,
        "created": utc_now(),
        "machine": machine_info(),
        "store": store,
        "redis_url": redis_url if store == "redis" else None,
        "cycles_per_level": cycles,
        "levels": results,
        "targets": checks,
    }


def main_sessions(args: Any) -> int:
    levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    if not levels or min(levels) < 1 or args.cycles < 1 or args.warmup < 0:
        print("error: --concurrency levels and --cycles must be >= 1, --warmup >= 0")
        return 2
    result = run(args.store, args.redis_url, levels, args.cycles, args.warmup)
    print(f"sessions bench, store={args.store}")
    print(f"{'C':>4} {'cycles/s':>10} {'adm p50 ms':>11} {'adm p99 ms':>11} {'adm max ms':>11} {'close p99':>10} {'refused':>8}")
    for r in result["levels"]:
        a = r["admission_ms"]
        print(f"{r['concurrency']:>4} {r['cycles_per_s']:>10} {a['p50']:>11} {a['p99']:>11} {a['max']:>11} {r['close_ms']['p99']:>10} {r['refused']:>8}")
    finish(args.json, result)
    return 0


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
