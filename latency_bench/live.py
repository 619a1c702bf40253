"""`python -m latency_bench live`: the Live API (`/v1/live/sessions`, the SDK's
`client.live`) beside the wires its engines also serve, in one run on one server.

At each level S (`--sessions 1,4,8`), S sessions at once, each a microphone in real time
(100 ms chunks: an espeak-ng question, then silence, as a call sends it):

- **turn-taking engine** (`gpt-live-1`) against `/v1/realtime` with the same session
  (semantic_vad at eagerness auto, input transcription by the streaming ASR stage: what a
  Live session runs): the end of the
  user's speech (its last chunk sent) → the first audio of the answer (the session
  closes there);
- **full-duplex engine** (`moshi`) against `/v1/duplex?model=moshi`: the model's
  reaction while the user is still speaking — the first audio frame after the first
  chunk of speech, and the frames received while speaking (one per 80 ms is real time).

JSON out with the settings, the machine and its load before and after.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any

from latency_bench import finish, machine_info, utc_now
from latency_bench.realtime import utterance
from latency_bench.stats import summarize

SCHEMA = "omni-rt.latency_bench.live/1"
CHUNK_S = 0.1


def _client(base: str, key: str | None) -> Any:
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{base}/v1", websocket_base_url=base.replace("http", "ws", 1) + "/v1", api_key=key or "unused", max_retries=0)


async def _microphone(send: Any, speech: bytes, spoke: dict[str, float], seconds: float) -> None:
    """Real-time 100 ms chunks: the speech, then silence for `seconds` in all."""
    step = int(24000 * CHUNK_S) * 2
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    n = int(seconds / CHUNK_S)
    for i in range(n):
        chunk = speech[i * step : (i + 1) * step]
        if i * step < len(speech):
            if "start" not in spoke:
                spoke["start"] = time.perf_counter()
            await send(chunk + bytes(step - len(chunk)))
            if (i + 1) * step >= len(speech):
                spoke["end"] = time.perf_counter()
        else:
            await send(bytes(step))
        await asyncio.sleep(max(0.0, t0 + (i + 1) * CHUNK_S - loop.time()))


async def _live_turn(base: str, key: str | None, speech: bytes, tokens: int, timeout_s: float) -> dict[str, Any]:
    """One Live session (turn-taking engine): end of speech → first answer audio."""
    spoke: dict[str, float] = {}
    try:
        async with _client(base, key).live.connect() as conn:
            await conn.session.start(session={"model": "gpt-live-1", "instructions": "Answer briefly."})

            async def send(pcm: bytes) -> None:
                await conn.session.input_audio.append(audio=base64.b64encode(pcm).decode())

            mic: asyncio.Task[None] | None = None
            first = None
            async with asyncio.timeout(timeout_s):
                async for ev in conn:
                    if ev.type == "session.started":
                        mic = asyncio.create_task(_microphone(send, speech, spoke, timeout_s))
                    elif ev.type == "error":
                        return {"ok": False, "error": ev.error.message[:200]}
                    elif ev.type == "session.output_audio.delta" and "end" in spoke:
                        first = time.perf_counter()
                        break
            if mic is not None:
                mic.cancel()
                await asyncio.gather(mic, return_exceptions=True)
            await conn.session.close()
        return {"ok": first is not None, "reply_s": first - spoke["end"] if first is not None else None}
    except Exception as exc:  # noqa: BLE001 - a failure is a result
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:200]}


async def _realtime_turn(base: str, key: str | None, speech: bytes, tokens: int, timeout_s: float) -> dict[str, Any]:
    """The same on /v1/realtime with the Live engine's turn detection."""
    spoke: dict[str, float] = {}
    try:
        async with _client(base, key).realtime.connect(model="gpt-realtime") as conn:
            # what a Live session runs: the end-of-turn model at eagerness auto, the caller's words transcribed as they speak
            await conn.session.update(session={"type": "realtime", "max_output_tokens": tokens, "audio": {"input": {
                "turn_detection": {"type": "semantic_vad", "eagerness": "auto"}, "transcription": {"model": "gpt-4o-transcribe"}}}})

            async def send(pcm: bytes) -> None:
                await conn.input_audio_buffer.append(audio=base64.b64encode(pcm).decode())

            mic = asyncio.create_task(_microphone(send, speech, spoke, timeout_s))
            first = None
            try:
                async with asyncio.timeout(timeout_s):
                    async for ev in conn:
                        if ev.type == "error":
                            return {"ok": False, "error": ev.error.message[:200]}
                        if ev.type == "response.output_audio.delta" and "end" in spoke:
                            first = time.perf_counter()
                            break
            finally:
                mic.cancel()
                await asyncio.gather(mic, return_exceptions=True)
        return {"ok": first is not None, "reply_s": first - spoke["end"] if first is not None else None}
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:200]}


async def _live_duplex(base: str, key: str | None, speech: bytes, seconds: float) -> dict[str, Any]:
    """A Live session on the full-duplex model: reaction while the user speaks."""
    spoke: dict[str, float] = {}
    frames: list[float] = []
    try:
        async with _client(base, key).live.connect() as conn:
            await conn.session.start(session={"model": "moshi"})

            async def send(pcm: bytes) -> None:
                await conn.session.input_audio.append(audio=base64.b64encode(pcm).decode())

            mic: asyncio.Task[None] | None = None
            async with asyncio.timeout(seconds + 30):
                async for ev in conn:
                    if ev.type == "session.started":
                        mic = asyncio.create_task(_microphone(send, speech, spoke, seconds))
                    elif ev.type == "error":
                        return {"ok": False, "error": ev.error.message[:200]}
                    elif ev.type == "session.output_audio.delta":
                        frames.append(time.perf_counter())
                    if mic is not None and mic.done():
                        break
            await conn.session.close()
        return _reaction(spoke, frames)
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:200]}


