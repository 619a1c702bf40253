"""An aiortc peer for omni-rt's WebRTC voice calls (`POST /v1/realtime/calls`).

Its microphone plays audio you give it (a WAV file, or PCM at any moment with `say`)
as a live 48 kHz track (silence in between), it records what it hears with each
frame's arrival time, and it speaks the realtime JSON events on the `oai-events` data
channel. Used by tests and latency_bench; also a CLI:

    python -m clients.webrtc --url http://127.0.0.1:8000 --in question.wav --out answer.wav

Imports nothing of the server.
"""

from __future__ import annotations

import argparse
import asyncio
import fractions
import json
import sys
import time
from typing import Any

import numpy as np

from clients.realtime import RATE, next_event, read_wav_pcm16, write_wav_pcm16

RTP_RATE = 48000
FRAME = RTP_RATE // 50  # 20 ms


def use_host_addresses(addresses: list[str]) -> None:
    """Gather ICE host candidates on these addresses only (aioice skips 127.0.0.1
    otherwise; loopback tests name it). Process-wide: aioice has no option for it."""
    import aioice.ice

    addrs = list(addresses)
    aioice.ice.get_host_addresses = lambda use_ipv4, use_ipv6: [a for a in addrs if (use_ipv6 if ":" in a else use_ipv4)]


def _to48k(pcm16_24k: bytes) -> np.ndarray:
    import soxr

    x = np.frombuffer(pcm16_24k, "<i2").astype(np.float32) / 32768.0
    return (np.clip(soxr.resample(x, RATE, RTP_RATE), -1, 1) * 32767).astype(np.int16)


