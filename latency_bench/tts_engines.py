"""The TTS engines' own limit: the same talker (vLLM) and code2wav decoder (SNAC on
torch) as a server variant, driven directly in this process — no HTTP, sessions,
orchestrator or connectors.

One process builds the runtime of a deploy variant exactly as the server does
(`create_app` with the variant's overlay, only the `tts` pipeline enabled), then each
request calls the talker's own frame generator (`CodecTalker.frames`: the prompt, the
sampling and the segmenting the stage uses) on the stage's vLLM engine and feeds the
frames, through a queue, to a `StreamingDecoder` on the stage's decoder engine with
the variant's chunking (the chunk edge's, or one decode at the end for a batch edge),
as the split and fused stages do. The closed loop, the warm-up and the per-level
summary are `latency_bench.tts`'s, so the figures compare one to one with the
server's: TTFP = request start -> first non-empty audio chunk, audio s/s over the
level's wall time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from latency_bench.tts import TtsOptions, closed_loop, default_requests
from latency_bench.tts_report import level_line

SAMPLE_RATE = 24000  # SNAC 24 kHz


class _Ctx:
    """What the talker's frame generator reads of a stage context."""

    def __init__(self, request_id: str, params: dict[str, Any]) -> None:
        self.request_id = request_id
        self.params = params

    def add_usage(self, **counts: int) -> None:
        pass


def tts_only(deploy: Path) -> Any:
    """The variant's overlay with every pipeline but `tts` disabled."""
    import pipelines
    from omni_rt.specs import load_overlay, parse_overlay

    data = load_overlay(deploy).model_dump(mode="json", exclude_unset=True)
    ps = data.setdefault("pipelines", {})
    for name in pipelines.load_all():
        if name != "tts":
            ps[name] = {**ps.get(name, {}), "enabled": False}
    return parse_overlay(data, str(deploy))


def _parts(runtime: Any) -> tuple[Any, Any, Any, Any]:
    """(CodecTalker, its vLLM engine, the decoder's engine, the chunking or None)."""
    from pipelines.tts import FusedTalkerProcessor, TalkerProcessor

    profile = runtime.profiles["tts"]
    entry = runtime.pools[profile.entry].replicas[0].processor
    if isinstance(entry, FusedTalkerProcessor):
        return entry.talker, entry.ar, entry.decoder, entry.chunking
    if not isinstance(entry, TalkerProcessor):
        raise ValueError(f"the tts entry stage runs {type(entry).__name__}, not a talker")
    edge = next(e for e in profile.edges if e.src == profile.entry)
    decoder = runtime.pools[edge.dst].replicas[0].engine
    return entry.talker, entry.ar, decoder, edge.chunking if edge.mode == "chunk" else None


def one_request(talker: Any, ar: Any, decode: Any, chunking: Any, opts: TtsOptions) -> Callable[[int, float], Any]:
    from pipelines.streaming import DecodeTimes, StreamingDecoder

    times = DecodeTimes()  # the streams share one, as they share the stage's

    async def one(idx: int, t_ref: float) -> dict[str, Any]:
        start = time.perf_counter()
        rec: dict[str, Any] = {"i": idx, "start_s": start - t_ref, "status": None}
        params: dict[str, Any] = {"voice": opts.voice}
        if opts.seed is not None:
            params["seed"] = opts.seed
        ctx = _Ctx(f"engines-{idx}-{time.monotonic_ns()}", params)
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def produce() -> None:
            try:
                async for frames in talker.frames(ctx, ar, opts.text):
                    queue.put_nowait(frames)
            finally:
                queue.put_nowait(None)

        producer = asyncio.get_running_loop().create_task(produce())
        samples = chunks = 0
        ttfp: float | None = None
        try:
            dec = StreamingDecoder(decode, chunking, decode_times=times)
            while True:
                frames = await queue.get()
                out = await (dec.push(frames) if frames is not None else dec.finish())
                for a in out:
                    if len(a):
                        chunks += 1
                        samples += len(a)
                        if ttfp is None:
                            ttfp = time.perf_counter() - start
                if frames is None:
                    break
            await producer
            e2el = time.perf_counter() - start
            audio_s = samples / SAMPLE_RATE
            rec.update(ok=True, ttfp_ms=None if ttfp is None else ttfp * 1000.0, e2el_ms=e2el * 1000.0, audio_s=audio_s,
                       audio_bytes=2 * samples, rtf=e2el / audio_s if audio_s else None, chunks=chunks)
        except Exception as e:  # noqa: BLE001 - recorded like the server bench's failures
            rec.update(ok=False, e2el_ms=(time.perf_counter() - start) * 1000.0, error=f"{type(e).__name__}: {e}",
                       error_type=type(e).__name__, error_code=None)
        finally:
            if not producer.done():
                producer.cancel()
                await asyncio.gather(producer, return_exceptions=True)
        rec["end_s"] = time.perf_counter() - t_ref
        return rec

    return one


async def engine_levels(deploy: Path, levels: Sequence[int], opts: TtsOptions, requests: int | None = None,
                        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Warm-up, then every level, on the variant's engines driven directly. Returns
    {"deploy", "warmup", "levels": {"C": summary}} as `bench_levels` does."""
    from aiohttp import web

    from omni_server.app import RUNTIME, create_app

    app = create_app(tts_only(deploy), f"tts engines bench ({deploy})")
    runner = web.AppRunner(app)
    await runner.setup()  # starts the runtime; nothing listens
    out: dict[str, Any] = {"deploy": str(deploy), "warmup": None, "levels": {}}
    try:
        talker, ar, decoder, chunking = _parts(app[RUNTIME])
        one = one_request(talker, ar, decoder.run, chunking, opts)
        if opts.warmup > 0:
            t0 = time.perf_counter()
            samples = [await one(i, t0) for i in range(opts.warmup)]
            out["warmup"] = {"requests": len(samples), "errors": sum(1 for s in samples if not s["ok"]), "samples": samples}
            log(f"  warm-up: {len(samples)} requests, {out['warmup']['errors']} errors")
        for c in levels:
            n = requests if requests is not None else default_requests(c)
            lvl = await closed_loop(c, n, one)
            out["levels"][str(c)] = lvl
            log("  " + level_line(lvl))
    finally:
        await runner.cleanup()
    return out
