"""Transcriptions bench: closed loop of C concurrent `POST /v1/audio/transcriptions`
callers (the official SDK's request: multipart WAV, `model`, `response_format` json).

For each level C, C workers send the same utterance (espeak-ng speech, else noise)
back to back for `duration` seconds. Per level: requests/s and latency percentiles.
Target: requests/s at C=8 / at C=1 >= 3 (the asr engine batches concurrent
requests: their encoder passes and decode steps share the engine's steps).
"""

from __future__ import annotations

import asyncio
import io
import time
from typing import Any

import httpx

from clients.realtime import write_wav_pcm16
from latency_bench import finish, machine_info, utc_now
from latency_bench.realtime import utterance as realtime_utterance
from latency_bench.stats import scaling_target, summarize

SCHEMA = "omni-rt.latency_bench.transcriptions/1"
TEXT = "Hello, can you tell me what the weather is like today?"


def utterance() -> tuple[bytes, str]:
    """A WAV file of the realtime bench's utterance (espeak-ng speech, else noise) and
    what it is."""
    pcm, what = realtime_utterance(None, TEXT)
    buf = io.BytesIO()
    write_wav_pcm16(buf, pcm)
    return buf.getvalue(), f"{what}: {TEXT!r}"


async def run_level(base_url: str, api_key: str | None, c: int, duration: float, wav: bytes) -> dict[str, Any]:
    lat: list[float] = []
    errors: list[str] = []
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}

    async def worker(client: httpx.AsyncClient) -> None:
        end = time.perf_counter() + duration
        while time.perf_counter() < end:
            t = time.perf_counter()
            try:
                r = await client.post(f"{base_url}/v1/audio/transcriptions", headers=headers,
                                      files={"file": ("speech.wav", wav, "audio/wav")}, data={"model": "whisper-1"})
                if r.status_code != 200:
                    errors.append(f"{r.status_code}: {r.text[:200]}")
                    continue
                lat.append(time.perf_counter() - t)
            except httpx.HTTPError as exc:
                errors.append(str(exc))

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(worker(client) for _ in range(c)))
    wall = time.perf_counter() - t0
    return {
        "concurrency": c,
        "requests": len(lat),
        "failed": len(errors),
        "errors": sorted(set(errors))[:5],
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(lat) / wall, 3) if wall > 0 else None,
        "latency_s": summarize(lat),
    }


def run(base_url: str, api_key: str | None, levels: list[int], duration: float, warmup: int) -> dict[str, Any]:
    wav, what = utterance()

    async def go() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=120) as client:
            headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
            for _ in range(warmup):
                await client.post(f"{base_url}/v1/audio/transcriptions", headers=headers,
                                  files={"file": ("speech.wav", wav, "audio/wav")}, data={"model": "whisper-1"})
        return [await run_level(base_url, api_key, c, duration, wav) for c in levels]

    lv = asyncio.run(go())
    by = {x["concurrency"]: x for x in lv}
    targets = scaling_target(by, "requests_per_s", 8, 1, 3)
    return {"schema": SCHEMA, "created": utc_now(), "machine": machine_info(), "url": base_url, "audio": what,
            "duration_s": duration, "warmup": warmup, "levels": lv, "targets": targets}


def main_transcriptions(args: Any) -> int:
    levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    if not levels or min(levels) < 1 or args.duration <= 0:
        print("error: --concurrency levels must be >= 1 and --duration > 0")
        return 2
    from latency_bench.server import bench_url

    with bench_url(args, "transcriptions") as url:
        result = run(url, args.api_key, levels, args.duration, args.warmup)
    print(f"{'C':>3} {'requests':>9} {'fail':>5} {'req/s':>7} {'lat p50':>8} {'lat p99':>8}")
    for lvl in result["levels"]:
        f = lambda d, k: f"{d[k]:.3f}" if d.get(k) is not None else "-"  # noqa: E731
        print(f"{lvl['concurrency']:>3} {lvl['requests']:>9} {lvl['failed']:>5} {lvl['requests_per_s']:>7} "
              f"{f(lvl['latency_s'], 'p50'):>8} {f(lvl['latency_s'], 'p99'):>8}")
    for name, t in result["targets"].items():
        print(f"target {name}: {t['value']} (goal {t['goal']}: {'met' if t['met'] else 'NOT met'})")
    finish(args.json, result)
    return 1 if any(lvl["failed"] for lvl in result["levels"]) else 0
