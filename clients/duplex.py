"""An asyncio client for omni-rt's `/v1/duplex` (full-duplex voice over WebSocket).

Audio goes up as binary frames `[0x01][PCM16]` in real time (20 ms frames), while the
server's events are read continuously in the background, so the user can talk over the
agent. Used by tests and latency_bench; also a CLI that speaks a WAV file (then
silence) and writes what the agent said:

    python -m clients.duplex --url ws://127.0.0.1:8000/v1/duplex --in question.wav --out answer.wav

With a full-duplex model (`--url ws://127.0.0.1:8000/v1/duplex?model=moshi`) there are
no turns: the CLI speaks the file and a second of silence while the model's voice comes
back, then writes all of it and prints the model's text stream.

Imports nothing of the server.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import time
from typing import Any
from urllib.parse import urlencode

from clients.realtime import RATE, RealtimeError, next_event, read_wav_pcm16, write_wav_pcm16

AUDIO_FRAME = b"\x01"
FRAME_MS = 20


class DuplexClient:
    """One attachment to a duplex session. `events` receives every server event as a
    dict (binary audio frames as `{"type": "audio.binary", "audio": bytes}`), each with
    the client's arrival time in `_t`."""

    def __init__(self, ws: Any, created: dict[str, Any]) -> None:
        self.ws = ws
        self.first = created
        self.session: dict[str, Any] = created.get("session") or {}
        self.session_id: str = self.session.get("id", "")
        self.resume_token: str | None = created.get("resume_token")
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.closed: tuple[int | None, str] | None = None
        self.last_seq = created.get("server_event_seq", 0)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def connect(
        cls,
        url: str,
        api_key: str | None = None,
        session_id: str | None = None,
        resume_token: str | None = None,
        **ws_kwargs: Any,
    ) -> DuplexClient:
        """Open a new session, or re-attach to `session_id` (query form of session.resume)."""
        import websockets

        if session_id is not None:
            url = f"{url}{'&' if '?' in url else '?'}{urlencode({'session_id': session_id, 'resume_token': resume_token or ''})}"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        ws = await websockets.connect(url, additional_headers=headers, max_size=None, **ws_kwargs)
        first = json.loads(await ws.recv())
        if first.get("type") not in ("session.created", "session.resumed"):
            await ws.close()
            raise RealtimeError(first) if first.get("type") == "error" else RuntimeError(f"session refused: {first}")
        return cls(ws, first)

    async def _read(self) -> None:
        try:
            async for msg in self.ws:
                t = time.monotonic()
                if isinstance(msg, bytes):
                    ev = {"type": "audio.binary", "audio": msg[1:], "_t": t}
                else:
                    ev = json.loads(msg)
                    ev["_t"] = t
                    self.last_seq = ev.get("server_event_seq", self.last_seq)
                    if ev.get("type") == "session.resumed":
                        self.resume_token = ev.get("resume_token") or self.resume_token
                self.events.put_nowait(ev)
        except Exception:  # noqa: BLE001 - the connection ended; `closed` says how
            pass
        finally:
            self.closed = (getattr(self.ws, "close_code", None), getattr(self.ws, "close_reason", "") or "")
            self.events.put_nowait({"type": "connection.closed", "code": self.closed[0], "reason": self.closed[1], "_t": time.monotonic()})

    # ---- sending -----------------------------------------------------------------------
    async def send(self, type: str, **data: Any) -> None:
        await self.ws.send(json.dumps({"type": type, **data}))

    async def send_audio(self, pcm16: bytes) -> None:
        await self.ws.send(AUDIO_FRAME + pcm16)

    async def stream_audio(self, pcm16: bytes, rate: int = RATE, realtime: bool = True) -> None:
        """Send audio as 20 ms binary frames, paced in real time when `realtime`."""
        step = rate * FRAME_MS // 1000 * 2
        t0 = time.monotonic()
        for n, i in enumerate(range(0, len(pcm16), step)):
            await self.send_audio(pcm16[i : i + step])
            if realtime:
                delay = t0 + (n + 1) * FRAME_MS / 1000 - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)

    async def update(self, **session: Any) -> dict[str, Any]:
        await self.send("session.update", session=session)
        return await self.until("session.updated")

    # ---- receiving ---------------------------------------------------------------------
    async def until(self, types: str | set[str], seen: list[dict[str, Any]] | None = None, timeout: float = 120) -> dict[str, Any]:
        """Events up to (and including) the first of `types`; errors raise unless asked for."""
        return await next_event(self.events, types, seen, timeout)

    def drain(self) -> list[dict[str, Any]]:
        out = []
        while not self.events.empty():
            out.append(self.events.get_nowait())
        return out

    async def close(self) -> None:
        await self.ws.close()
        await asyncio.gather(self._reader, return_exceptions=True)

    async def drop(self) -> None:
        """Lose the connection without a goodbye (as a network drop would)."""
        transport = getattr(self.ws, "transport", None)
        if transport is not None:
            transport.abort()
        await asyncio.gather(self._reader, return_exceptions=True)


