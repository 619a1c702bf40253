"""A small asyncio client for omni-rt's `/v1/realtime` (OpenAI Realtime, GA dialect).

Used by tests and latency_bench; also a CLI that speaks a WAV file to the server and
writes the spoken reply to a WAV file:

    python -m clients.realtime --url ws://127.0.0.1:8000/v1/realtime --in question.wav --out answer.wav

Imports nothing of the server.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import time
import wave
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

from clients.closing import close
from clients.errors import ErrorEvent

RATE = 24000


class RealtimeError(ErrorEvent):
    """The realtime session sent an `error` event."""


@dataclass
class TurnResult:
    response_id: str
    status: str
    text: str
    audio: bytes  # PCM16 LE mono 24 kHz
    ttfp_s: float | None  # end of input (commit / last append) -> first audio delta
    ttft_s: float | None  # end of input -> first text/transcript delta
    e2e_s: float  # end of input -> response.done
    events: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)  # function_call items of response.done
    ttfc_s: float | None = None  # end of input -> first function_call_arguments.delta
    call_done_s: float | None = None  # end of input -> the first function_call_arguments.done

    @property
    def audio_s(self) -> float:
        return len(self.audio) / 2 / RATE


async def next_event(queue: asyncio.Queue[dict[str, Any]], types: str | set[str], seen: list[dict[str, Any]] | None = None, timeout: float = 120) -> dict[str, Any]:
    """Events from `queue` up to (and including) the first of `types`. An `error` event
    raises RealtimeError unless asked for; `connection.closed` raises ConnectionError."""
    want = {types} if isinstance(types, str) else set(types)
    deadline = time.monotonic() + timeout
    while True:
        ev = await asyncio.wait_for(queue.get(), max(0.01, deadline - time.monotonic()))
        if seen is not None:
            seen.append(ev)
        if ev["type"] in want:
            return ev
        if ev["type"] == "error" and "error" not in want:
            raise RealtimeError(ev)
        if ev["type"] == "connection.closed":
            raise ConnectionError(f"connection closed ({ev.get('code')} {ev.get('reason')}) before {sorted(want)}")


def read_wav_pcm16(path: str) -> bytes:
    """A WAV file as PCM16 mono 24 kHz (resampled with soxr when needed)."""
    with wave.open(path, "rb") as w:
        rate, ch, width = w.getframerate(), w.getnchannels(), w.getsampwidth()
        raw = w.readframes(w.getnframes())
    if width != 2:
        raise ValueError(f"{path}: only 16-bit WAV is supported")
    x = np.frombuffer(raw, "<i2").astype(np.float32).reshape(-1, ch).mean(axis=1) / 32768.0
    if rate != RATE:
        import soxr

        x = soxr.resample(x, rate, RATE)
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


def write_wav_pcm16(path: str | BinaryIO, pcm: bytes, rate: int = RATE) -> None:
    """PCM16 mono at `rate` as a WAV file (a path or a binary file object)."""
    with wave.open(path, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)


class RealtimeClient:
    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.session: dict[str, Any] = {}
        self._n = 0

    @classmethod
    async def connect(cls, url: str, api_key: str | None = None, model: str = "gpt-realtime", beta: bool = False) -> RealtimeClient:
        import websockets

        headers = {}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        if beta:
            headers["OpenAI-Beta"] = "realtime=v1"
        sep = "&" if "?" in url else "?"
        ws = await websockets.connect(f"{url}{sep}model={model}", additional_headers=headers, max_size=None)
        self = cls(ws)
        first = await self.recv()
        if first.get("type") == "error":
            await ws.close()
            raise RealtimeError(first)
        self.session = first.get("session", {})
        return self

    async def send(self, type: str, **fields: Any) -> str:
        self._n += 1
        event_id = f"client_{self._n}"
        await self.ws.send(json.dumps({"type": type, "event_id": event_id, **fields}))
        return event_id

    async def recv(self, timeout: float | None = 120) -> dict[str, Any]:
        return json.loads(await asyncio.wait_for(self.ws.recv(), timeout))

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        while True:
            yield await self.recv()

    async def update(self, **session: Any) -> dict[str, Any]:
        await self.send("session.update", session={"type": "realtime", **session})
        while True:
            ev = await self.recv()
            if ev["type"] == "session.updated":
                self.session = ev["session"]
                return ev
            if ev["type"] == "error":
                raise RealtimeError(ev)

    async def append(self, pcm16: bytes, chunk_ms: int = 100, realtime: bool = False) -> None:
        step = RATE * 2 * chunk_ms // 1000
        for i in range(0, len(pcm16), step):
            await self.send("input_audio_buffer.append", audio=base64.b64encode(pcm16[i : i + step]).decode())
            if realtime:
                await asyncio.sleep(chunk_ms / 1000)

    async def collect(self, t_end: float) -> TurnResult:
        """Read events until response.done; timings are measured from `t_end`."""
        text, audio = [], bytearray()
        ttfp = ttft = ttfc = call_done = None
        names: list[str] = []
        while True:
            ev = await self.recv()
            t = ev["type"]
            names.append(t)
            if t == "error":
                raise RealtimeError(ev)
            if t == "response.function_call_arguments.delta" and ttfc is None:
                ttfc = time.perf_counter() - t_end
            elif t == "response.function_call_arguments.done" and call_done is None:
                call_done = time.perf_counter() - t_end
            if t in ("response.output_audio.delta", "response.audio.delta"):
                if ttfp is None:
                    ttfp = time.perf_counter() - t_end
                audio += base64.b64decode(ev["delta"])
            elif t.endswith("transcript.delta") or t.endswith("text.delta"):
                if ttft is None:
                    ttft = time.perf_counter() - t_end
                text.append(ev["delta"])
            elif t == "response.done":
                r = ev["response"]
                calls = [o for o in r.get("output") or [] if o.get("type") == "function_call"]
                return TurnResult(r["id"], r["status"], "".join(text), bytes(audio), ttfp, ttft, time.perf_counter() - t_end, names, r.get("usage"),
                                  calls, ttfc, call_done)

    async def turn(self, pcm16: bytes | None = None, text: str | None = None, manual: bool = True, **response: Any) -> TurnResult:
        """One turn: speak `pcm16` (or say `text`), get the answer. With `manual`, the
        client commits and asks for the response; else server VAD does (send trailing
        silence so it hears the end of speech)."""
        if text is not None:
            await self.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
        if pcm16:
            await self.append(pcm16)
        if manual:
            if pcm16:
                await self.send("input_audio_buffer.commit")
            t_end = time.perf_counter()
            await self.send("response.create", response=response)
        else:
            t_end = time.perf_counter()
        return await self.collect(t_end)

    async def close(self) -> None:
        await close(self.ws)

    async def __aenter__(self) -> RealtimeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _main(args: argparse.Namespace) -> int:
    pcm = read_wav_pcm16(args.input)
    client = await RealtimeClient.connect(args.url, args.api_key, args.model)
    async with client:
        if args.vad:
            await client.update(output_modalities=["audio"])
            pcm += bytes(RATE * 2)  # a second of silence ends the turn
            result = await client.turn(pcm, manual=False)
        else:
            await client.update(audio={"input": {"turn_detection": None}})
            result = await client.turn(pcm)
    write_wav_pcm16(args.output, result.audio)
    print(json.dumps({"status": result.status, "transcript": result.text, "audio_s": round(result.audio_s, 3),
                      "ttfp_s": result.ttfp_s, "e2e_s": round(result.e2e_s, 3)}))
    return 0 if result.status == "completed" else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m clients.realtime", description="Speak a WAV file to /v1/realtime, save the reply.")
    p.add_argument("--url", default="ws://127.0.0.1:8000/v1/realtime")
    p.add_argument("--in", dest="input", required=True, help="16-bit WAV to speak (any rate, mono or stereo)")
    p.add_argument("--out", dest="output", required=True, help="where to write the reply (WAV, 24 kHz)")
    p.add_argument("--api-key")
    p.add_argument("--model", default="gpt-realtime")
    p.add_argument("--vad", action="store_true", help="let server VAD end the turn instead of committing")
    args = p.parse_args(argv)
    try:
        return asyncio.run(_main(args))
    except RealtimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
