"""Full-duplex voice bench: S concurrent sessions over `/v1/duplex` (WebSocket) or WebRTC.

Each session streams the utterance as live 20 ms frames in real time (then silence),
with server VAD deciding the turn, `turns` times. Per turn, measured on the client:
- `reply_s`: end of speech (last speech frame sent) → first audio of the answer
  (WebSocket: first audio frame; WebRTC: first audible RTP frame). Includes the VAD's
  silence window (`silence_duration_ms`, 500 ms by default), as a user hears it.
- `rtf`: the answer's generation time (response.created → response.done) / its audio.
- pacing: WebRTC, the gap between consecutive RTP audio frames as received (the server
  sends one every 20 ms, silence included); WebSocket, the playout stall a client
  playing the chunks in real time would hear (a gap beyond the audio it has buffered).
Per level: percentiles, the server process tree's CPU per session (when the bench
started the server), and `--barge-in N` trials: the user talks over a long answer;
speech_started at the client → the answer silent (WebRTC: the last audible frame of
the old answer; WebSocket: the cancelled response.done, after which nothing of it
arrives).

Targets: RTF p50 < 1 at 16 sessions; p99 frame gap ≤ 40 ms at 8; barge-in p99 ≤ 100 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from clients.duplex import DuplexClient
from clients.webrtc import CallClient, CallRefused, use_host_addresses
from latency_bench import finish, machine_info, utc_now
from latency_bench.machine import Burner, HealthPoller, LoopStalls, admission_view, bucket_bound, histogram, loop_lag_between, metrics_text, steal_seconds, underruns_between
from latency_bench.realtime import utterance
from latency_bench.stats import summarize
from omni_rt.load import tree_cpu_seconds

SCHEMA = "omni-rt.latency_bench.duplex/1"
SILENCE = bytes(24000 * 2)
AUDIBLE = 64  # |sample| above this counts as sound


def _ws_stalls(chunks: list[tuple[float, int]]) -> list[tuple[float, float]]:
    """Playout holes (when the audio ran out, when more arrived) for chunks (arrival,
    samples @24 kHz) played back to back from the first one's arrival."""
    holes = []
    play_end = None
    for t, n in chunks:
        if play_end is not None and t > play_end:
            holes.append((play_end, t))
        start = t if play_end is None or t > play_end else play_end
        play_end = start + n / 24000
    return holes


def _ws_stall_ms(chunks: list[tuple[float, int]]) -> list[float]:
    """Playout stalls (ms) for chunks (arrival, samples @24 kHz) played back to back."""
    return [(b - a) * 1000 for a, b in _ws_stalls(chunks)]


PACING = {"value": "realtime"}  # --pacing of the WebSocket sessions
BURNER_LEAD_S = 12.0  # a burner runs this long before the sessions: > the admission's CPU window (10 s)


