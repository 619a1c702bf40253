"""OpenPI robot-policy bench: R robots in lockstep loops against `/` (OpenPI msgpack).

Per level R, R robots connect at once (each its own session and seed) and call
`infer` with DROID-shaped observations (two 224x224x3 uint8 images, 8 floats of state,
a prompt) back to back for `duration` seconds. Per call: round trip (send → reply),
the server's `server_timing.infer_ms` (observation handed to the pipeline → actions
back) and `policy_timing.infer_ms` (the policy stage's own time). Per level:
percentiles, loop Hz per robot, server overhead = round trip − server infer_ms (what
the protocol, session and transport cost around the policy), aggregate actions/s.

In the same run, the same client measures a no-op openpi-style server (websockets +
msgpack-numpy, as openpi's own server is built, constant actions) in its own process,
twice: answering at once (its round trip is the floor any policy server pays for this
observation) and, after the 1-robot level, holding each reply for that level's
server infer p50 without using the CPU (`?delay_ms=`). The second is the like-for-like
floor: a client that waits ~20 ms for a reply pays more than one in a tight loop (its
process and the server's sleep between frames and wake up cold), and that cost is
counted as overhead by every policy server, openpi's own included.

Targets: overhead p50 at 1 robot <= 1.25 x the instant no-op round trip p50 (the
issue's figure) and <= 1.25 x the delay-matched no-op's overhead (round trip − its
wait); aggregate actions/s at 16 robots >= 3 x at 1 robot. Reported with them
(`step_batching`): the policy's infer time per call at 1 and at the top level, and
what step batching saves there: R calls one after another would take R x the 1-robot
infer p50, batched they take the top level's infer p50 (the R robots' calls run
together).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

from clients.openpi import OpenPIError, PolicyClient, droid_observation
from latency_bench import finish, machine_info, utc_now
from latency_bench.stats import ratio, scaling_target, summarize

SCHEMA = "omni-rt.latency_bench.openpi/1"


def serve_noop(port: int) -> None:
    """A no-op policy server built like openpi's: websockets asyncio server, metadata
    first, msgpack-numpy observation in, constant actions and timings out. A
    connection made with `?delay_ms=D` holds each reply for D ms (asleep: a policy's
    wait without its compute), reported as the infer time."""
    from urllib.parse import parse_qs, urlsplit

    import numpy as np
    from websockets.asyncio.server import serve

    from clients.openpi import packb, unpackb

    actions = np.zeros((10, 8), np.float32)

    async def handler(ws: Any) -> None:
        delay = float(parse_qs(urlsplit(ws.request.path).query).get("delay_ms", ["0"])[0]) / 1000.0
        await ws.send(packb({"action_horizon": 10}))
        prev_total = None
        while True:
            start = time.monotonic()
            try:
                obs = unpackb(await ws.recv())
            except Exception:  # noqa: BLE001 - the client left
                return
            t = time.monotonic()
            if delay:
                await asyncio.sleep(delay)
            result: dict[str, Any] = {"actions": actions, "echo": len(obs)}
            infer = time.monotonic() - t
            result["policy_timing"] = {"infer_ms": infer * 1000}
            result["server_timing"] = {"infer_ms": infer * 1000}
            if prev_total is not None:
                result["server_timing"]["prev_total_ms"] = prev_total * 1000
            await ws.send(packb(result))
            prev_total = time.monotonic() - start

    async def main() -> None:
        async with serve(handler, "127.0.0.1", port, compression=None, max_size=None) as server:
            await server.serve_forever()

    asyncio.run(main())


async def _robot(url: str, api_key: str | None, seed: int, duration: float, warmup: int) -> dict[str, Any]:
    obs = droid_observation(seed)
    try:
        robot = await PolicyClient.connect(url, api_key, seed=seed)
    except (OpenPIError, OSError) as exc:
        return {"ok": False, "error": str(exc), "calls": []}
    calls: list[dict[str, float | None]] = []
    horizon = 0
    async with robot:
        try:
            for _ in range(warmup):
                await robot.infer(obs)
            t_end = time.perf_counter() + duration
            t_start = time.perf_counter()
            while time.perf_counter() < t_end:
                t = time.perf_counter()
                reply = await robot.infer(obs)
                rt = (time.perf_counter() - t) * 1000
                horizon = int(reply["actions"].shape[0])
                calls.append({"rt_ms": rt, "server_infer_ms": reply["server_timing"]["infer_ms"],
                              "policy_infer_ms": reply["policy_timing"]["infer_ms"]})
            wall = time.perf_counter() - t_start
        except (OpenPIError, OSError) as exc:
            return {"ok": False, "error": str(exc), "calls": calls}
    return {"ok": True, "calls": calls, "wall_s": wall, "horizon": horizon}


async def run_level(url: str, api_key: str | None, robots: int, duration: float, warmup: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    results = await asyncio.gather(*(_robot(url, api_key, i, duration, warmup) for i in range(robots)))
    wall = time.perf_counter() - t0
    calls = [c for r in results for c in r["calls"]]
    rt = [c["rt_ms"] for c in calls]
    overhead = [c["rt_ms"] - c["server_infer_ms"] for c in calls]
    outside_policy = [c["rt_ms"] - c["policy_infer_ms"] for c in calls]
    ok = [r for r in results if r["ok"]]
    actions = sum(len(r["calls"]) * r.get("horizon", 0) for r in ok)
    span = max((r["wall_s"] for r in ok), default=0.0)
    return {
        "robots": robots,
        "calls": len(calls),
        "failed_robots": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]}),
        "wall_s": round(wall, 3),
        "round_trip_ms": summarize(rt),
        "server_infer_ms": summarize([c["server_infer_ms"] for c in calls]),
        "policy_infer_ms": summarize([c["policy_infer_ms"] for c in calls]),
        "overhead_ms": summarize(overhead),
        "outside_policy_ms": summarize(outside_policy),
        "loop_hz_per_robot": round(sum(len(r["calls"]) / r["wall_s"] for r in ok) / len(ok), 2) if ok else None,
        "actions_per_s": round(actions / span, 1) if span > 0 else None,
    }


async def noop_baseline(url: str, duration: float, warmup: int) -> dict[str, Any]:
    r = await _robot(url, None, 0, duration, warmup)
    if not r["ok"]:
        return {"ok": False, "error": r["error"]}
    calls = r["calls"]
    return {"ok": True, "calls": len(calls), "round_trip_ms": summarize([c["rt_ms"] for c in calls]),
            "wait_ms": summarize([c["server_infer_ms"] for c in calls]),
            "overhead_ms": summarize([c["rt_ms"] - c["server_infer_ms"] for c in calls])}


def run(url: str, api_key: str | None, levels: list[int], duration: float, warmup: int, noop_url: str | None) -> dict[str, Any]:
    async def go() -> tuple[dict[str, Any] | None, dict[str, Any] | None, list[dict[str, Any]]]:
        base = await noop_baseline(noop_url, duration, warmup) if noop_url else None
        lv: list[dict[str, Any]] = []
        matched = None
        for r in levels:
            lv.append(await run_level(url, api_key, r, duration, warmup))
            wait = lv[-1]["server_infer_ms"].get("p50")
            if noop_url and r == 1 and wait is not None:
                matched = await noop_baseline(f"{noop_url}?delay_ms={wait:.3f}", duration, warmup)
        return base, matched, lv

    base, matched, lv = asyncio.run(go())
    return {"schema": SCHEMA, "created": utc_now(), "machine": machine_info(), "url": url,
            "observation": "droid: 2 x uint8[224,224,3], 7+1 float64 state, prompt", "duration_s": duration,
            "noop_server": base, "noop_server_delay_matched": matched, "levels": lv,
            "targets": targets(base, lv, matched), "step_batching": step_batching(lv)}


def targets(base: dict[str, Any] | None, levels: list[dict[str, Any]], matched: dict[str, Any] | None = None) -> dict[str, Any]:
    """The issue's targets from the no-op baselines (instant, and delay-matched) and
    the levels of one run."""
    by = {lvl["robots"]: lvl for lvl in levels}
    out: dict[str, Any] = {}
    if base is not None and base.get("ok") and 1 in by:
        floor = base["round_trip_ms"]["p50"]
        over = by[1]["overhead_ms"]["p50"]
        r = ratio(over, floor)
        out["overhead_p50_vs_noop_round_trip"] = {"goal": "<= 1.25", "value": r, "overhead_ms": over, "noop_ms": floor,
                                                       "met": r is not None and r <= 1.25}
        outside = by[1]["outside_policy_ms"]["p50"]
        r = ratio(outside, floor)
        out["outside_policy_p50_vs_noop_round_trip"] = {"goal": "<= 1.25", "value": r, "outside_policy_ms": outside,
                                                             "noop_ms": floor, "met": r is not None and r <= 1.25}
    if matched is not None and matched.get("ok") and 1 in by:
        floor = matched["overhead_ms"]["p50"]
        over = by[1]["overhead_ms"]["p50"]
        r = ratio(over, floor)
        out["overhead_p50_vs_delay_matched_noop_overhead"] = {
            "goal": "<= 1.25", "value": r, "overhead_ms": over, "noop_overhead_ms": floor,
            "noop_wait_ms": matched["wait_ms"]["p50"], "met": r is not None and r <= 1.25}
    out.update(scaling_target(by, "actions_per_s", 16, 1, 3))
    return out


def step_batching(levels: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The policy's infer p50 at 1 robot and at the top level, and what batching saves
    there: R calls one after another (R x the 1-robot infer) over R calls batched."""
    by = {lvl["robots"]: lvl for lvl in levels}
    top = max(by, default=0)
    if 1 not in by or top < 2:
        return None
    one, many = by[1]["policy_infer_ms"].get("p50"), by[top]["policy_infer_ms"].get("p50")
    if one is None or many is None:
        return None
    return {"robots": top, "policy_infer_ms_p50_at_1": one, f"policy_infer_ms_p50_at_{top}": many,
            "one_after_another_ms": round(top * one, 3), "saving": ratio(top * one, many)}


