"""Realtime voice-session bench: S concurrent `/v1/realtime` sessions, several turns each.

For each level S, S sessions connect at once; each runs `turns` manual turns: append
the utterance (PCM16 24 kHz: a WAV file, else speech made with espeak-ng when it is
installed, else a noise burst), commit, `response.create`, read to `response.done`.
Per turn, measured from the commit (end of speech): TTFP (first audio delta), TTFT
(first transcript delta), E2E (response.done), audio seconds, RTF = (E2E - TTFP) /
audio seconds (generation time per second of audio once it flows). Per level:
percentiles, failures, audio seconds per wall second. Targets: RTF p50 < 1 at 8
sessions; TTFP p50 at 8 / at 1 <= 3. `--tools N`: N forced function calls against
N guided/unguided chat pairs (`tool_trials`): end of speech -> arguments done, and
guided / unguided decode time per token (goal <= 1.2).

Against a running server (`--url`) or a server it starts itself (default).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from clients.realtime import RealtimeClient, RealtimeError, read_wav_pcm16
from latency_bench import finish, machine_info, utc_now
from latency_bench.stats import ratio, summarize

SCHEMA = "omni-rt.latency_bench.realtime/1"
DEFAULT_TEXT = "Hello, could you tell me what the weather will be like tomorrow?"


def utterance(wav: str | None, text: str = DEFAULT_TEXT) -> tuple[bytes, str]:
    if wav:
        return read_wav_pcm16(wav), f"wav:{wav}"
    exe = shutil.which("espeak-ng")
    if exe:
        with tempfile.TemporaryDirectory() as d:
            path = str(Path(d) / "u.wav")
            subprocess.run([exe, "-v", "en-us", "-w", path, text], check=True, capture_output=True)
            return read_wav_pcm16(path), "espeak-ng"
    rng = np.random.default_rng(0)
    return (rng.standard_normal(24000 * 2) * 3000).astype("<i2").tobytes(), "noise"


async def _session(url: str, api_key: str | None, pcm: bytes, turns: int, max_tokens: int | None, t_ref: float) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    try:
        client = await RealtimeClient.connect(url, api_key)
    except (RealtimeError, OSError) as exc:
        return [{"ok": False, "error": str(exc)}]
    async with client:
        await client.update(audio={"input": {"turn_detection": None}})
        for _ in range(turns):
            t0 = time.perf_counter()
            try:
                response: dict[str, Any] = {"max_output_tokens": max_tokens} if max_tokens else {}
                r = await client.turn(pcm, **response)
            except (RealtimeError, asyncio.TimeoutError, OSError) as exc:
                out.append({"ok": False, "error": str(exc)})
                continue
            ok = r.status == "completed" and r.ttfp_s is not None
            rtf = (r.e2e_s - r.ttfp_s) / r.audio_s if ok and r.ttfp_s is not None and r.audio_s > 0 else None
            # first audio after the thinker's first token: what the talker and vocoder add
            after = r.ttfp_s - r.ttft_s if ok and r.ttfp_s is not None and r.ttft_s is not None else None
            out.append({"ok": ok, "status": r.status, "ttfp_s": r.ttfp_s, "ttft_s": r.ttft_s, "first_audio_after_token_s": after, "e2e_s": r.e2e_s,
                        "audio_s": r.audio_s, "rtf": rtf, "start_s": t0 - t_ref, "end_s": time.perf_counter() - t_ref})
    return out


async def run_level(url: str, api_key: str | None, sessions: int, turns: int, pcm: bytes, max_tokens: int | None) -> dict[str, Any]:
    t_ref = time.perf_counter()
    results = await asyncio.gather(*(_session(url, api_key, pcm, turns, max_tokens, t_ref) for _ in range(sessions)))
    wall = time.perf_counter() - t_ref
    turns_ = [t for r in results for t in r]
    ok = [t for t in turns_ if t["ok"]]
    return {
        "sessions": sessions,
        "turns": len(turns_),
        "failed": len(turns_) - len(ok),
        "errors": sorted({t.get("error") or t.get("status") for t in turns_ if not t["ok"]} - {None}),
        "wall_s": round(wall, 3),
        "ttfp_s": summarize([t["ttfp_s"] for t in ok]),
        "ttft_s": summarize([t["ttft_s"] for t in ok]),
        "first_audio_after_token_s": summarize([t["first_audio_after_token_s"] for t in ok]),
        "e2e_s": summarize([t["e2e_s"] for t in ok]),
        "rtf": summarize([t["rtf"] for t in ok]),
        "audio_s_per_s": round(sum(t["audio_s"] for t in ok) / wall, 3) if wall > 0 else None,
        "samples": turns_,
    }


async def barge_in_trials(url: str, api_key: str | None, pcm: bytes, trials: int) -> dict[str, Any]:
    """Server VAD on; while the agent speaks, the user talks again. Measured on the
    client: `speech_started` received -> the cancelled `response.done` received (the
    old response's last audio byte goes out before it, so this bounds that interval)."""
    silence = bytes(24000 * 2)
    ms: list[float] = []
    skipped = 0
    for _ in range(trials):
        client = await RealtimeClient.connect(url, api_key)
        async with client:
            await client.update(max_output_tokens=120)
            await client.append(silence[: 24000] + pcm + silence)
            t = None
            while t not in ("response.output_audio.delta", "response.done"):
                t = (await client.recv())["type"]
            if t == "response.done":
                skipped += 1
                continue
            await client.append(pcm[: 24000 * 2])
            started = None
            while True:
                ev = await client.recv()
                if ev["type"] == "input_audio_buffer.speech_started" and started is None:
                    started = time.perf_counter()
                if ev["type"] == "response.done":
                    break
            if ev["response"]["status"] != "cancelled" or started is None:
                skipped += 1  # the answer ended before the user cut in
                continue
            ms.append((time.perf_counter() - started) * 1000)
    return {"trials": trials, "measured": len(ms), "skipped": skipped, "speech_started_to_done_ms": summarize(ms), "samples_ms": ms}


# The bench's tool (its arguments need a dozen or two tokens of JSON on any tokenizer).
WEATHER_TOOL = {
    "type": "function", "name": "get_weather", "description": "The weather forecast for a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Lima", "Oslo", "Tokyo"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}},
}