async def _ws_session(base: str, key: str | None, pcm: bytes, turns: int, tokens: int) -> list[dict[str, Any]]:
    out = []
    c = await DuplexClient.connect(base.replace("http", "ws", 1) + "/v1/duplex", key)
    try:
        # binary audio; paced: 20 ms frames in real time by the server, as a player wants it
        await c.update(max_output_tokens=tokens, audio={"output": {"transport": "binary", "pacing": PACING["value"]}})
        for _ in range(turns):
            await c.stream_audio(pcm)  # lead-in and speech
            t_end = time.monotonic()
            sender = asyncio.get_running_loop().create_task(c.stream_audio(SILENCE * 30))  # then silence, as a live line
            seen: list[dict[str, Any]] = []
            try:
                done = await c.until("response.done", seen)
            finally:
                sender.cancel()
            chunks = [(e["_t"], len(e["audio"]) // 2) for e in seen if e["type"] == "audio.binary"]
            created = next((e["_t"] for e in seen if e["type"] == "response.created"), None)
            audio_s = sum(n for _, n in chunks) / 24000
            ok = done["response"]["status"] == "completed" and bool(chunks)
            out.append({
                "ok": ok, "status": done["response"]["status"],
                "reply_s": chunks[0][0] - t_end if chunks else None,
                "rtf": (done["_t"] - created) / audio_s if ok and created and audio_s else None,
                "audio_s": audio_s, "stalls_ms": _ws_stall_ms(chunks), "holes": _ws_stalls(chunks),
                "gaps_ms": [(b[0] - a[0]) * 1000 for a, b in zip(chunks, chunks[1:], strict=False)],
            })
    finally:
        await c.close()
    return out


async def _rtc_session(base: str, key: str | None, pcm: bytes, turns: int, tokens: int) -> list[dict[str, Any]]:
    out = []
    call = await CallClient.connect(base, key, session={"type": "realtime", "max_output_tokens": tokens})
    try:
        for _ in range(turns):
            await call.mic.say(pcm).wait()  # silence follows on its own
            t_end = time.monotonic()
            seen: list[dict[str, Any]] = []
            done = await call.until("response.done", seen)
            await call.until("output_audio_buffer.stopped", seen)
            created = next((e["_t"] for e in seen if e["type"] == "response.created"), None)
            first = call.first_sound(t_end, AUDIBLE)
            heard = [x for t, x in call.frames if created is not None and t >= created]
            audio_s = sum(len(x) for x in heard) / call.frame_rate if heard else 0.0
            ok = done["response"]["status"] == "completed" and first is not None
            out.append({
                "ok": ok, "status": done["response"]["status"],
                "reply_s": first - t_end if first else None,
                "rtf": (done["_t"] - created) / audio_s if ok and created and audio_s else None,
                "audio_s": audio_s,
            })
        times = np.array([t for t, _ in call.frames])
        gaps = list(np.diff(times[len(times) // 10 :]) * 1000) if len(times) > 20 else []
        if out:
            out[-1]["gaps_ms"] = gaps
            tail = times[len(times) // 10 :] if len(times) > 20 else np.array([])
            out[-1]["rtp_gaps"] = [(float(a), float(b)) for a, b in zip(tail, tail[1:], strict=False) if b - a > 0.12]
    finally:
        await call.hangup()
    return out


def _session_fn(transport: str) -> Any:
    return _ws_session if transport == "ws" else _rtc_session


def _line(wav: str | None) -> tuple[bytes, str]:
    """The utterance a session speaks, after a breath of silence (silence follows it on the line)."""
    pcm, source = utterance(wav)
    return SILENCE[:9600] + pcm, source


def _loopback(transport: str, base: str) -> None:
    if transport == "webrtc" and ("127.0.0.1" in base or "localhost" in base):
        use_host_addresses(["127.0.0.1"])


async def run_level(transport: str, base: str, key: str | None, sessions: int, turns: int, pcm: bytes, tokens: int, ps: Any,
                    burner: int = 0) -> dict[str, Any]:
    """S sessions at once, `turns` turns each; with `burner`, beside that many processes
    spinning a core each, started `BURNER_LEAD_S` before the sessions (the server reads
    the machine's load over a window) and stopped after them. Sessions the server
    refuses (capacity, session_limit) are counted as such, with what it said; every
    admitted one is summarised on its own (`per_session`)."""
    fn = _session_fn(transport)
    stalls, poller = LoopStalls(), HealthPoller(base, key)
    with Burner(burner) if burner else contextlib.nullcontext():
        if burner:
            await asyncio.sleep(BURNER_LEAD_S)
        t_before, steal0 = await metrics_text(base, key), steal_seconds()
        since = time.time()
        stalls.start()
        poller.start()
        cpu0, t0 = (tree_cpu_seconds(ps) if ps else None), time.monotonic()
        try:
            results = await asyncio.gather(*(fn(base, key, pcm, turns, tokens) for _ in range(sessions)), return_exceptions=True)
        finally:
            await stalls.stop()
            await poller.stop()
    wall = time.monotonic() - t0
    cpu = tree_cpu_seconds(ps) - cpu0 if ps and cpu0 is not None else None
    steal1 = steal_seconds()
    turns_, errors, per_session, refusals = [], [], [], []
    for r in results:
        if isinstance(r, BaseException):
            why = _refusal(r)
            if why is not None:
                refusals.append(why)
            else:
                errors.append(f"{type(r).__name__}: {r}")
        else:
            turns_.extend(r)
            per_session.append(_session_summary(r, transport, stalls))
    ok = [t for t in turns_ if t["ok"]]
    gaps = [g for t in turns_ for g in t.get("gaps_ms", [])]
    stall_ms = [g for t in turns_ for g in t.get("stalls_ms", [])]
    return {
        "sessions": sessions, "burner_processes": burner, "admitted": len(per_session), "refused": len(refusals), "refusals": refusals[:5],
        "turns": len(turns_), "failed": len(turns_) - len(ok) + len(errors), "errors": errors[:5],
        "wall_s": round(wall, 3),
        "reply_s": summarize([t["reply_s"] for t in ok]),
        "rtf": summarize([t["rtf"] for t in ok]),
        "frame_gap_ms": summarize(gaps) if gaps else {},
        "playout_stall_ms": summarize(stall_ms) if stall_ms else {},
        "admitted_sessions_with_stalls_over_100ms": sum(1 for x in per_session if x["stalls_over_100ms"]),
        "per_session": per_session,
        **_server_view(t_before, await metrics_text(base, key)),
        "outside_load": poller.outside_load(),
        "admission": await admission_view(base, key, since),
        "bench_loop_stalls": {"count": len(stalls.intervals), "max_ms": round(max((b - a for a, b in stalls.intervals), default=0.0) * 1000, 1)},
        "steal_s": round(steal1 - steal0, 2) if steal0 is not None and steal1 is not None else None,
        "cpu_cores_per_session": round(cpu / wall / sessions, 3) if cpu is not None and wall > 0 else None,
        "samples": [{k: v for k, v in t.items() if k not in ("gaps_ms", "stalls_ms", "holes")} for t in turns_],
    }


def _server_view(before: str | None, after: str | None) -> dict[str, Any]:
    """What the server measured of itself over a level: the holes of its paced answers
    by cause, and its event loop's lag."""
    return {"server_underruns": underruns_between(before, after), "server_loop_lag": loop_lag_between(before, after)}


def _session_summary(turns: list[dict[str, Any]], transport: str, stalls: LoopStalls) -> dict[str, Any]:
    """One admitted session: its stalls over 100 ms (WebSocket: a paced player's holes;
    WebRTC: RTP gaps past 120 ms, one frame coming every 20 ms), those heard while the
    bench's own loop was stalled counted apart (the machine, not the server), the
    longest and their sum, its widest frame gap."""
    if transport == "ws":
        holes = [(a, b) for t in turns for a, b in t.get("holes", []) if b - a > 0.1]
        frame = 0.0
    else:
        holes = [(a, b) for t in turns for a, b in t.get("rtp_gaps", []) if b - a > 0.12]
        frame = 0.02
    machine = [h for h in holes if stalls.overlaps(*h)]
    heard = [(b - a - frame) * 1000 for a, b in holes]
    gaps = [g for t in turns for g in t.get("gaps_ms", [])]
    return {"turns": len(turns), "failed": sum(1 for t in turns if not t["ok"]),
            "stalls_over_100ms": len(holes) - len(machine), "stalls_over_100ms_bench_stalled": len(machine),
            "longest_stall_ms": round(max(heard, default=0.0), 1), "stall_total_ms": round(sum(heard), 1),
            "frame_gap_max_ms": round(max(gaps, default=0.0), 1)}


async def barge_in(transport: str, base: str, key: str | None, pcm: bytes, trials: int) -> dict[str, Any]:
    ms: list[float] = []
    skipped = 0
    for _ in range(trials):
        if transport == "ws":
            c = await DuplexClient.connect(base.replace("http", "ws", 1) + "/v1/duplex", key)
            try:
                await c.update(turn_detection={"type": "server_vad", "create_response": False})
                await c.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Talk"}]})
                await c.send("response.create", response={"max_output_tokens": 120})
                await c.until("response.output_audio.delta")
                await c.stream_audio(pcm[: 24000 * 2], realtime=False)
                seen: list[dict[str, Any]] = []
                started = await c.until("input_audio_buffer.speech_started", seen)
                done = await c.until("response.done", seen)
                if done["response"]["status"] != "cancelled":
                    skipped += 1
                    continue
                ms.append((done["_t"] - started["_t"]) * 1000)
            finally:
                await c.close()
        else:
            call = await CallClient.connect(base, key, session={"type": "realtime", "audio": {"input": {"turn_detection": {"type": "server_vad", "create_response": False}}}})
            try:
                call.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Talk"}]})
                call.send("response.create", response={"max_output_tokens": 120})
                await call.until("output_audio_buffer.started")
                await asyncio.sleep(0.3)
                call.mic.say(pcm[: 24000 * 2])
                seen = []
                started = await call.until("input_audio_buffer.speech_started", seen)
                done = await call.until("response.done", seen)
                await asyncio.sleep(0.5)
                if done["response"]["status"] != "cancelled":
                    skipped += 1
                    continue
                t0 = started["_t"]
                loud = [t for t, x in call.frames if t >= t0 and len(x) and int(np.abs(x.astype(np.int32)).max()) > AUDIBLE and t < t0 + 0.5]
                ms.append(((max(loud) + 0.02) - t0) * 1000 if loud else 0.0)
            finally:
                await call.hangup()
    return {"trials": trials, "measured": len(ms), "skipped": skipped, "speech_started_to_silent_ms": summarize(ms), "samples_ms": [round(x, 1) for x in ms]}


def run(transport: str, base: str, key: str | None, levels: list[int], turns: int, tokens: int, wav: str | None, trials: int, ps: Any,
        burner: bool = False) -> dict[str, Any]:
    """Every level once on the machine as it is, then (`burner`) once more beside a
    process spinning one core, started before the level and stopped after it."""
    pcm, source = _line(wav)

    async def go() -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        _loopback(transport, base)
        await run_level(transport, base, key, 1, 1, pcm, tokens, None)  # warm-up
        lv = []
        for s in levels:
            lv.append(await run_level(transport, base, key, s, turns, pcm, tokens, ps))
            if burner:
                lv.append(await run_level(transport, base, key, s, turns, pcm, tokens, ps, burner=1))
                await asyncio.sleep(BURNER_LEAD_S)  # its load leaves admission's window before the next level
        return lv, (await barge_in(transport, base, key, pcm, trials) if trials else None)

    lv, barge = asyncio.run(go())
    by = {x["sessions"]: x for x in lv if not x["burner_processes"]}
    targets: dict[str, Any] = {}
    for x in lv:
        where = f"{x['sessions']}_sessions" + ("_beside_a_burner" if x["burner_processes"] else "")
        n = x["admitted_sessions_with_stalls_over_100ms"]
        targets[f"admitted_without_stalls_at_{where}"] = {
            "goal": "every admitted session 0 stalls > 100 ms (or refused at admission)", "admitted": x["admitted"], "refused": x["refused"],
            "value": n, "met": n == 0 and x["admitted"] + x["refused"] == x["sessions"]}
    top = max(by)
    r = by[top]["rtf"].get("p50")
    if transport == "ws" and PACING["value"] == "realtime":
        # paced, response.done waits for the audio's real-time delivery: this RTF is ~1 by
        # construction; generation speed is measured with --pacing none
        targets[f"rtf_p50_at_{top}"] = {"goal": "< 1", "value": r, "met": None, "note": "paced delivery; run --pacing none for generation RTF"}
    else:
        targets[f"rtf_p50_at_{top}"] = {"goal": "< 1", "value": r, "met": r is not None and r < 1}
    if 8 in by and by[8]["frame_gap_ms"]:
        g = by[8]["frame_gap_ms"].get("p99")
        targets["frame_gap_p99_ms_at_8"] = {"goal": "<= 40", "value": g, "met": g is not None and g <= 40}
    if barge is not None:
        p99 = barge["speech_started_to_silent_ms"].get("p99")
        targets["barge_in_p99_ms"] = {"goal": "<= 100", "value": p99, "met": p99 is not None and p99 <= 100, "measured": "at the client"}
        if transport == "webrtc":
            import httpx

            text = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=10).text
            server_p99 = bucket_bound(histogram(text, "omni_rt_webrtc_barge_in_silent_seconds"), 0.99)
            barge["server_speech_started_to_silent_frame_p99_s_le"] = server_p99
            if server_p99 is not None:
                targets["barge_in_p99_ms_server"] = {"goal": "<= 100", "value_le": server_p99 * 1000, "met": server_p99 <= 0.1,
                                                     "measured": "at the server: speech start -> first silent outbound frame (histogram bucket bound)"}
    return {"schema": SCHEMA, "created": utc_now(), "machine": machine_info(), "transport": transport, "url": base,
            "pacing": PACING["value"] if transport == "ws" else "realtime (RTP)",
            "utterance": source, "utterance_s": round(len(pcm) / 48000, 3), "turns_per_session": turns,
            "max_output_tokens": tokens, "levels": lv, "barge_in": barge, "targets": targets}


def ramp(transport: str, base: str, key: str | None, up_to: int, every_s: float, turns: int, tokens: int, wav: str | None) -> dict[str, Any]:
    pcm, source = _line(wav)

    async def go() -> dict[str, Any]:
        _loopback(transport, base)
        await run_level(transport, base, key, 1, 1, pcm, tokens, None)  # warm-up
        return await run_ramp(transport, base, key, up_to, every_s, turns, pcm, tokens)

    r = asyncio.run(go())
    rtf_max = r["server_generation_rtf_max"]
    targets = {
        "admitted_sessions_without_stalls": {"goal": "every admitted session: 0 stalls > 100 ms", "value": r["admitted_with_stalls"],
                                             "met": r["admitted"] > 0 and r["admitted_with_stalls"] == 0},
        "server_generation_rtf_max": {"goal": "< 1", "value": rtf_max, "met": rtf_max is not None and rtf_max < 1},
        "refused_told_retry": {"goal": "refused sessions get capacity/session_limit with retry-after", "value": r["refused"],
                               "met": r["errored"] == 0},
        "peak_open_voice_sessions": {"goal": ">= 12", "value": r["peak_open_voice_sessions"],
                                     "met": (r["peak_open_voice_sessions"] or 0) >= 12},
    }
    return {"schema": SCHEMA, "created": utc_now(), "machine": machine_info(), "transport": transport, "url": base,
            "pacing": PACING["value"] if transport == "ws" else "realtime (RTP)", "utterance": source,
            "utterance_s": round(len(pcm) / 48000, 3), "max_output_tokens": tokens, "ramp": r, "targets": targets}


def main_duplex(args: Any) -> int:
    if args.model:
        from latency_bench.duplex_model import main_model

        return main_model(args)
    PACING["value"] = args.pacing
    levels = [int(x) for x in str(args.sessions).split(",") if x.strip()]
    if not levels or min(levels) < 1 or args.turns < 1:
        print("error: --sessions levels and --turns must be >= 1")
        return 2
    if args.wav is None and shutil.which("espeak-ng") is None:
        # the fallback utterance is noise, which the server's voice-activity detector
        # does not take for speech: every turn would time out, and the run measure nothing
        print("error: the duplex bench speaks to the server's VAD: install espeak-ng (apt-get install espeak-ng) or pass --wav")
        return 2
    server = None
    base = args.url
    ps = None
    if base is None:
        from latency_bench.server import ServerProcess

        log_dir = Path(args.json).parent if args.json else Path("bench-out")
        log_dir.mkdir(parents=True, exist_ok=True)
        server = ServerProcess(port=args.port, deploy=args.deploy, log_path=log_dir / "duplex-server.log", env=dict(os.environ))
        server.start()
        server.wait_ready(timeout_s=600)
        base = f"http://127.0.0.1:{args.port}"
        ps = server._ps
    try:
        if args.ramp:
            result = ramp(args.transport, base.rstrip("/"), args.api_key, args.ramp, args.ramp_every, args.turns, args.max_output_tokens, args.wav)
        else:
            result = run(args.transport, base.rstrip("/"), args.api_key, levels, args.turns, args.max_output_tokens, args.wav, args.barge_in, ps,
                         burner=args.burner)
    finally:
        if server is not None:
            server.stop()
    if args.ramp:
        r = result["ramp"]
        print(f"duplex ramp over {args.transport}: a session every {args.ramp_every} s up to {args.ramp}, {args.turns} turns each")
        print(f"admitted {r['admitted']}, refused {r['refused']}, errored {r['errored']}; peak open voice sessions {r['peak_open_voice_sessions']}")
        print(f"admitted sessions with stalls > 100 ms: {r['admitted_with_stalls']} ({r['stalls_over_100ms']} stalls); "
              f"server generation RTF p50 {r['server_generation_rtf_p50']} max {r['server_generation_rtf_max']}; "
              f"reply p50 {r['reply_s_p50']} s, p99 {r['reply_s_p99']} s")
        finish(args.json, result)
        return 1 if r["errored"] else 0
    print(f"duplex bench over {args.transport} ({result['utterance']}, {result['utterance_s']} s per turn, {args.turns} turns per session)")
    print(f"{'S':>3} {'burner':>6} {'admit':>5} {'refuse':>6} {'turns':>6} {'fail':>5} {'reply p50':>10} {'reply p90':>10} {'RTF p50':>8} "
          f"{'gap p99 ms':>10} {'stall>100':>9} {'server>100':>10} {'outside':>7} {'CPU/sess':>9}")
    f = lambda d, k: f"{d[k]:.3f}" if d.get(k) is not None else "-"  # noqa: E731
    for lvl in result["levels"]:
        server = sum(c["over_100ms"] for c in lvl["server_underruns"].values())
        outside = lvl["outside_load"].get("cpu_outside_max")
        print(f"{lvl['sessions']:>3} {lvl['burner_processes']:>6} {lvl['admitted']:>5} {lvl['refused']:>6} {lvl['turns']:>6} {lvl['failed']:>5} "
              f"{f(lvl['reply_s'], 'p50'):>10} {f(lvl['reply_s'], 'p90'):>10} {f(lvl['rtf'], 'p50'):>8} {f(lvl['frame_gap_ms'], 'p99'):>10} "
              f"{sum(x['stalls_over_100ms'] for x in lvl['per_session']):>9} {server:>10.0f} {'-' if outside is None else f'{outside:.2f}':>7} "
              f"{lvl['cpu_cores_per_session'] if lvl['cpu_cores_per_session'] is not None else '-':>9}")
    if result["barge_in"]:
        b = result["barge_in"]
        print(f"barge-in: {b['measured']} measured ({b['skipped']} skipped): speech_started -> silent ms "
              f"p50 {b['speech_started_to_silent_ms'].get('p50')} p99 {b['speech_started_to_silent_ms'].get('p99')}")
    finish(args.json, result)
    return 1 if any(lvl["failed"] for lvl in result["levels"]) else 0


# ---- rising load ---------------------------------------------------------------------------


def _refusal(exc: BaseException) -> dict[str, Any] | None:
    """What a refused session was told (None: it failed some other way)."""
    from clients.realtime import RealtimeError

    if isinstance(exc, CallRefused) and exc.status in (429, 503):
        return {"status": exc.status, "body": exc.body[:300]}
    if isinstance(exc, RealtimeError) and exc.code in ("capacity", "session_limit"):
        return {"code": exc.code, "message": (exc.event.get("error") or {}).get("message")}
    return None


def _stall_stats(turns: list[dict[str, Any]], transport: str) -> dict[str, Any]:
    gaps = [g for t in turns for g in t.get("gaps_ms", [])]
    ok = [t for t in turns if t["ok"]]
    return {**_session_summary(turns, transport, LoopStalls()),
            "frame_gap_p99_ms": summarize(gaps).get("p99") if gaps else None,
            "reply_s": summarize([t["reply_s"] for t in ok])}


async def run_ramp(transport: str, base: str, key: str | None, up_to: int, every_s: float, turns: int, pcm: bytes, tokens: int) -> dict[str, Any]:
    """Offer a new session every `every_s` seconds up to `up_to`; each admitted one
    speaks `turns` turns. Records what admission decided and how every admitted
    session sounded, and polls /health for the server's own generation RTF."""
    poller = HealthPoller(base, key)
    t0 = time.monotonic()
    live = [0, 0]  # now, peak

    async def one(i: int) -> dict[str, Any]:
        await asyncio.sleep(i * every_s)
        offered = time.monotonic() - t0
        live[0] += 1
        live[1] = max(live[1], live[0])
        try:
            res = await _session_fn(transport)(base, key, pcm, turns, tokens)
            return {"i": i, "offered_at_s": round(offered, 2), "admitted": True, **_stall_stats(res, transport),
                    "rtf_p50": summarize([t["rtf"] for t in res if t["rtf"] is not None]).get("p50")}
        except BaseException as exc:  # noqa: BLE001 - every way a session ends is recorded
            why = _refusal(exc)
            if why is None:
                return {"i": i, "offered_at_s": round(offered, 2), "admitted": None, "error": f"{type(exc).__name__}: {exc}"[:300]}
            return {"i": i, "offered_at_s": round(offered, 2), "admitted": False, "refusal": why}
        finally:
            live[0] -= 1

    poller.start()
    try:
        sessions = await asyncio.gather(*(one(i) for i in range(up_to)))
    finally:
        await poller.stop()
    polls = poller.polls
    admitted = [s for s in sessions if s["admitted"]]
    refused = [s for s in sessions if s["admitted"] is False]
    rtfs = [p["rtf_now"] for p in polls if p.get("rtf_now") is not None]
    peak_admitted = max((p["open"] or 0 for p in polls), default=None)
    return {
        "offered": up_to, "every_s": every_s, "turns_per_session": turns,
        "admitted": len(admitted), "refused": len(refused), "errored": len(sessions) - len(admitted) - len(refused),
        "peak_open_voice_sessions": peak_admitted,
        "admitted_with_stalls": sum(1 for s in admitted if s["stalls_over_100ms"]),
        "stalls_over_100ms": sum(s["stalls_over_100ms"] for s in admitted),
        "server_generation_rtf_max": max(rtfs) if rtfs else None,
        "server_generation_rtf_p50": summarize(rtfs).get("p50") if rtfs else None,
        "reply_s_p50": summarize([s["reply_s"].get("p50") for s in admitted if s["reply_s"].get("p50") is not None]).get("p50"),
        "reply_s_p99": summarize([s["reply_s"].get("p99") for s in admitted if s["reply_s"].get("p99") is not None]).get("p99"),
        "sessions": sessions, "health": polls,
    }
