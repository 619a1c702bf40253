"""WebRTC voice calls (aiortc) on the voice pipeline: what browsers use.

Signalling, OpenAI-style:
- `POST /v1/realtime/calls` with `Content-Type: application/sdp` (the raw offer), or
  `multipart/form-data` with `sdp` and an optional `session` (a session.update body)
  → `201`, body = the SDP answer, `Location: /v1/realtime/calls/{call_id}`.
- `DELETE /v1/realtime/calls/{call_id}` (or `POST …/hangup`) ends the call.
- `POST /offer {sdp, type: "offer"}` → `{sdp, type: "answer", call_id}` (the common
  JSON form).

Media: the caller's Opus audio arrives as 48 kHz frames, is resampled (soxr) to the
model's 24 kHz and goes through the realtime conversation logic (server VAD, barge-in,
multi-turn history: `protocols.realtime.RealtimeConnection`). The answer's audio goes
out on a paced track: 20 ms frames in real time, silence between answers, a bounded
buffer. The data channel `oai-events` carries the realtime JSON events both ways
(session.update, response.create/cancel, transcripts, response.done…), without the
audio append/delta events: audio goes over RTP. `output_audio_buffer.started` /
`.stopped` tell when the agent's audio starts and ends playing; on barge-in the server
drops what it had buffered and sends `output_audio_buffer.cleared`.

A call is a session of kind `webrtc` (over a cap the offer gets 429). It ends on hang-up,
when the peer connection fails or closes, or when the session expires.
"""

from __future__ import annotations

import asyncio
import fractions
import json
import logging
import re
import time
from collections import deque
from typing import Any, Mapping

import numpy as np
import soxr
from aiohttp import web

from omni_rt import metrics
from omni_rt.errors import ClientError, NotFound
from omni_rt.specs import PipelineSpec
from protocols.audio_formats import Pcm16Resampler
from protocols.auth import principal_of
from protocols.http import json_response
from protocols.pages import demo_page
from protocols.realtime import RATE, RealtimeConnection, apply_session_update, wire_data
from protocols.registry import Mount
from sessions import Session, SessionError, SessionManager

log = logging.getLogger("protocols.webrtc")

RTP_RATE = 48000
FRAME_MS = 20
FRAME = RTP_RATE * FRAME_MS // 1000
MAX_BUFFERED_S = 120.0  # answer audio waiting to be played, per call
MAX_DC_BUFFERED = 8 << 20  # bytes queued on the data channel
MAX_SDP_BYTES = 64 << 10
IN_BATCH_MS = 60  # inbound audio handed to VAD/encoder in batches of this much


def configure_ice(host_addresses: list[str] | None) -> None:
    """Limit the addresses aioice gathers host candidates on (it skips 127.0.0.1 by
    default, so a loopback-only deployment or test must name it). aioice has no option
    for this, so its address lookup is replaced, process-wide."""
    if host_addresses is None:
        return
    import aioice.ice

    addrs = list(host_addresses)
    aioice.ice.get_host_addresses = lambda use_ipv4, use_ipv6: [a for a in addrs if (use_ipv6 if ":" in a else use_ipv4)]


class OfferError(ClientError):
    """An SDP offer (or its session body) that cannot start a call: 400 invalid_sdp."""

    code = "invalid_sdp"


def check_offer(sdp: Any) -> str:
    if not isinstance(sdp, str) or not sdp.strip():
        raise OfferError("The offer is empty; send an SDP offer (Content-Type: application/sdp).")
    if len(sdp) > MAX_SDP_BYTES:
        raise OfferError(f"The SDP offer is larger than {MAX_SDP_BYTES} bytes.")
    if not sdp.lstrip().startswith("v=0"):
        raise OfferError("Not an SDP offer: it must start with 'v=0'.")
    if not re.search(r"^m=audio ", sdp, re.M):
        raise OfferError("The offer has no audio media section (m=audio); a voice call needs one.")
    return sdp


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