class Microphone:
    """A live audio track: what `say` queued, else silence, paced in real time."""

    def __init__(self) -> None:
        from aiortc.mediastreams import MediaStreamTrack

        outer = self

        class _Mic(MediaStreamTrack):
            kind = "audio"

            async def recv(self) -> Any:
                return await outer._recv()

        self.track = _Mic()
        self.queue: list[np.ndarray] = []
        self.done = asyncio.Event()  # set when what was said has been sent
        self.done.set()
        self._start: float | None = None
        self._pts = 0

    def say(self, pcm16_24k: bytes) -> asyncio.Event:
        self.queue.append(_to48k(pcm16_24k))
        self.done.clear()
        return self.done

    async def _recv(self) -> Any:
        import av

        now = time.monotonic()
        if self._start is None:
            self._start = now
        else:
            self._pts += FRAME
            wait = self._start + self._pts / RTP_RATE - now
            if wait > 0:
                await asyncio.sleep(wait)
        out = np.zeros(FRAME, np.int16)
        filled = 0
        while filled < FRAME and self.queue:
            head = self.queue[0]
            n = min(FRAME - filled, len(head))
            out[filled : filled + n] = head[:n]
            filled += n
            self.queue[0] = head[n:]
            if not len(self.queue[0]):
                self.queue.pop(0)
        if not self.queue:
            self.done.set()
        frame = av.AudioFrame.from_ndarray(out.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = RTP_RATE
        frame.pts = self._pts
        frame.time_base = fractions.Fraction(1, RTP_RATE)
        return frame


class CallClient:
    def __init__(self) -> None:
        self.pc: Any = None
        self.channel: Any = None
        self.mic = Microphone()
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.frames: list[tuple[float, np.ndarray]] = []  # (arrival, mono int16 @ its rate)
        self.frame_rate = RTP_RATE
        self.location: str | None = None
        self.base_url = ""
        self.headers: dict[str, str] = {}
        self._tasks: list[asyncio.Task[Any]] = []

    @classmethod
    async def connect(
        cls, base_url: str, api_key: str | None = None, session: dict[str, Any] | None = None, timeout: float = 30, model: str | None = None
    ) -> CallClient:
        """Place a call (`model`: `?model=` on the offer, e.g. the full-duplex moshi)."""
        import httpx
        from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

        self = cls()
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.pc = pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        pc.addTrack(self.mic.track)
        self.channel = pc.createDataChannel("oai-events")
        opened = asyncio.Event()
        self.channel.on("open", opened.set)

        @self.channel.on("message")
        def on_message(msg: Any) -> None:
            ev = json.loads(msg)
            ev["_t"] = time.monotonic()
            self.events.put_nowait(ev)

        @pc.on("track")
        def on_track(track: Any) -> None:
            if track.kind == "audio":
                self._tasks.append(asyncio.get_running_loop().create_task(self._record(track)))

        await pc.setLocalDescription(await pc.createOffer())
        calls = f"{self.base_url}/v1/realtime/calls" + (f"?model={model}" if model else "")
        async with httpx.AsyncClient(timeout=timeout) as http:
            if session is None:
                r = await http.post(calls, content=pc.localDescription.sdp, headers={**self.headers, "Content-Type": "application/sdp"})
            else:
                files = {"sdp": (None, pc.localDescription.sdp), "session": (None, json.dumps(session))}
                r = await http.post(calls, files=files, headers=self.headers)
        if r.status_code != 201:
            await pc.close()
            raise CallRefused(r.status_code, r.text)
        self.location = r.headers["location"]
        await pc.setRemoteDescription(RTCSessionDescription(sdp=r.text, type="answer"))
        await asyncio.wait_for(opened.wait(), timeout)
        return self

    @property
    def call_id(self) -> str:
        return (self.location or "").rsplit("/", 1)[-1]

    async def _record(self, track: Any) -> None:
        from aiortc.mediastreams import MediaStreamError

        try:
            while True:
                frame = await track.recv()
                x = frame.to_ndarray().reshape(-1, len(frame.layout.channels)).mean(axis=1).astype(np.int16)
                self.frame_rate = frame.sample_rate
                self.frames.append((time.monotonic(), x))
        except MediaStreamError:
            pass

    # ---- data channel -------------------------------------------------------------------
    def send(self, type: str, **data: Any) -> None:
        self.channel.send(json.dumps({"type": type, **data}))

    async def until(self, types: str | set[str], seen: list[dict[str, Any]] | None = None, timeout: float = 120) -> dict[str, Any]:
        """Data-channel events up to (and including) the first of `types`."""
        return await next_event(self.events, types, seen, timeout)

    # ---- what was heard ------------------------------------------------------------------
    def heard(self, since: float = 0.0) -> np.ndarray:
        parts = [x for t, x in self.frames if t >= since]
        return np.concatenate(parts) if parts else np.zeros(0, np.int16)

    def first_sound(self, since: float, level: int = 64) -> float | None:
        """Arrival time of the first frame after `since` with audible samples."""
        for t, x in self.frames:
            if t >= since and len(x) and int(np.abs(x.astype(np.int32)).max()) > level:
                return t
        return None

    async def hangup(self) -> int | None:
        import httpx

        status = None
        if self.location:
            async with httpx.AsyncClient(timeout=10) as http:
                status = (await http.delete(f"{self.base_url}{self.location}", headers=self.headers)).status_code
        await self.pc.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        return status


class CallRefused(RuntimeError):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


async def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clients.webrtc", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--in", dest="inp", required=True, help="WAV file to speak")
    ap.add_argument("--out", help="write what was heard here (WAV, 24 kHz)")
    ap.add_argument("--api-key")
    ap.add_argument("--loopback", action="store_true", help="ICE on 127.0.0.1 only")
    args = ap.parse_args(argv)
    if args.loopback:
        use_host_addresses(["127.0.0.1"])
    call = await CallClient.connect(args.url, args.api_key)
    print(f"call {call.call_id}", file=sys.stderr)
    call.mic.say(read_wav_pcm16(args.inp))
    seen: list[dict[str, Any]] = []
    stopped = await call.until("input_audio_buffer.speech_stopped", seen)
    done = await call.until("response.done", seen)
    await call.until("output_audio_buffer.stopped", seen)
    first = call.first_sound(stopped["_t"])
    text = "".join(e.get("delta", "") for e in seen if e["type"] == "response.output_audio_transcript.delta")
    heard = call.heard(stopped["_t"])
    lat = f"{(first - stopped['_t']) * 1000:.0f} ms" if first else "n/a"
    print(f"{done['response']['status']}: heard {len(heard) / call.frame_rate:.2f} s, end of speech -> first sound {lat}", file=sys.stderr)
    print(text)
    await call.hangup()
    if args.out:
        import soxr

        y = soxr.resample(heard.astype(np.float32) / 32768.0, call.frame_rate, RATE)
        write_wav_pcm16(args.out, (np.clip(y, -1, 1) * 32767).astype("<i2").tobytes())
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(_main()))
