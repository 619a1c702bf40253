"""Helpers for the in-process protocol tests (testkit.serve): JSON event
sockets read with a deadline, and synthetic audio the fake voice-activity detector
hears as speech (a loud tone) or silence."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import aiohttp
import numpy as np

RATE = 24000


def tone(seconds: float, rate: int = RATE, amp: float = 0.3, freq: float = 220.0) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    return (amp * np.sin(2 * np.pi * freq * t) * 32767).astype("<i2").tobytes()


def quiet(seconds: float, rate: int = RATE) -> bytes:
    return bytes(int(rate * seconds) * 2)


def b64(pcm: bytes) -> str:
    return base64.b64encode(pcm).decode()


class Events:
    """A JSON event socket: `send`, and `until` the next event of some types (the
    events on the way are kept in `seen`). Binary frames arrive as `audio.binary`."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.seen: list[dict[str, Any]] = []
        self.closed: tuple[int | None, str] | None = None

    async def send(self, type: str, **fields: Any) -> None:
        await self.ws.send_str(json.dumps({"type": type, **fields}))

    async def next(self, timeout: float = 5.0) -> dict[str, Any]:
        msg = await asyncio.wait_for(self.ws.receive(), timeout)
        if msg.type is aiohttp.WSMsgType.TEXT:
            ev = json.loads(msg.data)
        elif msg.type is aiohttp.WSMsgType.BINARY:
            ev = {"type": "audio.binary", "audio": msg.data[1:], "kind": msg.data[0]}
        else:
            self.closed = (self.ws.close_code, str(msg.extra or ""))
            ev = {"type": "connection.closed", "code": self.ws.close_code, "reason": msg.extra}
        self.seen.append(ev)
        return ev

    async def until(self, *types: str, timeout: float = 5.0) -> dict[str, Any]:
        while True:
            ev = await self.next(timeout)
            if ev["type"] in types:
                return ev
            if ev["type"] == "connection.closed":
                raise AssertionError(f"the socket closed ({ev}) before {types}; saw {[e['type'] for e in self.seen]}")

    def types(self) -> list[str]:
        return [e["type"] for e in self.seen]


def drop(ws: Any) -> None:
    """End the connection the way a lost network does: no close frame (an aiohttp or a
    `websockets` client socket)."""
    conn = getattr(ws, "_conn", None)  # aiohttp keeps the connection only here
    transport = conn.transport if conn is not None else ws.transport
    assert transport is not None
    transport.abort()


async def connect(h: Any, path: str, headers: dict[str, str] | None = None) -> Events:
    return Events(await h.client.ws_connect(path, headers=headers or {}))


async def barge_in(ws: Events) -> tuple[str, dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """A scripted barge-in on a realtime socket with turn detection on: the user speaks,
    a long answer starts, the user talks over it, then falls silent. Returns the first
    answer's id, its `response.done`, the next answer's, and every event of the first
    answer that arrived after its `response.done` (none, if nothing stale follows)."""
    await ws.send("session.update", session={"type": "realtime", "max_output_tokens": 400})
    await ws.until("session.updated")
    for chunk in (quiet(0.2), tone(0.4), quiet(0.6)):
        await ws.send("input_audio_buffer.append", audio=b64(chunk))
    rid = (await ws.until("response.output_audio.delta"))["response_id"]
    await ws.send("session.update", session={"type": "realtime", "max_output_tokens": 3})
    await ws.send("input_audio_buffer.append", audio=b64(tone(0.3)))  # the user talks over the answer
    done = await ws.until("response.done")
    mark = len(ws.seen)
    await ws.send("input_audio_buffer.append", audio=b64(quiet(0.6)))
    second = await ws.until("response.done")
    return rid, done, second, [e for e in ws.seen[mark:] if e.get("response_id") == rid]


def g711(pcm16: bytes, law: str = "ulaw", rate: int = RATE) -> bytes:
    """PCM16 at `rate` as G.711 bytes at 8 kHz, encoded by FFmpeg (PyAV's pcm_mulaw /
    pcm_alaw, resampled by its swresample): a codec apart from the server's."""
    import av

    x = np.frombuffer(pcm16, "<i2").reshape(1, -1)
    frame = av.AudioFrame.from_ndarray(x, format="s16", layout="mono")
    frame.sample_rate = rate
    out = b""
    if rate != 8000:
        rs = av.AudioResampler(format="s16", layout="mono", rate=8000)
        frames = [*rs.resample(frame), *rs.resample(None)]
    else:
        frames = [frame]
    ctx = av.CodecContext.create("pcm_mulaw" if law == "ulaw" else "pcm_alaw", "w")
    ctx.sample_rate, ctx.layout, ctx.format = 8000, "mono", "s16"
    for f in [*frames, None]:
        out += b"".join(bytes(p) for p in ctx.encode(f))
    return out


def from_g711(data: bytes, law: str = "ulaw") -> np.ndarray:
    """G.711 bytes as int16 samples at 8 kHz, decoded by FFmpeg (PyAV)."""
    import io

    import av

    if not data:
        return np.zeros(0, np.int16)
    with av.open(io.BytesIO(data), format="mulaw" if law == "ulaw" else "alaw", options={"sample_rate": "8000", "ch_layout": "mono"}) as c:
        return np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(audio=0)]).astype(np.int16)