class WebRTCConnection(RealtimeConnection):
    """The realtime conversation of one call, with RTP audio instead of audio events."""

    def __init__(self, session: Session, sessions: SessionManager, pipeline: PipelineSpec, model: str) -> None:
        super().__init__(session, sessions, pipeline, True, model)
        self.out = PacedAudioTrack(session, self._playback_state)
        self.answers: dict[str, Any] = {}  # response id -> its item (recent answers)
        self._out = Pcm16Resampler(RATE, RTP_RATE)

    def _playback_state(self, type: str, response_id: str | None) -> None:
        self.session.emit(type, {"response_id": response_id})

    async def cancel_response(self, reason: str) -> None:
        cleared = None
        if self.response is not None:
            # The server owns the output buffer on WebRTC: what was not played yet is
            # dropped now, before the epoch advance (no await in between) and before
            # the response's response.done.
            cleared = self.clear_output(self.response.id)
        await super().cancel_response(reason)
        self.keep_heard(cleared)

    def clear_output(self, response_id: str | None) -> str | None:
        """Drop the queued answer audio; the response id that was cut, if any."""
        dropped = self.out.clear()
        if not dropped and self.out.playing is None:
            return None
        rid, self.out.playing = self.out.playing or response_id, None
        self.session.emit("output_audio_buffer.cleared", {"response_id": rid})
        return rid

    def keep_heard(self, response_id: str | None) -> None:
        """History keeps what the caller heard (the server played it, so it knows)."""
        item = self.answers.get(response_id) if response_id else None
        if item is not None and item.id in self.items:
            heard = self.out.played.get(response_id, 0) * 1000 // RTP_RATE
            self.item_truncate({"item_id": item.id, "content_index": 0, "audio_end_ms": heard})

    async def create_response(self, ev: Mapping[str, Any], event_id: str | None) -> None:
        await super().create_response(ev, event_id)
        if self.response is not None and self.response.audio_out:
            self.answers[self.response.id] = self.response.item
            while len(self.answers) > 16:
                old = next(iter(self.answers))
                self.answers.pop(old)
                self.out.played.pop(old, None)

    async def speech_started(self, at_ms: int, td: Any) -> None:
        if td.interrupt_response and (self.response is not None or self.out.buffered or self.out.playing is not None):
            self.out.cut_at = time.monotonic()
        await super().speech_started(at_ms, td)
        if td.interrupt_response and (self.out.buffered or self.out.playing is not None):
            self.keep_heard(self.clear_output(None))  # an answer generated in full but still playing

    def audio_out(self, fence: Any, response_id: str, pcm16: bytes) -> bool:
        return self.out.push(fence, response_id, np.frombuffer(self._out.convert(response_id, pcm16), "<i2"))

    async def dispatch(self, t: str, ev: dict[str, Any], event_id: str | None) -> None:
        if t in ("input_audio_buffer.append", "input_audio_buffer.commit") and self.cfg.turn_detection is not None:
            # audio comes over RTP; with server VAD there is nothing to append or commit
            raise ClientError(f"'{t}' is not used on a WebRTC call: audio arrives over RTP.", code="invalid_value", param="type")
        if t == "output_audio_buffer.clear":
            if self.response is not None:
                await self.cancel_response("client_cancelled")
            else:
                self.keep_heard(self.clear_output(None))
            return
        await super().dispatch(t, ev, event_id)


