"""`/v1/realtime`: the OpenAI Realtime protocol over WebSocket, on the voice pipeline.

Both dialects: GA (`client.realtime.connect`) and beta (`client.beta.realtime.connect`,
header `OpenAI-Beta: realtime=v1`). The dialect is fixed at connect time from that
header; every server event uses the dialect's names and session shape, and
`session.update` accepts either shape.

The package: `models` (session configuration and client-event validation), `vad`
(voice-activity detection), `items` (the conversation's pieces), `inputs` (the input
audio buffer), `responses`, `output` (where answer audio goes and what was heard),
`turn` (semantic_vad's end-of-turn model), `conversation` (the conversation itself, transport-independent); `/v1/duplex` and
WebRTC calls plug their own transports into the same conversation.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Literal

from aiohttp import web
from pydantic import Field

from omni_rt import metrics
from omni_rt.errors import ClientError, NotFound
from omni_rt.specs import PipelineSpec
from protocols.auth import CLIENT_SECRETS, ClientSecret, client_secret_of, principal_of
from protocols.calls import calls_of
from protocols.http import json_response, read_json, validate_body
from protocols.realtime.conversation import Conversation, Transport, WebSocketTransport
from protocols.realtime.items import AUDIO_PLACEHOLDER, GA_NAMES, Item, Response, new_id, wire_data
from protocols.realtime.models import DEFAULT_TRANSCRIPTION, RATE, Config, SessionUpdate, TurnDetection, WireModel, apply_session_update
from protocols.realtime.output import AudioOutput, EventOutput
from protocols.realtime.turn import SemanticVad, TurnModel, shared_smart_turn, smart_turn_path
from protocols.realtime.vad import VadFactory, VoiceActivity, preload_silero, silero_vad
from protocols.registry import Mount
from protocols.ws import accept, close_attachment, numbered_json, reject, serve_events
from sessions import SessionError

log = logging.getLogger("protocols.realtime")

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
    "start_config",
    "vad_of",
    "wire_data",
]


def vad_of(m: Mount) -> VadFactory:
    """The voice-activity detector the voice wires use (tests plug in a fake), with the
    end-of-turn model semantic_vad runs on it (`server.turn_model`; the `turn_model`
    option for tests)."""
    vad: VadFactory = m.options.get("vad", silero_vad)
    if vad is silero_vad:
        preload_silero()
    model = m.options["turn_model"] if "turn_model" in m.options else turn_model_of(m.server.turn_model)

    async def detector() -> VoiceActivity:
        return SemanticVad(await vad(), model, on_decision=_count_decision)

    return detector


def _count_decision(probability: float, ended: bool) -> None:
    metrics.TURN_DECISIONS.labels("end" if ended else "wait").inc()


@functools.cache
def turn_model_of(setting: str) -> TurnModel | None:
    """The process's end-of-turn model for `server.turn_model` (loaded by the first call:
    a mount at start-up)."""
    path = smart_turn_path(setting)
    if path is None:
        if setting != "none":
            log.warning("server.turn_model %s: the pipecat-ai wheel's Smart Turn v3 is not installed; "
                        "semantic_vad ends turns on its eagerness's silence", setting)
        return None
    return shared_smart_turn(path)


class ExpiresAfter(WireModel):
    anchor: Literal["created_at"] = "created_at"
    seconds: int = Field(default=600, ge=10, le=7200)


class ClientSecretRequest(WireModel):
    expires_after: ExpiresAfter = Field(default_factory=ExpiresAfter)
    session: dict[str, Any] | None = None


def session_model(pipeline: PipelineSpec, raw: Mapping[str, Any]) -> str | None:
    """A client secret's `session.model` (one this pipeline serves), if given."""
    model = raw.get("model")
    if model is None:
        return None
    if model not in pipeline.models:
        raise ClientError(f"The model {model!r} does not exist; available: {', '.join(pipeline.models)}.", code="model_not_found", param="session.model")
    return str(model)


def start_config(pipeline: PipelineSpec, model: str | None, secret: ClientSecret | None) -> Config:
    """What a call starts with: the client secret's session configuration, if it was
    authorised with one (its model unless the URL names one)."""
    cfg = Config(model=model or (secret.model if secret is not None else None) or pipeline.models[0])
    if secret is not None and secret.session:
        cfg = apply_session_update(cfg, secret.session, pipeline.voices)
    return cfg


