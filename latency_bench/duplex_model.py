"""Full-duplex model bench (`latency_bench duplex --model moshi`): S conversations at once
on `/v1/duplex?model=moshi`, each speaking in real time for `--seconds` while the model
answers every 80 ms frame.

Per level, measured in one run:
- the server's batched step per frame (`omni_rt_duplex_step_seconds`, the histogram's
  change over the level: p50/p99 bucket bounds, mean) against the 80 ms budget;
- late frames: frames whose step overran the frame (the server's `duplex.frame.late`
  events, per session), and playout stalls a client playing the frames back to back
  behind an 80 ms jitter buffer would hear;
- admitted / refused (`capacity`) sessions, and sessions admitted with zero late frames;
- CPU cores per session of the server's process tree (when the bench started it).

After the server levels (the server stopped, so nothing else runs), the same step is
timed in this process on the same checkpoint: all S conversations in one batched step
against S steps one conversation at a time (how a one-conversation-per-process server
such as the reference one would spend the machine), S = each level.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from clients.duplex import DuplexClient
from latency_bench import finish, machine_info, utc_now
from latency_bench.machine import bucket_bound, histogram
from latency_bench.realtime import utterance
from latency_bench.stats import summarize
from omni_rt.load import tree_cpu_seconds

SCHEMA = "omni-rt.latency_bench.duplex_model/1"
FRAME_S = 0.08
STEP_METRIC = "omni_rt_duplex_step_seconds"


def _stalls_ms(arrivals: list[float], buffer_s: float = FRAME_S) -> list[float]:
    """Stalls (ms) of frames played back to back, starting `buffer_s` after the first."""
    if not arrivals:
        return []
    play = arrivals[0] + buffer_s
    stalls = []
    for t in arrivals:
        if t > play:
            stalls.append((t - play) * 1000)
            play = t
        play += FRAME_S
    return stalls


async def _conversation(url: str, key: str | None, pcm: bytes, seconds: float) -> dict[str, Any]:
    try:
        c = await DuplexClient.connect(url, key)
    except Exception as exc:  # noqa: BLE001 - a refusal is a result
        code = getattr(exc, "code", None) or (getattr(exc, "event", {}) or {}).get("error", {}).get("code")
        return {"admitted": False, "refused": str(code or type(exc).__name__), "message": str(exc)[:200]}
    line = (pcm * (int(seconds * 48000 / max(1, len(pcm))) + 1))[: int(seconds * 48000)]
    t0 = time.monotonic()
    await c.stream_audio(line)
    end = time.monotonic()
    await asyncio.sleep(0.3)
    events = c.drain()
    await c.send("session.close")  # a socket closed without it detaches: the model would keep its slot for the grace
    try:
        await c.until("session.closed", timeout=10)
    finally:
        await c.close()
    frames = [e["_t"] for e in events if e["type"] == "audio.binary"]
    late = [e for e in events if e["type"] == "duplex.frame.late"]
    during = [t for t in frames if t < end]
    return {
        "admitted": True, "seconds": round(end - t0, 3), "frames": len(frames), "frames_while_speaking": len(during),
        "late_frames": len(late), "stalls_over_100ms": sum(1 for s in _stalls_ms(frames) if s > 100), "stalls_ms": _stalls_ms(frames),
        "first_frame_s": round(frames[0] - t0, 3) if frames else None,
        "text_pieces": sum(1 for e in events if e["type"] == "duplex.text.delta"),
        "errors": [e["error"] for e in events if e["type"] == "error"][:3],
    }


async def run_level(base: str, key: str | None, sessions: int, pcm: bytes, seconds: float, ps: Any) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = base.replace("http", "ws", 1) + "/v1/duplex?model=moshi"
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=30) as api:
        before = histogram((await api.get("/metrics")).text, STEP_METRIC)
        cpu0, t0 = (tree_cpu_seconds(ps) if ps else None), time.monotonic()
        results = await asyncio.gather(*(_conversation(url, key, pcm, seconds) for _ in range(sessions)))
        wall = time.monotonic() - t0
        cpu = tree_cpu_seconds(ps) - cpu0 if ps and cpu0 is not None else None
        after = histogram((await api.get("/metrics")).text, STEP_METRIC)
    admitted = [r for r in results if r["admitted"]]
    steps = after.get("_count", 0) - before.get("_count", 0)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return {
        "sessions": sessions, "admitted": len(admitted), "refused": [r["refused"] for r in results if not r["admitted"]],
        "admitted_with_zero_late_frames": sum(1 for r in admitted if r["late_frames"] == 0),
        "late_frames_per_session": [r["late_frames"] for r in admitted],
        "stalls_over_100ms_per_session": [r["stalls_over_100ms"] for r in admitted],
        "frames_per_session": [r["frames"] for r in admitted],
        "frames_while_speaking_per_session": [r["frames_while_speaking"] for r in admitted],
        "first_frame_s": summarize([r["first_frame_s"] for r in admitted if r["first_frame_s"] is not None]),
        "server_step_ms": {
            "steps": int(steps),
            "mean": round((after.get("_sum", 0) - before.get("_sum", 0)) / steps * 1000, 2) if steps else None,
            "p50_le": (v * 1000 if (v := bucket_bound(delta, 0.5)) is not None else None),
            "p99_le": (v * 1000 if (v := bucket_bound(delta, 0.99)) is not None else None),
            "budget": FRAME_S * 1000,
        },
        "cpu_cores_per_session": round(cpu / wall / max(1, len(admitted)), 3) if cpu is not None and wall > 0 else None,
        "errors": [e for r in admitted for e in r["errors"]][:5],
    }


def offline_steps(model_dir: str, levels: list[int], frames: int = 25) -> list[dict[str, Any]]:
    """The batched step against one conversation at a time, in this process."""
    import torch

    from pipelines.moshi.steps import FRAME, MoshiSteps

    sampling = {"text_temperature": 0.7, "audio_temperature": 0.8, "text_top_k": 25, "audio_top_k": 250}
    out = []
    rng = np.random.default_rng(0)
    for n in levels:
        steps = MoshiSteps.load(model_dir)
        samp = {k: torch.full((n,), v) for k, v in sampling.items()}
        one = {k: torch.full((1,), v) for k, v in sampling.items()}
        pcm = torch.from_numpy(rng.standard_normal((n, FRAME)).astype(np.float32) * 0.1)
        batched, single = [], []
        with torch.inference_mode():
            for f in range(frames):
                fresh = torch.full((n,), f == 0)
                t = time.perf_counter()
                steps.step(torch.arange(n), pcm, fresh, torch.arange(n), **samp)
                batched.append(time.perf_counter() - t)
                t = time.perf_counter()
                for i in range(n):  # the same frames, one conversation at a time (slots n..2n-1)
                    steps.step(torch.tensor([n + i]), pcm[i : i + 1], fresh[:1], torch.tensor([i]), **one)
                single.append(time.perf_counter() - t)
        b, s = float(np.median(batched[3:])), float(np.median(single[3:]))
        out.append({"sessions": n, "batched_step_ms_p50": round(b * 1000, 2), "one_at_a_time_ms_p50": round(s * 1000, 2),
                    "speedup": round(s / b, 2) if b > 0 else None, "fits_80ms_batched": b <= FRAME_S, "fits_80ms_one_at_a_time": s <= FRAME_S})
    return out


def main_model(args: Any) -> int:
    levels = [int(x) for x in str(args.sessions).split(",") if x.strip()]
    if args.model != "moshi":
        print(f"error: --model {args.model}: the full-duplex model bench knows 'moshi'")
        return 2
    pcm, source = utterance(args.wav)
    server = None
    base = args.url
    ps = None
    model_dir = None
    if base is None:
        import yaml

        import pipelines
        from latency_bench.server import ServerProcess
        from omni_server.app import DEFAULT_MODELS_DIR

        log_dir = Path(args.json).parent if args.json else Path("bench-out")
        log_dir.mkdir(parents=True, exist_ok=True)
        deploy = Path(args.deploy) if args.deploy else log_dir / "duplex-moshi-deploy.yaml"
        if not args.deploy:
            deploy.write_text(yaml.safe_dump({"pipelines": {n: {"enabled": n == "moshi"} for n in pipelines.PIPELINES}}))
        server = ServerProcess(port=args.port, deploy=deploy, log_path=log_dir / "duplex-moshi-server.log", env=dict(os.environ))
        server.start()
        server.wait_ready(timeout_s=600)
        base = f"http://127.0.0.1:{args.port}"
        ps = server._ps
        root = Path(os.environ.get("OMNI_RT_MODELS_DIR") or DEFAULT_MODELS_DIR).expanduser()
        model_dir = str(root / "tiny-moshi") if not args.deploy else None
    try:

        async def go() -> list[dict[str, Any]]:
            await run_level(base, args.api_key, 1, pcm, 1.5, None)  # warm-up
            return [await run_level(base, args.api_key, s, pcm, args.seconds, ps) for s in levels]

        lv = asyncio.run(go())
    finally:
        if server is not None:
            server.stop()
    offline = offline_steps(model_dir, levels) if model_dir else None
    targets: dict[str, Any] = {}
    for lvl in lv:
        targets[f"admitted_sessions_zero_late_frames_at_{lvl['sessions']}"] = {
            "goal": "every admitted session: 0 late frames", "value": f"{lvl['admitted_with_zero_late_frames']}/{lvl['admitted']}",
            "met": lvl["admitted"] > 0 and lvl["admitted_with_zero_late_frames"] == lvl["admitted"]}
    result = {"schema": SCHEMA, "created": utc_now(), "machine": machine_info(), "url": base, "model": args.model, "utterance": source,
              "seconds_per_session": args.seconds, "levels": lv, "offline_step": offline, "targets": targets}
    print(f"full-duplex {args.model}: each session speaks {args.seconds} s in real time ({source}); 80 ms frames")
    print(f"{'S':>3} {'admitted':>8} {'0 late':>7} {'late/sess':>10} {'step mean':>10} {'step p99<=':>10} {'CPU/sess':>9}")
    for x in lv:
        st = x["server_step_ms"]
        print(f"{x['sessions']:>3} {x['admitted']:>8} {x['admitted_with_zero_late_frames']:>7} {max(x['late_frames_per_session'] or [0]):>10} "
              f"{st['mean'] if st['mean'] is not None else '-':>10} {st['p99_le'] if st['p99_le'] is not None else '-':>10} "
              f"{x['cpu_cores_per_session'] if x['cpu_cores_per_session'] is not None else '-':>9}")
    for o in offline or []:
        print(f"offline step at {o['sessions']}: batched {o['batched_step_ms_p50']} ms vs one at a time {o['one_at_a_time_ms_p50']} ms (x{o['speedup']})")
    finish(args.json, result)
    return 0