def audio_of(events: list[dict[str, Any]], response_id: str | None = None) -> bytes:
    """The PCM16 audio in a list of events (JSON deltas and binary frames)."""
    out = bytearray()
    for ev in events:
        if ev["type"] == "response.output_audio.delta" and (response_id is None or ev.get("response_id") == response_id):
            out += base64.b64decode(ev["delta"])
        elif ev["type"] == "audio.binary" and response_id is None:
            out += ev["audio"]
    return bytes(out)


async def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clients.duplex", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="ws://127.0.0.1:8000/v1/duplex")
    ap.add_argument("--in", dest="inp", required=True, help="WAV file to speak (any rate; resampled to 24 kHz)")
    ap.add_argument("--out", help="write the agent's reply here (WAV, 24 kHz)")
    ap.add_argument("--api-key")
    ap.add_argument("--binary", action="store_true", help="ask for binary audio frames")
    args = ap.parse_args(argv)
    pcm = read_wav_pcm16(args.inp)
    c = await DuplexClient.connect(args.url, args.api_key)
    print(f"session {c.session_id}", file=sys.stderr)
    if c.session.get("capabilities", {}).get("full_duplex"):
        return await _full_duplex(c, pcm, args.out)
    if args.binary:
        await c.update(audio={"output": {"transport": "binary"}})
    sender = asyncio.get_running_loop().create_task(c.stream_audio(pcm + bytes(RATE * 2 * 2)))
    seen: list[dict[str, Any]] = []
    t_end = None
    try:
        while True:
            ev = await c.until({"input_audio_buffer.speech_stopped", "response.done"}, seen)
            if ev["type"] == "input_audio_buffer.speech_stopped":
                t_end = ev["_t"]
                continue
            break
    finally:
        sender.cancel()
        await c.close()
    audio = audio_of(seen)
    first = next((e["_t"] for e in seen if e["type"] in ("response.output_audio.delta", "audio.binary")), None)
    text = "".join(e.get("delta", "") for e in seen if e["type"] == "response.output_audio_transcript.delta")
    lat = f"{(first - t_end) * 1000:.0f} ms" if first and t_end else "n/a"
    print(f"{ev['response']['status']}: {len(audio) / 2 / RATE:.2f} s of audio, end of speech -> first audio {lat}", file=sys.stderr)
    print(text)
    if args.out:
        write_wav_pcm16(args.out, audio)
    return 0


async def _full_duplex(c: DuplexClient, pcm: bytes, out: str | None) -> int:
    """A full-duplex model: speak, listen all along, keep everything it said."""
    try:
        await c.stream_audio(pcm + bytes(RATE * 2))
        await asyncio.sleep(0.3)
        seen = c.drain()
    finally:
        await c.close()
    audio = audio_of(seen)
    late = sum(1 for e in seen if e["type"] == "duplex.frame.late")
    errors = [e["error"] for e in seen if e["type"] == "error"]
    print(f"full duplex: {len(audio) / 2 / RATE:.2f} s of the model's voice while {len(pcm) / 2 / RATE + 1:.2f} s were sent, "
          f"{late} late frames", file=sys.stderr)
    for err in errors:
        print(f"error: {err.get('code')}: {err.get('message')}", file=sys.stderr)
    print("".join(e.get("delta", "") for e in seen if e["type"] == "duplex.text.delta"))
    if out:
        write_wav_pcm16(out, audio)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(_main()))