class Call:
    def __init__(self, session: Session, conn: WebRTCConnection, pc: Any) -> None:
        self.session = session
        self.conn = conn
        self.pc = pc
        self.channel: Any = None
        self.tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def pump_in(self, track: Any) -> None:
        """Caller audio → 24 kHz mono → VAD / encoder, in small batches."""
        from aiortc.mediastreams import MediaStreamError

        rs: soxr.ResampleStream | None = None
        rate = None
        batch: list[np.ndarray] = []
        have = 0
        try:
            while True:
                frame = await track.recv()
                x = frame.to_ndarray()
                channels = len(frame.layout.channels)
                if x.dtype != np.int16:
                    x = (np.clip(x.astype(np.float32), -1, 1) * 32767).astype(np.int16)
                pcm = x.reshape(-1, channels).astype(np.float32).mean(axis=1) / 32768.0
                if frame.sample_rate != rate:
                    rate = frame.sample_rate
                    rs = soxr.ResampleStream(rate, RATE, 1, dtype="float32") if rate != RATE else None
                y = rs.resample_chunk(pcm) if rs is not None else pcm
                batch.append(y)
                have += len(y)
                if have * 1000 >= IN_BATCH_MS * RATE:
                    chunk = np.concatenate(batch)
                    batch, have = [], 0
                    self.session.touch()
                    await self.conn.append_pcm(chunk)
        except MediaStreamError:
            pass  # the caller's track ended
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a broken inbound track ends the call
            log.exception("call %s: inbound audio failed", self.session.id)

    async def pump_out(self) -> None:
        """Session events → the data channel (JSON) and the paced track (audio)."""
        ch = self.channel
        async for ev in self.session.events():
            if ev.fence is not None and ev.fence.is_stale_against(self.session.fence):
                metrics.DROPPED_STALE.labels(hop="adapter").inc()
                continue
            if ev.type == "response.output_audio.delta":
                if not self.conn.audio_out(ev.fence, ev.data["response_id"], ev.data["delta"]):
                    log.warning("call %s: more than %.0f s of audio waiting to play; ending it", self.session.id, MAX_BUFFERED_S)
                    self.spawn(self.conn.sessions.end(self.session, "slow_consumer"))
                continue
            if ch is None or ch.readyState != "open":
                continue
            if ch.bufferedAmount > MAX_DC_BUFFERED:
                self.spawn(self.conn.sessions.end(self.session, "slow_consumer"))
                continue
            ch.send(json.dumps({"type": ev.type, "event_id": f"event_{ev.seq:06d}", **wire_data(ev.data)}))
            if ev.type in ("session.expired", "session.closed"):
                break

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.conn.shutdown("call_ended")
        self.conn.out.track.stop()
        await self.pc.close()


