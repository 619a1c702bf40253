"""`/v1/realtime`: the OpenAI Realtime protocol over WebSocket, on the voice pipeline.

Both dialects: GA (`client.realtime.connect`) and beta (`client.beta.realtime.connect`,
header `OpenAI-Beta: realtime=v1`). The dialect is fixed at connect time from that
header; every server event uses the dialect's names and session shape, and
`session.update` accepts either shape.

The package: `models` (session configuration and client-event validation), `vad`
(voice-activity detection), `items` (the conversation's pieces), `inputs` (the input
audio buffer), `responses`, `output` (where answer audio goes and what was heard),
`conversation` (the conversation itself, transport-independent); `/v1/duplex` and
WebRTC calls plug their own transports into the same conversation.
"""

from __future__ import annotations

from aiohttp import web

from protocols.auth import principal_of
from protocols.realtime.conversation import Conversation, Transport, WebSocketTransport
from protocols.realtime.items import AUDIO_PLACEHOLDER, GA_NAMES, Item, Response, wire_data
from protocols.realtime.models import RATE, Config, SessionUpdate, TurnDetection, apply_session_update
from protocols.realtime.output import AudioOutput, EventOutput
from protocols.realtime.vad import VadFactory, silero_vad
from protocols.registry import Mount
from protocols.ws import accept, close_attachment, numbered_json, reject, serve_events
from sessions import SessionError

__all__ = [
    "AUDIO_PLACEHOLDER",
    "AudioOutput",
    "Config",
    "Conversation",
    "EventOutput",
    "GA_NAMES",
    "Item",
    "RATE",
    "Response",
    "SessionUpdate",
    "Transport",
    "TurnDetection",
    "WebSocketTransport",
    "apply_session_update",
    "mount",
    "vad_of",
    "wire_data",
]


def vad_of(m: Mount) -> VadFactory:
    """The voice-activity detector the voice wires use (tests plug in a fake)."""
    vad: VadFactory = m.options.get("vad", silero_vad)
    return vad


def mount(m: Mount) -> None:
    sessions, pipeline, vad = m.sessions, m.pipeline, vad_of(m)

    async def realtime(request: web.Request) -> web.StreamResponse:
        model = request.query.get("model") or pipeline.models[0]
        ga = "realtime=v1" not in (request.headers.get("openai-beta") or "")
        try:
            session = await sessions.open("realtime", pipeline.name, principal=principal_of(request).name)
        except SessionError as exc:
            return await reject(request, exc)
        conv = Conversation(session, sessions, pipeline, ga=ga, model=model, vad=vad)
        try:
            sock = await accept(request)
        except BaseException:
            await sessions.end(session, "client_disconnected")
            raise
        conv.emit("session.created", session=conv.cfg.wire(ga, session.id))

        async def on_message(data: str | bytes) -> bool:
            await conv.handle(data)
            return True

        async def on_exit(why: str) -> None:
            await conv.shutdown("client_disconnected")
            await sessions.end(session, {"client_left": "client_disconnected", "session_ended": "ended"}.get(why, why))

        why = await serve_events(sock, session, numbered_json(wire_data), on_message, on_exit)
        await close_attachment(sock, session, why)
        return sock.ws

    m.websocket("/v1/realtime", realtime, "OpenAI Realtime (GA and beta)")