def mount(m: Mount) -> None:
    sessions, pipeline, vad = m.sessions, m.pipeline, vad_of(m)

    def mint(request: web.Request, session: dict[str, Any], seconds: int) -> tuple[Config, str, int]:
        """A client secret for one call starting with `session` (validated now, not at
        the call): the configuration, the secret's value and when it expires."""
        model = session_model(pipeline, session)
        cfg = apply_session_update(Config(model=model or pipeline.models[0]), session, pipeline.voices)
        value, expires_at = request.app[CLIENT_SECRETS].issue(principal_of(request), seconds, session, model)
        return cfg, value, expires_at

    async def client_secrets(request: web.Request) -> web.StreamResponse:
        """OpenAI's first step of the browser flow: a short-lived key for one call."""
        body = validate_body(ClientSecretRequest, await read_json(request))
        session = dict(body.session or {})
        if session.get("type", "realtime") != "realtime":
            raise ClientError("Only realtime sessions are served ('session.type': 'realtime').", param="session.type")
        cfg, value, expires_at = mint(request, session, body.expires_after.seconds)
        return json_response({"value": value, "expires_at": expires_at, "session": cfg.wire(True, new_id("sess"))})

    async def beta_sessions(request: web.Request) -> web.StreamResponse:
        """The beta clients' ephemeral key (`client.beta.realtime.sessions.create`):
        the body is the session itself (beta shape), the answer the session object
        with its `client_secret {value, expires_at}`."""
        raw = await read_json(request)
        if not isinstance(raw, dict):
            raise ClientError("The request body must be a JSON object (the session).")
        session = dict(raw)
        secret_cfg = session.pop("client_secret", None)
        if secret_cfg is not None and not isinstance(secret_cfg, dict):
            raise ClientError("'client_secret' must be an object ({expires_after: {anchor, seconds}}).", param="client_secret")
        expires = validate_body(ClientSecretRequest, {"expires_after": (secret_cfg or {}).get("expires_after") or {}}).expires_after
        session.pop("type", None)
        cfg, value, expires_at = mint(request, session, expires.seconds)
        return json_response({**cfg.wire(False, new_id("sess")), "client_secret": {"value": value, "expires_at": expires_at}})

    async def realtime(request: web.Request) -> web.StreamResponse:
        call_id = request.query.get("call_id")
        if call_id is not None:  # a phone call's sideband control socket (protocols.calls)
            calls = calls_of(sessions)
            try:
                if client_secret_of(request) is not None:  # a browser's one-call key does not control phone calls
                    raise ClientError("A call's sideband needs an API key, not a client secret.", code="invalid_api_key", http_status=401)
                if calls is None:
                    raise NotFound(f"No call '{call_id}'.", code="call_not_found")
                call = calls.get(request, call_id)
            except ClientError as exc:
                return await reject(request, exc)
            return await call.attach(request)
        ga = "realtime=v1" not in (request.headers.get("openai-beta") or "")
        try:
            cfg = start_config(pipeline, request.query.get("model"), client_secret_of(request))
            session = await sessions.open("realtime", pipeline.name, principal=principal_of(request).name)
        except (SessionError, ClientError) as exc:
            return await reject(request, exc)
        if request.query.get("intent") == "transcription":  # beta's transcription sessions
            cfg = replace(cfg, transcription_only=True, transcription=cfg.transcription or DEFAULT_TRANSCRIPTION)
        conv = Conversation(session, sessions, pipeline, ga=ga, model=cfg.model, vad=vad)
        conv.cfg = cfg
        try:
            sock = await accept(request)
        except BaseException:
            await sessions.end(session, "client_disconnected")
            raise
        created = "transcription_session.created" if conv.cfg.transcription_only and not ga else "session.created"
        conv.emit(created, session=conv.cfg.wire(ga, session.id))

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
    m.route("POST", "/v1/realtime/client_secrets", client_secrets, "a short-lived key for one Realtime call (browsers)")
    m.route("POST", "/v1/realtime/sessions", beta_sessions, "the same for beta clients (session object + client_secret)")