async def _duplex(base: str, key: str | None, speech: bytes, seconds: float) -> dict[str, Any]:
    """The same on /v1/duplex?model=moshi (binary frames)."""
    import aiohttp

    spoke: dict[str, float] = {}
    frames: list[float] = []
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        async with aiohttp.ClientSession(headers=headers) as http, http.ws_connect(base.replace("http", "ws", 1) + "/v1/duplex?model=moshi") as ws:
            created = json.loads((await ws.receive(timeout=30)).data)
            if created.get("type") != "session.created":
                return {"ok": False, "error": str(created)[:200]}

            async def send(pcm: bytes) -> None:
                await ws.send_bytes(b"\x01" + pcm)

            async def read() -> None:
                async for msg in ws:
                    if msg.type == aiohttp.WSMsgType.BINARY and msg.data[:1] == b"\x01":
                        frames.append(time.perf_counter())

            reader = asyncio.create_task(read())
            await _microphone(send, speech, spoke, seconds)
            await ws.send_str(json.dumps({"type": "session.close"}))
            await asyncio.sleep(0.2)
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        return _reaction(spoke, frames)
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:200]}


def _reaction(spoke: dict[str, float], frames: list[float]) -> dict[str, Any]:
    if "start" not in spoke or not frames:
        return {"ok": False, "error": "no audio back"}
    after = [t for t in frames if t >= spoke["start"]]
    during = [t for t in after if t <= spoke.get("end", float("inf"))]
    speaking = spoke.get("end", spoke["start"]) - spoke["start"]
    return {"ok": bool(after), "first_frame_s": after[0] - spoke["start"] if after else None,
            "frames_while_speaking": len(during), "realtime_frames": int(speaking / 0.08)}


async def _level(fn: Any, n: int, *args: Any) -> dict[str, Any]:
    runs = await asyncio.gather(*(fn(*args) for _ in range(n)))
    ok = [r for r in runs if r.get("ok")]
    out: dict[str, Any] = {"sessions": n, "completed": len(ok), "failed": [r.get("error") for r in runs if not r.get("ok")][:3]}
    if any("reply_s" in r for r in ok):
        out["reply_s"] = summarize([r["reply_s"] for r in ok])
    if any("first_frame_s" in r for r in ok):
        out["first_frame_s"] = summarize([r["first_frame_s"] for r in ok])
        out["frames_while_speaking"] = [r["frames_while_speaking"] for r in ok]
        out["realtime_frames"] = ok[0]["realtime_frames"] if ok else None
    return out


def main_live(args: Any) -> int:
    from latency_bench.server import bench_url

    levels = [int(x) for x in str(args.sessions).split(",") if x.strip()]
    speech, source = utterance(args.wav)
    settings = {"sessions": levels, "speech": source, "speech_s": round(len(speech) / 48000, 2), "chunk_s": CHUNK_S,
                "max_output_tokens": args.max_output_tokens, "turn_detection": "semantic_vad (eagerness auto) and streaming input transcription on both turn-taking wires",
                "duplex_seconds": args.seconds, "timeout_s": args.timeout}
    print(f"settings: {settings}")
    result: dict[str, Any] = {"schema": SCHEMA, "at": utc_now(), "settings": settings, "machine": machine_info(), "levels": {}}
    with bench_url(args, "live") as base:
        result["url"] = base
        key, tokens, timeout = args.api_key, args.max_output_tokens, args.timeout
        asyncio.run(_level(_live_turn, 1, base, key, speech, tokens, timeout))  # warm-up, not counted
        asyncio.run(_level(_live_duplex, 1, base, key, speech, 2.0))
        for n in levels:
            lv = {
                "live_turn_taking": asyncio.run(_level(_live_turn, n, base, key, speech, tokens, timeout)),
                "realtime": asyncio.run(_level(_realtime_turn, n, base, key, speech, tokens, timeout)),
                "live_full_duplex": asyncio.run(_level(_live_duplex, n, base, key, speech, args.seconds)),
                "duplex_model": asyncio.run(_level(_duplex, n, base, key, speech, args.seconds)),
            }
            result["levels"][str(n)] = lv
            a, b = lv["live_turn_taking"], lv["realtime"]
            c, d = lv["live_full_duplex"], lv["duplex_model"]
            print(f"{n} session(s): end of speech -> first audio p50: live {_ms(a.get('reply_s', {}).get('p50'))} "
                  f"({a['completed']}/{n}) vs realtime {_ms(b.get('reply_s', {}).get('p50'))} ({b['completed']}/{n}); "
                  f"full duplex first frame after speech starts p50: live {_ms(c.get('first_frame_s', {}).get('p50'))} ({c['completed']}/{n}) "
                  f"vs /v1/duplex {_ms(d.get('first_frame_s', {}).get('p50'))} ({d['completed']}/{n})")
    result["machine_after"] = machine_info()
    finish(args.json, result)
    return 0 if all(x["completed"] == x["sessions"] for lv in result["levels"].values() for x in lv.values()) else 1


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"
