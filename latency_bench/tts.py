"""Closed-loop TTS latency bench.

For each concurrency level C the bench keeps exactly C requests in flight: C workers
each send a request, wait for its full answer, and send the next one, until N
requests have been issued for that level (so in-flight drops below C only for the
last C-1 requests of the level, which drain). Nothing is issued beyond N and every
issued request is counted: failures are recorded as errors with their status and
message, never dropped. A few warm-up requests are sent (sequentially) before the
first level and reported separately.

Metrics per request (raw samples are kept in the JSON): TTFP (request sent -> first
non-empty audio payload), E2EL (request sent -> end of body), audio seconds, RTF =
E2EL / audio seconds. Per level: TTFP/E2EL percentiles and mean, RTF mean and p90,
audio_s_per_s = total audio seconds of successful requests / wall time of the level
(first request sent -> last request finished).

`--compare` starts one server per deploy variant (latency_bench/variants/*.yaml),
runs the same levels against each, records the peak RSS of the server's process tree,
stops it, and prints ratios between variants from that one run.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from clients.tts import SpeechError, speak
from latency_bench import finish, machine_info, utc_now, write_json
from latency_bench.stats import summarize
from latency_bench.tts_report import compute_ratios, engine_ratios, format_report, level_line, tts_targets

SCHEMA = "omni-rt.latency_bench.tts/1"
VARIANTS_DIR = Path(__file__).resolve().parent / "variants"
DEFAULT_VARIANTS = ("split_chunk", "split_batch", "fused")
DEFAULT_TEXT = (
    "Hello! This is the omni realtime latency benchmark. "
    "It measures how quickly the first audio arrives and how fast speech is generated."
)
PERCENTILES = (50, 90, 99)


@dataclass
class TtsOptions:
    text: str = DEFAULT_TEXT
    voice: str = "tara"
    response_format: str = "pcm"
    stream_format: str = "audio"
    speed: float = 1.0
    seed: int | None = None
    model: str = "tts"
    timeout_s: float = 120.0
    warmup: int = 2


def default_requests(concurrency: int) -> int:
    return max(2 * concurrency, 16)


def parse_levels(spec: str) -> list[int]:
    levels: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            c = int(part)
        except ValueError:
            raise ValueError(f"concurrency level {part!r} is not an integer") from None
        if c < 1:
            raise ValueError(f"concurrency level must be >= 1, got {c}")
        if c not in levels:
            levels.append(c)
    if not levels:
        raise ValueError("no concurrency levels given")
    return levels


# -- one request --------------------------------------------------------------------


async def _one(client: httpx.AsyncClient, base_url: str, opts: TtsOptions, idx: int, t_ref: float) -> dict[str, Any]:
    start = time.perf_counter()
    rec: dict[str, Any] = {"i": idx, "start_s": start - t_ref}
    try:
        r = await speak(
            client,
            base_url,
            opts.text,
            voice=opts.voice,
            response_format=opts.response_format,
            stream_format=opts.stream_format,
            speed=opts.speed,
            seed=opts.seed,
            model=opts.model,
            keep_audio=False,
        )
        rec.update(
            ok=True,
            status=r.status,
            ttfp_ms=None if r.ttfp_s is None else r.ttfp_s * 1000.0,
            e2el_ms=r.e2el_s * 1000.0,
            audio_s=r.audio_s,
            audio_bytes=r.audio_bytes,
            rtf=r.rtf,
            chunks=r.chunks,
            max_gap_ms=None if r.max_gap_s is None else r.max_gap_s * 1000.0,
        )
    except SpeechError as e:
        rec.update(
            ok=False,
            status=e.status,
            e2el_ms=None if e.elapsed_s is None else e.elapsed_s * 1000.0,
            error=e.message,
            error_type=e.type,
            error_code=e.code,
        )
    except Exception as e:  # transport errors, timeouts, truncated bodies
        rec.update(ok=False, status=None, e2el_ms=(time.perf_counter() - start) * 1000.0,
                   error=f"{type(e).__name__}: {e}", error_type=type(e).__name__, error_code=None)
    rec["end_s"] = time.perf_counter() - t_ref
    return rec


def _client(concurrency: int, timeout_s: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, trust_env=False)


# -- levels -------------------------------------------------------------------------


async def closed_loop(concurrency: int, n_requests: int, one: Callable[[int, float], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """One level: `concurrency` workers issue `n_requests` in all, each waiting for
    its last (`one(index, t0)` returns the request's record); the level's summary."""
    if concurrency < 1 or n_requests < 1:
        raise ValueError("concurrency and requests must be >= 1")
    samples: list[dict[str, Any]] = []
    issued = 0
    in_flight = 0
    max_in_flight = 0
    cpu0 = _cpu_s()
    t0 = time.perf_counter()

    async def worker() -> None:
        nonlocal issued, in_flight, max_in_flight
        while issued < n_requests:
            idx = issued
            issued += 1
            in_flight += 1
            max_in_flight = max(max_in_flight, in_flight)
            try:
                rec = await one(idx, t0)
            finally:
                in_flight -= 1
            samples.append(rec)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, n_requests))))
    wall = time.perf_counter() - t0
    samples.sort(key=lambda s: s["i"])
    return summarize_level(samples, concurrency=concurrency, requests=n_requests, wall_s=wall,
                           max_in_flight=max_in_flight, client_cpu_s=_cpu_s() - cpu0)


async def run_closed_loop(base_url: str, concurrency: int, n_requests: int, opts: TtsOptions) -> dict[str, Any]:
    """Run one level over HTTP; returns its summary with raw samples."""
    if concurrency < 1 or n_requests < 1:
        raise ValueError("concurrency and requests must be >= 1")
    async with _client(concurrency, opts.timeout_s) as client:
        return await closed_loop(concurrency, n_requests, lambda idx, t0: _one(client, base_url, opts, idx, t0))


async def run_warmup(base_url: str, opts: TtsOptions) -> dict[str, Any]:
    samples = []
    async with _client(1, opts.timeout_s) as client:
        t0 = time.perf_counter()
        for i in range(opts.warmup):
            samples.append(await _one(client, base_url, opts, i, t0))
    return {
        "requests": len(samples),
        "errors": sum(1 for s in samples if not s["ok"]),
        "samples": samples,
    }


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def summarize_level(
    samples: list[dict[str, Any]],
    *,
    concurrency: int,
    requests: int,
    wall_s: float,
    max_in_flight: int,
    client_cpu_s: float | None = None,
) -> dict[str, Any]:
    ok = [s for s in samples if s["ok"]]
    errs = [s for s in samples if not s["ok"]]
    ttfp = [s["ttfp_ms"] for s in ok]
    e2el = [s["e2el_ms"] for s in ok]
    rtf = [s["rtf"] for s in ok]
    if any(s["audio_s"] is None for s in ok):
        audio_total = None  # compressed format: duration unknown, do not guess
    else:
        audio_total = sum(s["audio_s"] for s in ok)
    ttfp_sum = summarize(ttfp, PERCENTILES)
    e2el_sum = summarize(e2el, PERCENTILES)
    rtf_sum = summarize(rtf, PERCENTILES)
    return {
        "concurrency": concurrency,
        "requests": requests,
        "completed": len(samples),
        "ok": len(ok),
        "errors": len(errs),
        "no_audio": sum(1 for s in ok if not s.get("audio_bytes")),
        "error_statuses": {str(k): v for k, v in Counter(s["status"] for s in errs).items()},
        "error_messages": [{"message": m, "count": c} for m, c in Counter(s["error"] for s in errs).most_common(5)],
        "wall_s": wall_s,
        "max_in_flight": max_in_flight,
        "client_cpu_s": client_cpu_s,
        "ttfp_ms": ttfp_sum,
        "e2el_ms": e2el_sum,
        "rtf": {"mean": rtf_sum["mean"], "p50": rtf_sum["p50"], "p90": rtf_sum["p90"], "max": rtf_sum["max"],
                "n": rtf_sum["n"]},
        "audio_s_total": audio_total,
        "audio_s_per_s": None if audio_total is None or wall_s <= 0 else audio_total / wall_s,
        "requests_per_s": len(samples) / wall_s if wall_s > 0 else None,
        "samples": samples,
    }


async def bench_levels(
    base_url: str,
    levels: Sequence[int],
    opts: TtsOptions,
    requests: int | None = None,
    log=print,
) -> dict[str, Any]:
    """Warm-up, then every level in order. Returns {"warmup", "levels": {"C": summary}}."""
    out: dict[str, Any] = {"warmup": None, "levels": {}}
    if opts.warmup > 0:
        out["warmup"] = await run_warmup(base_url, opts)
        w = out["warmup"]
        log(f"  warm-up: {w['requests']} requests, {w['errors']} errors")
    for c in levels:
        n = requests if requests is not None else default_requests(c)
        lvl = await run_closed_loop(base_url, c, n, opts)
        out["levels"][str(c)] = lvl
        log("  " + level_line(lvl))
    return out


def _envelope(mode: str, levels: Sequence[int], requests: int | None, opts: TtsOptions) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "created": utc_now(),
        "mode": mode,
        "machine": machine_info(),
        "config": {
            "levels": list(levels),
            "requests_per_level": {str(c): requests if requests is not None else default_requests(c) for c in levels},
            **asdict(opts),
        },
        "variants": {},
        "ratios": {},
    }


# -- entry points -------------------------------------------------------------------


def run_url(url: str, levels: Sequence[int], opts: TtsOptions, requests: int | None = None,
            json_path: str | None = None, log=print) -> dict[str, Any]:
    result = _envelope("url", levels, requests, opts)
    log(f"== url {url}")
    t0 = time.perf_counter()
    res = asyncio.run(bench_levels(url, levels, opts, requests, log=log))
    result["variants"]["url"] = {
        "url": url,
        "deploy": None,
        "server_rss_mib_peak": None,
        "bench_s": time.perf_counter() - t0,
        **res,
    }
    result["ratios"] = compute_ratios(result["variants"])
    write_json(json_path, result)
    return result


def resolve_variant(spec: str) -> tuple[str, Path]:
    """A variant name (latency_bench/variants/NAME.yaml) or a path to a deploy YAML."""
    if spec.endswith((".yaml", ".yml")) or os.sep in spec:
        p = Path(spec)
        return p.stem, p.resolve()
    return spec, VARIANTS_DIR / f"{spec}.yaml"


def run_compare(
    variants: Iterable[str],
    levels: Sequence[int],
    opts: TtsOptions,
    requests: int | None = None,
    json_path: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8100,
    startup_timeout_s: float = 300.0,
    stop_timeout_s: float = 20.0,
    server_cmd: str | None = None,
    log_dir: str | None = None,
    engines: bool = False,
    log=print,
) -> dict[str, Any]:
    """Each variant's server in turn; with `engines`, then the first variant's talker
    and decoder driven directly in this process (`latency_bench.tts_engines`): the
    engines' own limit the server is measured against."""
    from latency_bench.server import ServerError, ServerProcess

    resolved = [resolve_variant(v) for v in variants]
    names = [n for n, _ in resolved]
    if len(set(names)) != len(names):
        raise ValueError(f"variant names must be unique, got {names}")
    for name, path in resolved:
        if not path.is_file():
            raise FileNotFoundError(f"deploy file for variant {name!r} not found: {path}")
    if log_dir is None:
        log_dir = str(Path(json_path).parent / "server-logs") if json_path else "bench-out/server-logs"
    stamp = time.strftime("%Y%m%d-%H%M%S")

    result = _envelope("compare", levels, requests, opts)
    result["config"].update(host=host, port_base=port, startup_timeout_s=startup_timeout_s,
                            stop_timeout_s=stop_timeout_s, server_cmd=server_cmd)
    for i, (name, deploy) in enumerate(resolved):
        vport = port + i
        log_path = Path(log_dir) / f"{stamp}-{name}.log"
        srv = ServerProcess(host=host, port=vport, deploy=deploy, log_path=log_path, command=server_cmd)
        entry: dict[str, Any] = {
            "deploy": str(deploy),
            "url": srv.url,
            "command": srv.command,
            "server_log": str(log_path),
            "server_rss_mib_peak": None,
            "server_rss_mib_ready": None,
            "server_ready_s": None,
            "levels": {},
            "warmup": None,
        }
        result["variants"][name] = entry
        log(f"== {name}: starting server on {srv.url} (deploy {deploy}, log {log_path})")
        try:
            srv.start()
            entry["server_ready_s"] = srv.wait_ready(startup_timeout_s)
            entry["server_rss_mib_ready"] = srv.rss_last_mib
            log(f"  ready in {entry['server_ready_s']:.1f}s, tree RSS {srv.rss_last_mib:.0f} MiB")
            t0 = time.perf_counter()
            entry.update(asyncio.run(bench_levels(srv.url, levels, opts, requests, log=log)))
            entry["bench_s"] = time.perf_counter() - t0
        except (ServerError, OSError) as e:
            entry["error"] = f"{type(e).__name__}: {e}"
            log(f"  FAILED: {entry['error']}")
        finally:
            # False means the server died during the run (its requests show as errors).
            entry["server_alive_before_stop"] = srv.proc is not None and srv.proc.poll() is None
            srv.stop(int_timeout_s=stop_timeout_s)
            entry["server_rss_mib_peak"] = srv.rss_peak_mib if srv.rss_samples else None
            entry["server_rss_samples"] = srv.rss_samples
            entry["server_rss_peak_procs"] = srv.rss_peak_procs
            entry["server_returncode"] = srv.returncode
            entry["server_stop_signal"] = srv.stop_signal
            result["ratios"] = compute_ratios(
                {n: v for n, v in result["variants"].items() if not v.get("error")}
            )
            write_json(json_path, result)  # partial results survive a later failure
    if engines:
        name, deploy = resolved[0]
        log(f"== engines of {name}: its talker and decoder driven directly, in this process")
        from latency_bench.tts_engines import engine_levels

        t0 = time.perf_counter()
        try:
            result["engines"] = {"variant": name, **asyncio.run(engine_levels(deploy, levels, opts, requests, log=log))}
        except Exception as e:  # noqa: BLE001 - reported with the results, like a server that failed
            result["engines"] = {"variant": name, "error": f"{type(e).__name__}: {e}"}
            log(f"  FAILED: {result['engines']['error']}")
        result["engines"]["bench_s"] = time.perf_counter() - t0
        result["ratios"].update(engine_ratios(result))
        result["targets"] = tts_targets(result)
        write_json(json_path, result)
    return result


def has_failures(result: dict[str, Any]) -> bool:
    return any(v.get("error") for v in result["variants"].values())


def main_tts(args) -> int:
    try:
        levels = parse_levels(args.concurrency)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    opts = TtsOptions(
        text=args.text,
        voice=args.voice,
        response_format=args.format,
        stream_format=args.stream_format,
        speed=args.speed,
        seed=args.seed,
        model=args.model,
        timeout_s=args.timeout,
        warmup=args.warmup,
    )
    if args.compare:
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        try:
            result = run_compare(
                variants, levels, opts, args.requests, args.json,
                host=args.host, port=args.port, startup_timeout_s=args.startup_timeout,
                stop_timeout_s=args.stop_timeout, server_cmd=args.server_cmd, log_dir=args.log_dir,
                engines=args.engines,
            )
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    else:
        result = run_url(args.url, levels, opts, args.requests, args.json)
    print()
    print(format_report(result))
    finish(args.json, result)
    return 1 if has_failures(result) or (result.get("engines") or {}).get("error") else 0
