"""`python -m latency_bench telephony`: phone calls over Twilio Media Streams.

N calls at once (`--calls 1,4,8`), each by a Twilio-faithful peer (`clients.twilio`):
it streams 20 ms μ-law frames in real time the whole call (silence between turns, as
Twilio does), speaks an espeak-ng utterance, and plays the answer in real time, echoing
marks. Measured per call:

- **reply**: end of the caller's speech (its last speech frame sent) → the first
  `media` message of the answer;
- **barge-in**: once 0.5 s of the answer has played, the caller speaks again; the start
  of that speech → the server's `clear`.

JSON out with the settings, the machine and its load.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from clients.twilio import TwilioStream
from latency_bench import finish, machine_info, utc_now
from latency_bench.realtime import utterance
from latency_bench.stats import summarize

SCHEMA = "omni-rt.latency_bench.telephony/1"
SILENCE = b"\xff" * 160  # 20 ms of μ-law silence


def _ulaw(pcm16_24k: bytes) -> bytes:
    from media.wire_audio import PCMU, OutputEncoder

    enc = OutputEncoder(PCMU, 24000)
    return enc.encode("u", pcm16_24k) + enc.finish("u")


class _Caller:
    """A call's audio: silence every 20 ms unless an utterance is queued."""

    def __init__(self, t: TwilioStream) -> None:
        self.t = t
        self.queue: list[bytes] = []
        self.started: list[float] = []  # when each utterance's first frame went out (perf_counter)
        self.spoke_at: list[tuple[float, float]] = []  # (start, end) of each utterance
        self.task = asyncio.get_running_loop().create_task(self._run())

    def speak(self, ulaw: bytes) -> None:
        self.queue.append(ulaw)

    async def _run(self) -> None:
        try:
            await self._frames()
        except (aiohttp.ClientError, ConnectionError, RuntimeError):
            pass  # the call was closed (refused, or ended by the server)

    async def _frames(self) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        i = 0
        while True:
            if self.queue:
                u = self.queue.pop(0)
                start = time.perf_counter()
                self.started.append(start)
                for j in range(0, len(u), 160):
                    await self.t.say(u[j : j + 160])
                    i += 1
                    await asyncio.sleep(max(0.0, t0 + i * 0.02 - loop.time()))
                self.spoke_at.append((start, time.perf_counter()))
            else:
                await self.t.say(SILENCE)
                i += 1
                await asyncio.sleep(max(0.0, t0 + i * 0.02 - loop.time()))

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def _call(url: str, key: str | None, speech: bytes, tokens: int, timeout_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {"ok": False}
    async with aiohttp.ClientSession() as http:
        try:
            ws = await http.ws_connect(url)
        except aiohttp.ClientError as exc:
            return {"ok": False, "error": str(exc)}
        t = TwilioStream(ws, play_speed=1.0)
        params = {"max_output_tokens": str(tokens)}
        if key:
            params["authorization"] = f"Bearer {key}"
        await t.start(params)
        caller = _Caller(t)
        try:
            await asyncio.sleep(0.4)
            if t.closed is not None:  # refused (admission: 1013 capacity) or closed by the server
                out["error"] = f"closed {t.closed[0]}: {t.closed[1][:120]}"
                out["refused"] = t.closed[0] == 1013
                return out
            caller.speak(speech)
            await t.wait_for(lambda: len(caller.spoke_at) == 1, timeout=timeout_s)
            end = caller.spoke_at[0][1]
            await t.wait_for(lambda: t.first_after("media", end) is not None, timeout=timeout_s)
            out["reply_s"] = t.first_after("media", end) - end  # type: ignore[operator]
            # barge-in once half a second of the answer has played
            await t.wait_for(lambda: len(t.audio) >= 4000 or t.closed is not None, timeout=timeout_s)
            caller.speak(speech)
            await t.wait_for(lambda: len(caller.started) == 2, timeout=timeout_s)
            started = caller.started[1]
            await t.wait_for(lambda: t.first_after("clear", started) is not None, timeout=timeout_s)
            out["barge_in_s"] = t.first_after("clear", started) - started  # type: ignore[operator]
            out["ok"] = not t.errors
            out["errors"] = t.errors[:3]
        except AssertionError as exc:
            out["error"] = str(exc)[:300]
        finally:
            await caller.stop()
            if t.closed is None:
                await t.stop()
            await t.close()
    return out


async def _level(url: str, key: str | None, n: int, speech: bytes, tokens: int, timeout_s: float) -> dict[str, Any]:
    calls = await asyncio.gather(*(_call(url, key, speech, tokens, timeout_s) for _ in range(n)))
    ok = [c for c in calls if c.get("ok")]
    return {"calls": n, "completed": len(ok), "refused": sum(1 for c in calls if c.get("refused")),
            "failed": [c.get("error") or c.get("errors") for c in calls if not c.get("ok")][:5],
            "reply_s": summarize([c.get("reply_s") for c in ok]), "barge_in_to_clear_s": summarize([c.get("barge_in_s") for c in ok])}


def main_telephony(args: Any) -> int:
    from latency_bench.server import bench_url

    levels = [int(x) for x in str(args.calls).split(",") if x.strip()]
    pcm, source = utterance(args.wav)
    speech = _ulaw(pcm)
    settings = {"calls": levels, "speech": source, "speech_s": round(len(speech) / 8000, 2), "max_output_tokens": args.max_output_tokens,
                "barge_in_after_played_s": 0.5}
    print(f"settings: {settings}")
    result: dict[str, Any] = {"schema": SCHEMA, "at": utc_now(), "settings": settings, "machine": machine_info(), "levels": {}}
    with bench_url(args, "telephony", "ws", "/v1/telephony/twilio") as url:
        result["url"] = url
        asyncio.run(_level(url, args.api_key, 1, speech, args.max_output_tokens, args.timeout))  # warm-up, not counted
        for n in levels:
            level = asyncio.run(_level(url, args.api_key, n, speech, args.max_output_tokens, args.timeout))
            result["levels"][str(n)] = level
            r, b = level["reply_s"], level["barge_in_to_clear_s"]
            print(f"{n} call(s): {level['completed']}/{n} completed ({level['refused']} refused); end of speech -> first μ-law frame p50 {_ms(r.get('p50'))} "
                  f"p90 {_ms(r.get('p90'))}; barge-in -> clear p50 {_ms(b.get('p50'))} p90 {_ms(b.get('p90'))}")
    result["machine_after"] = machine_info()
    finish(args.json, result)
    return 0 if all(lv["completed"] == lv["calls"] for lv in result["levels"].values()) else 1


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"

