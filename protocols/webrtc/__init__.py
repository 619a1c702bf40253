"""WebRTC voice calls (aiortc) on the voice pipeline: what browsers use.

Signalling, OpenAI-style:
- `POST /v1/realtime/calls` with `Content-Type: application/sdp` (the raw offer), or
  `multipart/form-data` with `sdp` and an optional `session` (a session.update body)
  → `201`, body = the SDP answer, `Location: /v1/realtime/calls/{call_id}`.
- `DELETE /v1/realtime/calls/{call_id}` (or `POST …/hangup`) ends the call.
- `POST /offer {sdp, type: "offer"}` → `{sdp, type: "answer", call_id}` (the common
  JSON form).

Media: the caller's Opus audio arrives as 48 kHz frames, is resampled (soxr) to the
model's 24 kHz and goes through the realtime conversation (server VAD, barge-in,
multi-turn history: `protocols.realtime.Conversation`, with this wire's transport:
`call.WebRTCTransport`, `track.TrackOutput`). The answer's audio goes
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

import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from omni_rt.errors import ClientError, NotFound
from protocols.auth import client_secret_of, principal_of
from protocols.calls import calls_of
from protocols.http import check_length, json_response, limits_of, read_body, read_form, read_json
from protocols.realtime import Conversation, apply_session_update, start_config, vad_of
from protocols.registry import Mount
from protocols.webrtc.call import Call, WebRTCTransport
from protocols.webrtc.track import TrackOutput
from protocols.wire_json import load_json
from sessions import Session, SessionError

log = logging.getLogger("protocols.webrtc")

MAX_SDP_BYTES = 64 << 10


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


async def answer_offer(pc: Any, sdp: str) -> None:
    """Set the caller's offer on `pc` and its answer as the local description (an
    offer that cannot be used: OfferError)."""
    from aiortc import RTCSessionDescription

    try:
        await pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
    except Exception as exc:  # noqa: BLE001 - aiortc raises assorted errors for bad SDP
        raise OfferError(f"The SDP offer could not be used: {exc}") from None
    if not any(t.kind == "audio" for t in (tr.receiver.track for tr in pc.getTransceivers()) if t is not None):
        raise OfferError("The offer has no audio track to receive.")
    try:
        await pc.setLocalDescription(await pc.createAnswer())
    except Exception as exc:  # noqa: BLE001 - an offer aiortc parsed but cannot answer (e.g. BUNDLE without a mid)
        raise OfferError(f"The SDP offer could not be answered: {exc}") from None


def new_peer(ice_servers: list[str]) -> Any:
    from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection

    return RTCPeerConnection(RTCConfiguration(iceServers=[RTCIceServer(urls=u) for u in ice_servers]))


async def answer_call(sessions: Any, session: Session, call: Any, pc: Any, sdp: str, outbound: Any,
                      on_channel: Callable[[Any], None], started: Callable[[], None]) -> str:
    """A call's peer connection wired as every call is (the voice pipeline's and a
    full-duplex model's): `outbound` (the model's voice) onto it, the caller's audio
    track into `call.pump_in`, the caller's first data channel to `on_channel`, a failed
    or closed connection ends the session; then the offer answered and `started` run
    (it says `session.created`). The session owns the call (`session.keep`,
    closed with it); a failure on the way ends it as `offer_failed`. Returns the answer."""
    session.keep(call)
    session.add_finalizer(call.close)
    try:
        pc.addTrack(outbound)

        @pc.on("track")
        def on_track(track: Any) -> None:
            if track.kind == "audio":
                call.spawn(call.pump_in(track))

        @pc.on("datachannel")
        def on_datachannel(channel: Any) -> None:
            if call.channel is None:
                on_channel(channel)

        @pc.on("connectionstatechange")
        async def on_state() -> None:
            if pc.connectionState in ("failed", "closed") and session.is_open:
                await sessions.end(session, "peer_" + pc.connectionState)

        await answer_offer(pc, sdp)
        started()
        return str(pc.localDescription.sdp)
    except BaseException:
        await sessions.end(session, "offer_failed")
        raise


async def read_offer(request: web.Request) -> tuple[str, Any]:
    """The SDP offer of `POST /v1/realtime/calls` (application/sdp, or multipart with
    `sdp` and an optional `session` body), checked."""
    ctype = request.content_type.lower()
    session_body = None
    check_length(request, limits_of(request).max_body_bytes)  # before anything is read
    if ctype == "multipart/form-data":
        form = await read_form(request)
        sdp = _form_text(form.get("sdp"))
        raw_session = form.get("session")
        if raw_session is not None:
            session_body = load_json(_form_text(raw_session) or "", "'session' (a session.update body)")
    elif ctype in ("application/sdp", "text/plain", "application/octet-stream", ""):
        try:
            body = await read_body(request, MAX_SDP_BYTES)
        except ClientError:
            raise OfferError(f"The SDP offer is larger than {MAX_SDP_BYTES} bytes.", http_status=413) from None
        sdp = body.decode("utf-8", "replace")
    else:
        raise ClientError(
            f"Send the offer as application/sdp (or multipart/form-data), not {ctype}.", code="unsupported_media_type", http_status=415
        )
    return check_offer(sdp), session_body


def hangup_handler(sessions: Any) -> Any:
    """`DELETE /v1/realtime/calls/{call_id}`: end a call of the caller's (any, for an admin)."""

    async def hangup(request: web.Request) -> web.StreamResponse:
        call_id = request.match_info["call_id"]
        who = principal_of(request)
        try:
            s: Session | None = sessions.get(call_id)
        except SessionError:
            s = None
        calls = calls_of(sessions)
        phone = calls is not None and call_id in calls.calls
        if s is None or not (s.kind == "webrtc" or phone) or not (who.admin or who.name == s.principal):
            raise NotFound(f"No call '{call_id}'.", code="call_not_found")
        await sessions.end(s, "hangup")
        return web.Response(status=204)

    return hangup


