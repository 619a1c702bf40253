"""The agent's voice on a WebRTC call: a paced 48 kHz track and the call's
`AudioOutput`.

The server plays the answer itself (20 ms frames in real time, silence between
answers, a bounded buffer), so it knows exactly what the caller heard: on barge-in or
cancel `TrackOutput.clear` drops what was not played yet (the next frame is silent),
says `output_audio_buffer.cleared`, and reports what was played of the answer it cut.
"""

from __future__ import annotations

import asyncio
import fractions
import logging
import time
from collections import deque
from typing import Any

import numpy as np

from media.wire_audio import OutputEncoder, WireFormat
from omni_rt import metrics
from omni_rt.payloads import Fence
from protocols.realtime import RATE, Response
from sessions import Session, SessionManager

log = logging.getLogger("protocols.webrtc")

RTP_RATE = 48000
FRAME_MS = 20
FRAME = RTP_RATE * FRAME_MS // 1000
MAX_BUFFERED_S = 120.0  # answer audio waiting to be played, per call
RECENT_ANSWERS = 16


class PacedAudioTrack:
    """The agent's voice: 20 ms frames at 48 kHz, paced in real time; silence when
    there is nothing to say. Chunks carry their turn's fence and are dropped once stale
    (a barge-in silences the track from the next frame on)."""

    def __init__(self, session: Session, on_state: Any) -> None:
        from aiortc.mediastreams import MediaStreamTrack

        outer = self

        class _Track(MediaStreamTrack):
            kind = "audio"

            async def recv(self) -> Any:
                return await outer.recv(self)

        self.track = _Track()
        self.session = session
        self.on_state = on_state  # (event type, response id) -> None
        self.chunks: deque[tuple[Any, str, np.ndarray]] = deque()  # (fence, response id, int16 @48k)
        self.buffered = 0  # samples queued
        self.playing: str | None = None  # response id being played
        self.played: dict[str, int] = {}  # response id -> samples played (recent answers)
        self._start: float | None = None
        self._pts = 0
        self.last_sent: float | None = None
        self.cut_at: float | None = None  # when the user cut in (barge-in), until silent

    def push(self, fence: Any, response_id: str, pcm48: np.ndarray) -> bool:
        if self.buffered + len(pcm48) > MAX_BUFFERED_S * RTP_RATE:
            return False
        self.chunks.append((fence, response_id, pcm48))
        self.buffered += len(pcm48)
        return True

    def clear(self) -> int:
        """Drop everything queued; samples dropped."""
        n = self.buffered
        self.chunks.clear()
        self.buffered = 0
        return n

    def _take(self) -> np.ndarray:
        out = np.zeros(FRAME, np.int16)
        filled = 0
        current = self.session.fence
        rid = None
        while filled < FRAME and self.chunks:
            fence, rid_, pcm = self.chunks[0]
            if fence is not None and fence.is_stale_against(current):
                self.chunks.popleft()
                self.buffered -= len(pcm)
                metrics.DROPPED_STALE.labels(hop="webrtc_track").inc()
                continue
            rid = rid_
            n = min(FRAME - filled, len(pcm))
            self.played[rid_] = self.played.get(rid_, 0) + n
            out[filled : filled + n] = pcm[:n]
            filled += n
            if n == len(pcm):
                self.chunks.popleft()
            else:
                self.chunks[0] = (fence, rid_, pcm[n:])
            self.buffered -= n
        if filled and self.playing is None:
            self.playing = rid
            self.on_state("output_audio_buffer.started", rid)
        elif not filled and self.playing is not None:
            self.on_state("output_audio_buffer.stopped", self.playing)
            self.playing = None
        if not filled and self.cut_at is not None:
            metrics.WEBRTC_BARGE_IN_SILENT_SECONDS.observe(time.monotonic() - self.cut_at)
            self.cut_at = None
        return out

    async def recv(self, track: Any) -> Any:
        import av
        from aiortc.mediastreams import MediaStreamError

        if track.readyState != "live":
            raise MediaStreamError
        now = time.monotonic()
        if self._start is None:
            self._start = now
        else:
            self._pts += FRAME
            wait = self._start + self._pts / RTP_RATE - now
            if wait > 0:
                await asyncio.sleep(wait)
            elif wait < -0.2:  # far behind (a stall): start the clock again
                self._start, self._pts = now, 0
        sent = time.monotonic()
        if self.last_sent is not None:
            metrics.WEBRTC_FRAME_GAP_SECONDS.observe(sent - self.last_sent)
        self.last_sent = sent
        frame = av.AudioFrame.from_ndarray(self._take().reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = RTP_RATE
        frame.pts = self._pts
        frame.time_base = fractions.Fraction(1, RTP_RATE)
        return frame


class TrackOutput:
    """The call's AudioOutput: answer audio resampled to 48 kHz onto the paced track.
    A caller that lets more than MAX_BUFFERED_S pile up is ended (`slow_consumer`)."""

    def __init__(self, session: Session, sessions: SessionManager) -> None:
        self.session = session
        self.sessions = sessions
        self.track = PacedAudioTrack(session, self._playback_state)
        self._rs = OutputEncoder(WireFormat("pcm16", RTP_RATE), RATE)
        self.items: dict[str, str] = {}  # response id -> its item id (recent answers)

    def _playback_state(self, type: str, response_id: str | None) -> None:
        self.session.emit(type, {"response_id": response_id})

    def push(self, resp: Response, fence: Fence, pcm16: bytes) -> None:
        if resp.id not in self.items:
            self.items[resp.id] = resp.item.id
            while len(self.items) > RECENT_ANSWERS:
                old = next(iter(self.items))
                self.items.pop(old)
                self.track.played.pop(old, None)
        if not self.track.push(fence, resp.id, np.frombuffer(self._rs.encode(resp.id, pcm16), "<i2")):
            log.warning("call %s: more than %.0f s of audio waiting to play; ending it", self.session.id, MAX_BUFFERED_S)
            self.sessions.end_soon(self.session, "slow_consumer")

    def end(self, resp: Response, fence: Fence) -> None:
        tail = self._rs.finish(resp.id)
        if tail:
            self.track.push(fence, resp.id, np.frombuffer(tail, "<i2"))

    def clear(self) -> dict[str, int]:
        track = self.track
        dropped = track.clear()
        rid = track.playing or (next(reversed(self.items)) if dropped and self.items else None)
        if not dropped and track.playing is None:
            return {}
        track.playing = None
        track.cut_at = time.monotonic()
        self.session.emit("output_audio_buffer.cleared", {"response_id": rid})
        item = self.items.get(rid) if rid is not None else None
        if rid is None or item is None:
            return {}
        return {item: track.played.get(rid, 0) * 1000 // RTP_RATE}