def main_openpi(args: Any) -> int:
    levels = [int(x) for x in str(args.robots).split(",") if x.strip()]
    if not levels or min(levels) < 1 or args.duration <= 0 or args.warmup < 0:
        print("error: --robots levels must be >= 1, --duration > 0, --warmup >= 0")
        return 2
    from latency_bench.server import bench_url

    with bench_url(args, "openpi", "ws") as url:
        noop = subprocess.Popen(
            [sys.executable, "-c", f"from latency_bench.openpi import serve_noop; serve_noop({args.noop_port})"],
            process_group=0,
        )
        try:
            _wait_port(args.noop_port)
            result = run(url, args.api_key, levels, args.duration, args.warmup, f"ws://127.0.0.1:{args.noop_port}")
        finally:
            noop.terminate()
            noop.wait(10)
    b = result["noop_server"]
    if b and b.get("ok"):
        print(f"no-op openpi-style server: round trip p50 {b['round_trip_ms']['p50']:.3f} ms, p99 {b['round_trip_ms']['p99']:.3f} ms")
    m = result["noop_server_delay_matched"]
    if m and m.get("ok"):
        print(f"no-op server holding each reply {m['wait_ms']['p50']:.2f} ms: overhead (round trip - wait) "
              f"p50 {m['overhead_ms']['p50']:.3f} ms, p99 {m['overhead_ms']['p99']:.3f} ms")
    print(f"{'R':>3} {'calls':>6} {'RT p50':>8} {'RT p99':>8} {'infer p50':>9} {'ovh p50':>8} {'ovh p99':>8} {'Hz/robot':>9} {'actions/s':>10}")
    for lvl in result["levels"]:
        f = lambda d, k: f"{d[k]:.2f}" if d.get(k) is not None else "-"  # noqa: E731
        print(f"{lvl['robots']:>3} {lvl['calls']:>6} {f(lvl['round_trip_ms'], 'p50'):>8} {f(lvl['round_trip_ms'], 'p99'):>8} "
              f"{f(lvl['server_infer_ms'], 'p50'):>9} {f(lvl['overhead_ms'], 'p50'):>8} {f(lvl['overhead_ms'], 'p99'):>8} "
              f"{lvl['loop_hz_per_robot']:>9} {lvl['actions_per_s']:>10}")
    sb = result["step_batching"]
    if sb:
        top = sb["robots"]
        print(f"step batching at {top} robots: {sb['one_after_another_ms']:.1f} ms one after another vs "
              f"{sb[f'policy_infer_ms_p50_at_{top}']:.1f} ms batched ({sb['saving']}x)")
    finish(args.json, result)
    return 1 if any(lvl["failed_robots"] for lvl in result["levels"]) else 0


def _wait_port(port: int, timeout_s: float = 30.0) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"the no-op server did not listen on port {port}")