CHAT_MODEL = "gpt-4o-audio-preview"


async def _chat_seconds(http: Any, url: str, body: dict[str, Any]) -> tuple[float, int]:
    """One chat completion: wall seconds, completion tokens."""
    t0 = time.perf_counter()
    r = await http.post(url, json=body)
    r.raise_for_status()
    return time.perf_counter() - t0, int(r.json()["usage"]["completion_tokens"])


async def per_token_pair(http: Any, url: str, tokens: int) -> tuple[float | None, float | None]:
    """Decode time per token, guided (forced calls: the tool-call grammar masks every
    step; parallel calls allowed, so it runs to `tokens`) and unguided (the same
    question, no tools), each as (t(N tokens) - t(1 token)) / (n - 1): the prompt's
    prefill, which the tools lengthen, cancels out."""
    q = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": DEFAULT_TEXT}], "temperature": 0.8}
    tools = {"tools": [{"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}], "tool_choice": "required"}
    out: list[float | None] = []
    for extra in (tools, {}):
        t1, _ = await _chat_seconds(http, url, {**q, **extra, "max_tokens": 1})
        tn, n = await _chat_seconds(http, url, {**q, **extra, "max_tokens": tokens})
        out.append((tn - t1) * 1000 / (n - 1) if n > 1 else None)
    return out[0], out[1]


async def tool_trials(url: str, api_key: str | None, pcm: bytes, turns: int, tokens: int = 48) -> dict[str, Any]:
    """Function calling: `turns` spoken turns in one session answered by a forced call
    (tool_choice required): end of speech (commit) -> `response.function_call_arguments.done`,
    the call's arguments checked against the tool's schema; then `turns` pairs of chat
    requests, guided and unguided alternating (A/B, so drift in the machine's load hits
    both alike), for the decode cost per token of guided decoding (goal <= 1.2x)."""
    import httpx
    import jsonschema

    client = await RealtimeClient.connect(url, api_key)
    calls: list[dict[str, Any]] = []
    valid = 0
    async with client:
        await client.update(audio={"input": {"turn_detection": None}}, output_modalities=["text"])
        for _ in range(turns):
            r = await client.turn(pcm, tools=[WEATHER_TOOL], tool_choice="required")
            ok = r.status == "completed" and len(r.calls) == 1
            if ok:
                try:
                    jsonschema.validate(json.loads(r.calls[0]["arguments"]), WEATHER_TOOL["parameters"])
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    pass
            calls.append({"ok": ok, "status": r.status, "speech_end_to_args_done_s": r.call_done_s, "ttfc_s": r.ttfc_s,
                          "output_tokens": (r.usage or {}).get("output_tokens")})
    chat_url = url.replace("ws://", "http://").replace("wss://", "https://").split("/v1/")[0] + "/v1/chat/completions"
    guided: list[float] = []
    unguided: list[float] = []
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=120, headers=headers) as http:
        for _ in range(turns):
            g, u = await per_token_pair(http, chat_url, tokens)
            if g is not None and u is not None:
                guided.append(g)
                unguided.append(u)
    gs, us = summarize(guided), summarize(unguided)
    return {"turns": turns, "calls_ok": sum(c["ok"] for c in calls), "calls_schema_valid": valid,
            "speech_end_to_args_done_s": summarize([c["speech_end_to_args_done_s"] for c in calls if c["ok"]]),
            "per_token_tokens": tokens, "guided_per_token_ms": gs, "unguided_per_token_ms": us,
            "guided_over_unguided_p50": ratio(gs.get("p50"), us.get("p50")), "samples": calls,
            "pairs_ms": [{"guided": g, "unguided": u} for g, u in zip(guided, unguided, strict=True)]}


def run(url: str, api_key: str | None, levels: list[int], turns: int, wav: str | None, max_tokens: int | None, warmup: int,
        barge_in: int = 0, tools: int = 0) -> dict[str, Any]:
    pcm, source = utterance(wav)

    async def go() -> tuple[list[dict[str, Any]], dict[str, Any] | None, dict[str, Any] | None]:
        if warmup:
            await run_level(url, api_key, 1, warmup, pcm, max_tokens)
        levels_ = [await run_level(url, api_key, s, turns, pcm, max_tokens) for s in levels]
        barge = await barge_in_trials(url, api_key, pcm, barge_in) if barge_in else None
        return levels_, barge, (await tool_trials(url, api_key, pcm, tools) if tools else None)

    lv, barge, tool = asyncio.run(go())
    by = {lvl["sessions"]: lvl for lvl in lv}
    targets: dict[str, Any] = {}
    if 8 in by:
        rtf8 = by[8]["rtf"].get("p50")
        targets["rtf_p50_at_8"] = {"goal": "< 1", "value": rtf8, "met": rtf8 is not None and rtf8 < 1}
    if 1 in by and 8 in by:
        r = ratio(by[8]["ttfp_s"].get("p50"), by[1]["ttfp_s"].get("p50"))
        targets["ttfp_p50_8_over_1"] = {"goal": "<= 3", "value": r, "met": r is not None and r <= 3}
    if barge is not None:
        p99 = barge["speech_started_to_done_ms"].get("p99")
        targets["barge_in_p99_ms"] = {"goal": "<= 100", "value": p99, "met": p99 is not None and p99 <= 100}
    if tool is not None:
        r = tool["guided_over_unguided_p50"]
        targets["guided_per_token_over_unguided"] = {"goal": "<= 1.2", "value": r, "met": r is not None and r <= 1.2}
    return {"schema": SCHEMA, "created": utc_now(), "machine": machine_info(), "url": url, "utterance": source,
            "utterance_s": round(len(pcm) / 48000, 3), "turns_per_session": turns, "max_output_tokens": max_tokens,
            "levels": lv, "barge_in": barge, "tools": tool, "targets": targets}


def compare_profiles(args: Any, levels: list[int]) -> dict[str, Any]:
    """One server per voice profile (only the voice pipeline on), the same levels on each."""

    import yaml

    from latency_bench.server import bench_url, voice_only_overlay

    out: dict[str, Any] = {}
    for profile in [p.strip() for p in str(args.profiles).split(",") if p.strip()]:
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            yaml.safe_dump(voice_only_overlay(profile, also_off=("asr",)), f)
        a = type(args)(**{**vars(args), "deploy": f.name, "url": None})
        with bench_url(a, f"realtime-{profile}", "ws", "/v1/realtime") as url:
            out[profile] = run(url, args.api_key, levels, args.turns, args.wav, args.max_output_tokens, args.warmup)
        Path(f.name).unlink(missing_ok=True)
    first = next(iter(out.values()))
    return {**{k: first[k] for k in ("schema", "created", "machine", "utterance", "utterance_s", "turns_per_session", "max_output_tokens")},
            "profiles": out}


def main_realtime(args: Any) -> int:
    levels = [int(x) for x in str(args.sessions).split(",") if x.strip()]
    if not levels or min(levels) < 1 or args.turns < 1:
        print("error: --sessions levels and --turns must be >= 1")
        return 2
    from latency_bench.server import bench_url

    if getattr(args, "profiles", None):
        if args.url:
            print("error: --profiles starts its own servers (no --url)")
            return 2
        cmp = compare_profiles(args, levels)
        print(f"realtime bench by voice profile ({cmp['utterance']}, {cmp['utterance_s']} s utterance, {args.turns} turns per session)")
        print(f"{'profile':>8} {'S':>3} {'fail':>5} {'TTFT p50':>9} {'1st audio after token p50':>26} {'TTFP p50':>9} {'RTF p50':>8}")
        for name, res in cmp["profiles"].items():
            for lvl in res["levels"]:
                g = lambda d: f"{d['p50']:.3f}" if d.get("p50") is not None else "-"  # noqa: E731
                print(f"{name:>8} {lvl['sessions']:>3} {lvl['failed']:>5} {g(lvl['ttft_s']):>9} {g(lvl['first_audio_after_token_s']):>26} "
                      f"{g(lvl['ttfp_s']):>9} {g(lvl['rtf']):>8}")
        finish(args.json, cmp)
        return 1 if any(lvl["failed"] for r in cmp["profiles"].values() for lvl in r["levels"]) else 0
    with bench_url(args, "realtime", "ws", "/v1/realtime") as url:
        result = run(url, args.api_key, levels, args.turns, args.wav, args.max_output_tokens, args.warmup, args.barge_in, args.tools)
    print(f"realtime bench ({result['utterance']}, {result['utterance_s']} s utterance, {args.turns} turns per session)")
    print(f"{'S':>3} {'turns':>6} {'fail':>5} {'TTFP p50':>9} {'TTFP p90':>9} {'E2E p50':>8} {'RTF p50':>8} {'audio s/s':>9}")
    for lvl in result["levels"]:
        f = lambda d, k: f"{d[k]:.3f}" if d.get(k) is not None else "-"  # noqa: E731
        print(f"{lvl['sessions']:>3} {lvl['turns']:>6} {lvl['failed']:>5} {f(lvl['ttfp_s'], 'p50'):>9} {f(lvl['ttfp_s'], 'p90'):>9} "
              f"{f(lvl['e2e_s'], 'p50'):>8} {f(lvl['rtf'], 'p50'):>8} {lvl['audio_s_per_s']:>9}")
    if result["barge_in"]:
        b = result["barge_in"]
        print(f"barge-in: {b['measured']} measured ({b['skipped']} skipped): speech_started -> response.done ms "
              f"p50 {b['speech_started_to_done_ms']['p50']} p99 {b['speech_started_to_done_ms']['p99']}")
    if result["tools"]:
        t = result["tools"]
        print(f"tools: {t['calls_ok']}/{t['turns']} forced calls ({t['calls_schema_valid']} schema-valid); end of speech -> arguments done s "
              f"p50 {t['speech_end_to_args_done_s'].get('p50')} p90 {t['speech_end_to_args_done_s'].get('p90')}; per token ms guided "
              f"{t['guided_per_token_ms'].get('p50')} / unguided {t['unguided_per_token_ms'].get('p50')} = {t['guided_over_unguided_p50']}")
    finish(args.json, result)
    return 1 if any(lvl["failed"] for lvl in result["levels"]) or (result["tools"] and result["tools"]["calls_ok"] < result["tools"]["turns"]) else 0