def mount(m: Mount) -> None:
    sessions, pipeline = m.sessions, m.pipeline
    hosts = m.server.webrtc_host_addresses
    if hosts is None and m.server.host in ("127.0.0.1", "localhost"):
        hosts = ["127.0.0.1"]  # a loopback server: offer loopback candidates (aioice skips them)
    configure_ice(hosts)
    ice_servers = m.server.webrtc_ice_servers

    async def start_call(request: web.Request, sdp: str, session_body: Any) -> tuple[Call, str]:
        from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription

        model = request.query.get("model") or pipeline.models[0]
        session = await sessions.open("webrtc", pipeline.name, principal=principal_of(request).name)
        conn = WebRTCConnection(session, sessions, pipeline, model)
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[RTCIceServer(urls=u) for u in ice_servers]))
        call = Call(session, conn, pc)
        session.data["call"] = call
        session.add_finalizer(call.close)
        try:
            if session_body is not None:
                try:  # the call starts with this configuration (no session.updated)
                    conn.cfg = apply_session_update(conn.cfg, session_body, pipeline.voices)
                except ClientError as err:
                    raise OfferError(f"session: {err.message}") from None
            pc.addTrack(conn.out.track)

            @pc.on("track")
            def on_track(track: Any) -> None:
                if track.kind == "audio":
                    call.spawn(call.pump_in(track))

            @pc.on("datachannel")
            def on_datachannel(channel: Any) -> None:
                if call.channel is not None:
                    return
                call.channel = channel

                @channel.on("message")
                def on_message(message: Any) -> None:
                    call.spawn(conn.handle(message))

                def start() -> None:
                    call.spawn(call.pump_out())

                if channel.readyState == "open":
                    start()
                else:
                    channel.on("open", start)

            @pc.on("connectionstatechange")
            async def on_state() -> None:
                if pc.connectionState in ("failed", "closed") and session.is_open:
                    await sessions.end(session, "peer_" + pc.connectionState)

            try:
                await pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
            except Exception as exc:  # noqa: BLE001 - aiortc raises assorted errors for bad SDP
                raise OfferError(f"The SDP offer could not be used: {exc}") from None
            if not any(t.kind == "audio" for t in (tr.receiver.track for tr in pc.getTransceivers()) if t is not None):
                raise OfferError("The offer has no audio track to receive.")
            await pc.setLocalDescription(await pc.createAnswer())
            conn.emit("session.created", session=conn.cfg.wire(True, session.id))
            return call, pc.localDescription.sdp
        except BaseException:
            await sessions.end(session, "offer_failed")
            raise

    async def create_call(request: web.Request) -> web.StreamResponse:
        ctype = request.content_type.lower()
        session_body = None
        if ctype == "multipart/form-data":
            form = await request.post()
            sdp = _form_text(form.get("sdp"))
            raw_session = form.get("session")
            if raw_session is not None:
                try:
                    session_body = json.loads(_form_text(raw_session) or "")
                except (json.JSONDecodeError, UnicodeDecodeError):
                    raise ClientError("'session' must be JSON (a session.update body).") from None
        elif ctype in ("application/sdp", "text/plain", "application/octet-stream", ""):
            body = await request.read()
            if len(body) > MAX_SDP_BYTES:
                raise OfferError(f"The SDP offer is larger than {MAX_SDP_BYTES} bytes.")
            sdp = body.decode("utf-8", "replace")
        else:
            raise ClientError(
                f"Send the offer as application/sdp (or multipart/form-data), not {ctype}.", code="unsupported_media_type", http_status=415
            )
        call, answer = await start_call(request, check_offer(sdp), session_body)
        location = f"/v1/realtime/calls/{call.session.id}"
        return web.Response(text=answer, status=201, content_type="application/sdp", headers={"Location": location})

    async def offer(request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ClientError("The body must be JSON: {sdp, type: 'offer'}.", code="invalid_json") from None
        if not isinstance(body, Mapping) or body.get("type", "offer") != "offer":
            raise ClientError("Expected {sdp, type: 'offer'}.")
        call, answer = await start_call(request, check_offer(body.get("sdp")), body.get("session"))
        return json_response({"sdp": answer, "type": "answer", "call_id": call.session.id}, headers={"Location": f"/v1/realtime/calls/{call.session.id}"})

    async def hangup(request: web.Request) -> web.StreamResponse:
        call_id = request.match_info["call_id"]
        who = principal_of(request)
        try:
            s: Session | None = sessions.get(call_id)
        except SessionError:
            s = None
        if s is None or s.kind != "webrtc" or not (who.admin or who.name == s.principal):
            raise NotFound(f"No call '{call_id}'.", code="call_not_found")
        await sessions.end(s, "hangup")
        return web.Response(status=204)

    async def demo(request: web.Request) -> web.StreamResponse:
        return demo_page()

    m.route("POST", "/v1/realtime/calls", create_call, "WebRTC call (SDP offer → answer)")
    m.route("POST", "/offer", offer)
    m.route("DELETE", "/v1/realtime/calls/{call_id}", hangup)
    m.route("POST", "/v1/realtime/calls/{call_id}/hangup", hangup)
    m.route("GET", "/demo", demo)


def _form_text(value: Any) -> str | None:
    """A multipart field as text (a plain field, or a file part's contents)."""
    if value is None or isinstance(value, str):
        return value
    data = value.file.read() if hasattr(value, "file") else bytes(value)
    return data.decode("utf-8", "replace")
