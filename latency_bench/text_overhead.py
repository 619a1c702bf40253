"""Text-only TTFT through omni-rt vs the same thinker on a bare vLLM `AsyncLLM`.

Same run, same machine, one after the other:

1. omni-rt: a server is started (default deploy) and, for each concurrency C, a closed
   loop of streaming `POST /v1/chat/completions` (text only: one-shot session ->
   orchestrator -> thinker on vLLM -> SSE) measures TTFT = request sent -> first
   content delta.
2. bare vLLM: the server is stopped and the same thinker checkpoint is started as an
   `AsyncLLM` in this process with the same engine arguments; the same prompt (the
   chat template rendered to token ids) and the same sampling run in the same closed
   loop; TTFT = generate() called -> first output token.

Reported per C: p50/p90 TTFT of both and the ratio omni-rt / bare (goal <= 1.05 at
C=32). Both sides run `max_tokens` tokens per request.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import httpx

from latency_bench import finish, machine_info, utc_now
from latency_bench.stats import ratio, summarize

SCHEMA = "omni-rt.latency_bench.text_overhead/1"
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is a realtime server?"}]


async def closed_loop(concurrency: int, n: int, one: Callable[[int], Awaitable[float]]) -> dict[str, Any]:
    issued = 0
    ttfts: list[float] = []
    errors: list[str] = []

    async def worker() -> None:
        nonlocal issued
        while issued < n:
            i = issued
            issued += 1
            try:
                ttfts.append(await one(i))
            except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
                errors.append(f"{type(exc).__name__}: {exc}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"concurrency": concurrency, "requests": n, "errors": errors, "wall_s": round(time.perf_counter() - t0, 3), "ttft_s": summarize(ttfts)}


async def omni_levels(base_url: str, api_key: str | None, levels: list[int], max_tokens: int, warmup: int) -> list[dict[str, Any]]:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max(levels) + 4, max_keepalive_connections=max(levels) + 4)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120, limits=limits) as client:

        async def one(i: int) -> float:
            body = {"model": "gpt-4o-audio-preview", "messages": MESSAGES, "max_tokens": max_tokens, "stream": True, "seed": i}
            t0 = time.perf_counter()
            ttft = None
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                async for line in r.aiter_lines():
                    if ttft is None and line.startswith("data: {"):
                        d = json.loads(line[6:])
                        if d.get("choices") and d["choices"][0]["delta"].get("content"):
                            ttft = time.perf_counter() - t0
            if ttft is None:
                raise RuntimeError("no content delta")
            return ttft

        for i in range(warmup):
            await one(i)
        return [await closed_loop(c, max(2 * c, 16), one) for c in levels]


async def bare_levels(model_dir: str, engine_args: dict[str, Any], levels: list[int], max_tokens: int, warmup: int) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    box = [AsyncLLM.from_engine_args(AsyncEngineArgs(model=model_dir, **engine_args))]
    try:

        async def one(i: int) -> float:
            llm = box[0]
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=i, ignore_eos=True)
            t0 = time.perf_counter()
            ttft = None
            async for _ in llm.generate({"prompt_token_ids": ids}, sp, request_id=f"bare-{i}-{time.monotonic_ns()}"):
                if ttft is None:
                    ttft = time.perf_counter() - t0
            assert ttft is not None
            return ttft

        for i in range(warmup):
            await one(i)
        return [await closed_loop(c, max(2 * c, 16), one) for c in levels]
    finally:
        box[0].shutdown()
        box.clear()  # collected now, not by __del__ at interpreter exit (noisy there)
        import gc

        gc.collect()


def thinker_engine(model_dir: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The thinker's engine args and child environment as the server resolves them,
    minus omni-rt's own logits processor (the baseline is plain vLLM)."""
    import pipelines
    from omni_rt.engines.vllm import VllmEngine
    from omni_rt.specs import DeployOverlay, apply_overlay

    stage = apply_overlay(pipelines.load_builtin("voice"), DeployOverlay()).stage("thinker")
    eng = VllmEngine(model_dir, dict(stage.engine_args))
    args = eng.resolved_engine_args()
    args.pop("model")
    args.pop("logits_processors", None)
    return args, eng._child_env()


def main_text_overhead(args: Any) -> int:
    levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    if not levels or min(levels) < 1:
        print("error: --concurrency levels must be >= 1")
        return 2
    from latency_bench.server import ServerProcess
    from pipelines.tiny import build_tiny

    models_dir = Path(os.environ.get("OMNI_RT_MODELS_DIR", "~/.cache/omni-rt/models")).expanduser()
    thinker_dir = str(build_tiny(models_dir)["thinker"])
    log_dir = Path(args.json).parent if args.json else Path("bench-out")
    log_dir.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(port=args.port, log_path=log_dir / "text-overhead-server.log", env=dict(os.environ, OMNI_RT_MODELS_DIR=str(models_dir)))
    server.start()
    try:
        server.wait_ready(timeout_s=600)
        omni = asyncio.run(omni_levels(f"http://127.0.0.1:{args.port}", None, levels, args.max_tokens, args.warmup))
    finally:
        server.stop()
    engine_args, env = thinker_engine(thinker_dir)
    os.environ.update(env)  # as the server's engine children get it
    bare = asyncio.run(bare_levels(thinker_dir, engine_args, levels, args.max_tokens, args.warmup))
    rows = []
    for o, b in zip(omni, bare):
        rows.append({
            "concurrency": o["concurrency"],
            "omni_rt": o,
            "bare_vllm": b,
            "ttft_p50_ratio": ratio(o["ttft_s"]["p50"], b["ttft_s"]["p50"]),
            "ttft_p90_ratio": ratio(o["ttft_s"]["p90"], b["ttft_s"]["p90"]),
        })
    result: dict[str, Any] = {"schema": SCHEMA, "created": utc_now(), "machine": machine_info(), "thinker": thinker_dir,
                              "max_tokens": args.max_tokens, "levels": rows, "targets": {}}
    top = max(rows, key=lambda r: r["concurrency"])
    result["targets"]["ttft_p50_ratio_at_max_c"] = {"goal": "<= 1.05", "concurrency": top["concurrency"], "value": top["ttft_p50_ratio"],
                                                   "met": top["ttft_p50_ratio"] is not None and top["ttft_p50_ratio"] <= 1.05}
    print(f"{'C':>4} {'omni p50 ms':>12} {'bare p50 ms':>12} {'ratio p50':>10} {'ratio p90':>10} {'errors':>7}")
    for r in rows:
        o, b = r["omni_rt"]["ttft_s"], r["bare_vllm"]["ttft_s"]
        f = lambda v: f"{v * 1000:.1f}" if v is not None else "-"  # noqa: E731
        g = lambda v: f"{v:.3f}" if v is not None else "-"  # noqa: E731
        print(f"{r['concurrency']:>4} {f(o['p50']):>12} {f(b['p50']):>12} {g(r['ttft_p50_ratio']):>10} {g(r['ttft_p90_ratio']):>10} "
              f"{len(r['omni_rt']['errors']) + len(r['bare_vllm']['errors']):>7}")
    t = result["targets"]["ttft_p50_ratio_at_max_c"]
    print(f"target ttft p50 ratio at C={t['concurrency']}: {t['value']} {t['goal']} -> {'met' if t['met'] else 'NOT met'}")
    finish(args.json, result)
    return 1 if any(r["omni_rt"]["errors"] or r["bare_vllm"]["errors"] for r in rows) else 0