def ice_setup(m: Mount) -> list[str]:
    """Configure the ICE host addresses of `m`'s server; its ICE servers."""
    hosts = m.server.webrtc_host_addresses
    if hosts is None and m.server.host in ("127.0.0.1", "localhost"):
        hosts = ["127.0.0.1"]  # a loopback server: offer loopback candidates (aioice skips them)
    configure_ice(hosts)
    return list(m.server.webrtc_ice_servers)


def mount(m: Mount) -> None:
    sessions, pipeline = m.sessions, m.pipeline
    ice_servers = ice_setup(m)
    vad = vad_of(m)

    async def start_call(request: web.Request, sdp: str, session_body: Any) -> tuple[Call, str]:
        cfg = start_config(pipeline, request.query.get("model"), client_secret_of(request))
        if session_body is not None:  # the call starts with this configuration (no session.updated)
            cfg = apply_session_update(cfg, session_body, pipeline.voices)  # a bad field: 400 naming it
        session = await sessions.open("webrtc", pipeline.name, principal=principal_of(request).name)
        conv = Conversation(session, sessions, pipeline, ga=True, model=cfg.model, vad=vad)
        conv.cfg = cfg
        pc = new_peer(ice_servers)
        output = TrackOutput(session, sessions)
        conv.transport = WebRTCTransport(output)
        call = Call(session, sessions, conv, output, pc)

        def on_channel(channel: Any) -> None:
            call.channel = channel

            @channel.on("message")
            def on_message(message: Any) -> None:
                call.spawn(conv.handle(message))

            def start() -> None:
                call.spawn(call.pump_out())

            if channel.readyState == "open":
                start()
            else:
                channel.on("open", start)

        answer = await answer_call(sessions, session, call, pc, sdp, output.track.track, on_channel,
                                   lambda: conv.emit("session.created", session=conv.cfg.wire(True, session.id)))
        return call, answer

    async def create_call(request: web.Request) -> web.StreamResponse:
        sdp, session_body = await read_offer(request)
        call, answer = await start_call(request, sdp, session_body)
        location = f"/v1/realtime/calls/{call.session.id}"
        return web.Response(text=answer, status=201, content_type="application/sdp", headers={"Location": location})

    async def offer(request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        if not isinstance(body, Mapping) or body.get("type", "offer") != "offer":
            raise ClientError("Expected {sdp, type: 'offer'}.")
        call, answer = await start_call(request, check_offer(body.get("sdp")), body.get("session"))
        return json_response({"sdp": answer, "type": "answer", "call_id": call.session.id}, headers={"Location": f"/v1/realtime/calls/{call.session.id}"})

    hangup = hangup_handler(sessions)

    m.route("POST", "/v1/realtime/calls", create_call, "WebRTC call (SDP offer → answer)")
    m.route("POST", "/offer", offer)
    m.route("DELETE", "/v1/realtime/calls/{call_id}", hangup)
    m.route("POST", "/v1/realtime/calls/{call_id}/hangup", hangup)


def _form_text(value: Any) -> str | None:
    """A multipart field as text (a plain field, or a file part's contents)."""
    if value is None or isinstance(value, str):
        return value
    data = value.file.read() if hasattr(value, "file") else bytes(value)
    return data.decode("utf-8", "replace")
