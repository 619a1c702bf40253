"""A Twilio Media Streams peer: a phone call to omni-rt's `/v1/telephony/twilio` without
Twilio, for tests and latency_bench.

It speaks the bidirectional `<Connect><Stream>` WebSocket as Twilio's documentation
describes it: it sends `connected`, `start` (streamSid, callSid, tracks,
customParameters, mediaFormat audio/x-mulaw 8000 mono), `media` (base64 μ-law, 20 ms
each, with sequenceNumber, chunk and timestamp), `dtmf`, `mark` (echoing the server's
marks once the audio before them has played, and every pending one when a `clear`
empties the buffer) and `stop`; it plays the server's `media` in real time (or
`play_speed` times faster) and keeps when each message arrived (`received_at`)."""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import time
from typing import Any

import aiohttp


class TwilioStream:
    """`dialect="telnyx"`: the same peer speaking Telnyx's spelling of the protocol
    (`stream_id`, `sequence_number`, `start.call_control_id`, `custom_parameters`,
    `media_format {encoding: PCMU|PCMA, sample_rate}`; its frames from the server carry
    no stream id)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, play_speed: float = 1.0, dialect: str = "twilio", law: str = "ulaw") -> None:
        self.ws = ws
        self.telnyx = dialect == "telnyx"
        self.law = law
        self.stream_sid = "MZ" + secrets.token_hex(16)
        self.call_sid = ("v3:" if self.telnyx else "CA") + secrets.token_hex(16)
        self.seq = 0
        self.chunk = 0
        self.sent_ms = 0
        self.play_speed = play_speed  # 1.0: real time; larger plays faster (tests)
        self.received: list[dict[str, Any]] = []  # every message from the server
        self.received_at: list[float] = []  # when each arrived (time.perf_counter)
        self.errors: list[str] = []  # messages that broke Twilio's shapes
        self.audio = bytearray()  # μ-law played (or queued to play)
        self.played_marks: list[str] = []  # marks echoed because their audio played
        self.cleared_marks: list[str] = []  # marks echoed because a clear dropped their audio
        self.clears = 0
        self.played_at_clear: list[str] = []  # the marks played when the first clear came
        self._queue: list[tuple[str, Any]] = []  # ("media", bytes) / ("mark", name), in order
        self._wake = asyncio.Event()
        self.closed: tuple[int | None, str] | None = None
        self._tasks = [asyncio.get_running_loop().create_task(self._read()), asyncio.get_running_loop().create_task(self._play())]

    def _msg(self, event: str, **body: Any) -> str:
        self.seq += 1
        if self.telnyx:
            return json.dumps({"event": event, "sequence_number": str(self.seq), "stream_id": self.stream_sid, **body})
        return json.dumps({"event": event, "sequenceNumber": str(self.seq), "streamSid": self.stream_sid, **body})

    async def start(self, params: dict[str, str] | None = None, media_format: dict[str, Any] | None = None) -> None:
        if self.telnyx:
            await self.ws.send_str(json.dumps({"event": "connected", "version": "1.0.0"}))
            await self.ws.send_str(self._msg("start", start={
                "user_id": secrets.token_hex(8), "call_control_id": self.call_sid, "call_session_id": secrets.token_hex(8),
                "from": "+15550100", "to": "+15550199", "custom_parameters": params or {},
                "media_format": media_format or {"encoding": "PCMU" if self.law == "ulaw" else "PCMA", "sample_rate": 8000, "channels": 1}}))
            return
        await self.ws.send_str(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        await self.ws.send_str(self._msg("start", start={
            "accountSid": "AC" + secrets.token_hex(16), "streamSid": self.stream_sid, "callSid": self.call_sid,
            "tracks": ["inbound"], "customParameters": params or {},
            "mediaFormat": media_format or {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}))

    async def say(self, ulaw: bytes, real_time: bool = False) -> None:
        """Send μ-law audio in 20 ms media messages (paced when `real_time`)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for i in range(0, len(ulaw), 160):
            self.chunk += 1
            await self.ws.send_str(self._msg("media", media={"track": "inbound", "chunk": str(self.chunk), "timestamp": str(self.sent_ms),
                                                             "payload": base64.b64encode(ulaw[i : i + 160]).decode()}))
            self.sent_ms += 20
            if real_time:
                await asyncio.sleep(max(0.0, t0 + (i // 160 + 1) * 0.02 - loop.time()))

    async def dtmf(self, digit: str) -> None:
        await self.ws.send_str(self._msg("dtmf", dtmf={"track": "inbound_track", "digit": digit}))

    async def stop(self) -> None:
        await self.ws.send_str(self._msg("stop", stop={"accountSid": "AC", "callSid": self.call_sid}))

    async def _read(self) -> None:
        while True:
            msg = await self.ws.receive()
            if msg.type is not aiohttp.WSMsgType.TEXT:
                self.closed = (self.ws.close_code, str(msg.extra or ""))
                self._wake.set()
                return
            m = json.loads(msg.data)
            self.received.append(m)
            self.received_at.append(time.perf_counter())
            sid_ok = "stream_id" not in m and "streamSid" not in m if self.telnyx else m.get("streamSid") == self.stream_sid
            if not sid_ok or m.get("event") not in ("media", "mark", "clear"):
                self.errors.append(f"unexpected message {str(m)[:200]}")
            if m["event"] == "media":
                self._queue.append(("media", base64.b64decode(m["media"]["payload"])))
            elif m["event"] == "mark":
                self._queue.append(("mark", m["mark"]["name"]))
            elif m["event"] == "clear":
                self.clears += 1
                if self.clears == 1:
                    self.played_at_clear = list(self.played_marks)
                names = [v for k, v in self._queue if k == "mark"]
                self._queue.clear()
                for name in names:  # Twilio sends back the marks of the audio it dropped
                    self.cleared_marks.append(name)
                    await self.ws.send_str(self._msg("mark", mark={"name": name}))
            self._wake.set()

    async def _play(self) -> None:
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            kind, value = self._queue.pop(0)
            if kind == "media":
                self.audio += value
                await asyncio.sleep(len(value) / 8000 / self.play_speed)
            else:
                self.played_marks.append(value)
                await self.ws.send_str(self._msg("mark", mark={"name": value}))

    def first_after(self, event: str, since: float) -> float | None:
        """When the first `event` message after `since` (perf_counter) arrived, if one has."""
        return next((at for m, at in zip(self.received, self.received_at, strict=True) if m["event"] == event and at > since), None)

    async def wait_for(self, predicate: Any, timeout: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate():
            if loop.time() > deadline:
                raise AssertionError(f"timed out; got {[m['event'] for m in self.received][-20:]}")
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.ws.close()
