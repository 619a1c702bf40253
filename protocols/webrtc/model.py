"""WebRTC calls with the full-duplex model: `POST /v1/realtime/calls?model=moshi` (the
raw SDP offer, or multipart with `sdp`) → 201 with the SDP answer and `Location:
/v1/realtime/calls/{call_id}`; `POST /offer?model=moshi {sdp, type}` → `{sdp, type:
answer, call_id}`; hang up with `DELETE /v1/realtime/calls/{call_id}`.

The caller's Opus audio (48 kHz) goes to the model's conversation as the duplex wire's
does (`protocols.duplex.model.ModelConversation`: resampled to 24 kHz with soxr, the
same real-time bound); the model's voice comes back on a paced 48 kHz track (20 ms
frames in real time, silence when there is nothing queued), and the `oai-events` data
channel carries `session.created`, `duplex.text.delta {frame, delta}`,
`duplex.frame.late`, `output_audio_buffer.started` / `.stopped`, `error` and
`session.closed`. A call is a session of kind `webrtc`, admitted by the model's frame
budget (over it: 429 `capacity` with retry-after); it ends on hang-up, when the peer
connection fails or closes, or when the session expires.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import numpy as np
from aiohttp import web

from media.wire_audio import WireFormat
from omni_rt.errors import ClientError
from protocols.auth import principal_of
from protocols.duplex.model import AUDIO_DELTA, DuplexModel, ModelConversation, open_conversation
from protocols.http import json_response, read_json
from protocols.registry import Mount
from protocols.webrtc import answer_call, check_offer, hangup_handler, ice_setup, new_peer, read_offer
from protocols.webrtc.call import MAX_DC_BUFFERED
from protocols.webrtc.track import RTP_RATE, PacedAudioTrack
from sessions import END_EVENTS, Session, SessionManager

log = logging.getLogger("protocols.webrtc.model")

MAX_PENDING_EVENTS = 256  # events held for a data channel that has not opened yet


class MoshiCall:
    def __init__(self, session: Session, sessions: SessionManager, conv: ModelConversation, pc: Any) -> None:
        self.session = session
        self.sessions = sessions
        self.conv = conv
        self.pc = pc
        self.channel: Any = None
        self.track = PacedAudioTrack(session, lambda type, rid: session.emit(type, {"response_id": rid}))
        self.tasks: set[asyncio.Task[Any]] = set()
        self.pending: list[str] = []
        # RTP both ways at 48 kHz: the conversation resamples to and from the model's rate
        conv.set_formats(WireFormat("pcm16", RTP_RATE), WireFormat("pcm16", RTP_RATE))
        conv.binary_out = True

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def pump_in(self, track: Any) -> None:
        from aiortc.mediastreams import MediaStreamError

        try:
            while True:
                frame = await track.recv()
                if frame.sample_rate != RTP_RATE:
                    raise ClientError(f"the call's audio arrives at {frame.sample_rate} Hz; Opus on WebRTC is {RTP_RATE} Hz")
                x = frame.to_ndarray()
                channels = len(frame.layout.channels)
                if x.dtype != np.int16:
                    x = (np.clip(x.astype(np.float32), -1, 1) * 32767).astype(np.int16)
                mono = x.reshape(-1, channels).mean(axis=1).astype("<i2")
                self.session.touch()
                try:
                    self.conv.audio_in(mono.tobytes())
                except ClientError as exc:  # said on the channel; the call goes on
                    self.session.emit("error", {"error": {**exc.wire(), "event_id": None}})
        except MediaStreamError:
            pass  # the caller's track ended
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a broken inbound track ends the call
            log.exception("call %s: inbound audio failed", self.session.id)
            self.sessions.end_soon(self.session, "server_error")

    async def pump_out(self) -> None:
        """The session's events: the model's voice onto the track, the rest onto the channel."""
        async for ev in self.session.events():
            if ev.type == AUDIO_DELTA:
                if not self.track.push(None, "moshi", np.frombuffer(ev.data["delta"], "<i2")):
                    self.sessions.end_soon(self.session, "slow_consumer")
                continue
            self.send(json.dumps({"type": ev.type, "event_id": f"event_{ev.seq:06d}", **ev.data}))
            if ev.type in END_EVENTS:
                break

    def send(self, text: str) -> None:
        """Onto the data channel; what comes before the caller's channel opens (the
        offer's `session.created`, the first text) waits for it, up to a bound."""
        ch = self.channel
        if ch is None or ch.readyState != "open":
            if len(self.pending) >= MAX_PENDING_EVENTS:
                self.sessions.end_soon(self.session, "slow_consumer")
                return
            self.pending.append(text)
            return
        if ch.bufferedAmount > MAX_DC_BUFFERED:
            self.sessions.end_soon(self.session, "slow_consumer")
            return
        ch.send(text)

    def attach(self, channel: Any) -> None:
        """The caller's `oai-events` channel: what waited goes first, in order."""
        self.channel = channel

        def flush() -> None:
            pending, self.pending = self.pending, []
            for text in pending:
                self.send(text)

        if channel.readyState == "open":
            flush()
        else:
            channel.on("open", flush)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.track.track.stop()
        try:
            await self.pc.close()
        except Exception as exc:  # noqa: BLE001 - aiortc fails closing some half-negotiated connections
            log.info("call %s: closing the peer connection raised %r", self.session.id, exc)


def mount(m: Mount) -> None:
    sessions, pipeline = m.sessions, m.pipeline
    proc = m.processor(DuplexModel)
    ice_servers = ice_setup(m)

    async def start_call(request: web.Request, sdp: str, model: str) -> tuple[MoshiCall, str]:
        session, conv = await open_conversation(sessions, pipeline.name, m.entry_pool, "webrtc", principal_of(request).name, model)
        pc = new_peer(ice_servers)
        call = MoshiCall(session, sessions, conv, pc)

        def started() -> None:
            session.emit("session.created", {"session": {**conv.wire({}), "type": "realtime", "capabilities": {"full_duplex": True, "frame_ms": proc.describe()["frame_ms"]}}})
            call.spawn(call.pump_out())

        return call, await answer_call(sessions, session, call, pc, sdp, call.track.track, call.attach, started)

    async def create_call(request: web.Request) -> web.StreamResponse:
        sdp, _ = await read_offer(request)
        call, answer = await start_call(request, sdp, request.query.get("model") or pipeline.models[0])
        return web.Response(text=answer, status=201, content_type="application/sdp", headers={"Location": f"/v1/realtime/calls/{call.session.id}"})

    async def offer(request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        if not isinstance(body, dict) or body.get("type", "offer") != "offer":
            raise ClientError("Expected {sdp, type: 'offer'}.")
        call, answer = await start_call(request, check_offer(body.get("sdp")), request.query.get("model") or pipeline.models[0])
        return json_response({"sdp": answer, "type": "answer", "call_id": call.session.id}, headers={"Location": f"/v1/realtime/calls/{call.session.id}"})

    hangup = hangup_handler(sessions)  # (where the voice pipeline is served, its route ends these calls too)
    for name in pipeline.models:
        m.route("POST", "/v1/realtime/calls", create_call, "WebRTC call with the full-duplex model (?model=moshi)" if name == pipeline.models[0] else None, model=name)
        m.route("POST", "/offer", offer, model=name)
        m.route("DELETE", "/v1/realtime/calls/{call_id}", hangup, model=name)
        m.route("POST", "/v1/realtime/calls/{call_id}/hangup", hangup, model=name)
