"""OpenAI-compatible HTTP APIs: /v1/audio/speech and /v1/models, OpenAI error shape.

Thin: validate the wire request, submit it, turn output payloads into wire bytes.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Literal, Mapping, TypeVar

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omni_rt import metrics
from omni_rt.payloads import Payload, PayloadKind
from omni_rt.request import RequestAborted, RequestStream
from omni_rt.specs import PipelineSpec
from omni_rt.stage import StageError
from sessions import (
    IllegalTransition,
    InvalidResumeToken,
    Session,
    SessionElsewhere,
    SessionError,
    SessionGone,
    SessionLimit,
    SessionManager,
    SessionNotFound,
    StaleFence,
    StoreUnavailable,
    UnknownPipeline,
)
from protocols.auth import principal_of
from protocols.audio_formats import (
    MAX_SPEED,
    MIN_SPEED,
    AudioFormatError,
    StreamingEncoder,
    TempoFilter,
    available_formats,
    content_type,
)

# ---- errors -------------------------------------------------------------------------


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})


def error_body(message: str, type: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.type, err.param, err.code), status_code=err.status, headers=err.headers)


def _validation_to_api_error(errors: list[Any]) -> APIError:
    e = errors[0]
    loc = [str(p) for p in e.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    kind = e.get("type", "")
    msg = e.get("msg", "invalid value")
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    if kind in ("json_invalid", "model_attributes_type", "dict_type"):
        return APIError(400, f"The request body is not valid JSON: {msg}", param=None, code="invalid_json")
    return APIError(400, f"Invalid value for '{param}': {msg}.", param=param, code="invalid_value")


def session_api_error(exc: SessionError) -> APIError:
    """A session error as an HTTP error: 429 + retry-after for a full cap, 503 when the
    session store is lost, 404/410/403/409 for lookups, tokens and states."""
    if isinstance(exc, SessionLimit):
        return APIError(
            429, exc.message, type="requests", code="session_limit", headers={"retry-after": str(exc.retry_after_s)}
        )
    if isinstance(exc, StoreUnavailable):
        return APIError(503, exc.message, type="server_error", code=exc.code, headers={"retry-after": "5"})
    if isinstance(exc, (SessionNotFound, UnknownPipeline)):
        return APIError(404, exc.message, code=exc.code)
    if isinstance(exc, SessionGone):
        return APIError(410, exc.message, code=exc.code)
    if isinstance(exc, InvalidResumeToken):
        return APIError(403, exc.message, code=exc.code)
    if isinstance(exc, SessionElsewhere):
        return APIError(409, exc.message, code=exc.code, headers={"location": exc.url} if exc.url else None)
    if isinstance(exc, (IllegalTransition, StaleFence)):
        return APIError(409, exc.message, code=exc.code)
    return APIError(400, exc.message, code=exc.code)


async def open_oneshot(sessions: SessionManager, pipeline: str, principal: str) -> Session:
    """A one-shot HTTP call's session, or the HTTP error for why it was refused."""
    try:
        return await sessions.open("oneshot", pipeline, principal=principal)
    except SessionError as exc:
        raise session_api_error(exc) from None


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(_validation_to_api_error(list(exc.errors())))


M = TypeVar("M", bound=BaseModel)


def validate_body(model: type[M], raw: Any) -> M:
    """A JSON body as `model`, or the OpenAI-shaped 400 naming the first bad field."""
    if not isinstance(raw, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        raise _validation_to_api_error(list(err.errors())) from None


async def parse_json(request: Request) -> Any:
    body = await request.body()
    if not body:
        raise APIError(400, "The request body is empty; expected a JSON object.", code="invalid_json")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:  # ValueError: also numbers too long to convert
        raise APIError(400, f"The request body is not valid JSON: {exc}", code="invalid_json") from None


# ---- speech -------------------------------------------------------------------------


class SpeechRequest(BaseModel):
    # strict: no silent coercion of wrong JSON types (a number for `input`, a string
    # for `speed`); extra keys are rejected like OpenAI does.
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1)
    input: str
    voice: str = Field(min_length=1)
    instructions: str | None = Field(None, max_length=4096)
    response_format: str = "mp3"
    speed: float = 1.0
    stream_format: Literal["audio", "sse"] = "audio"
    seed: int | None = Field(None, ge=0, le=2**31 - 1, description="omni-rt extension: sampling seed")


class SpeechService:
    """Serves one TTS pipeline over OpenAI's speech API. Each call is a `oneshot`
    session: admitted against the caps, one turn, closed on completion or disconnect."""

    def __init__(self, sessions: SessionManager, pipeline: PipelineSpec, max_input_chars: int = 4096) -> None:
        self.sessions = sessions
        self.pipeline = pipeline
        self.max_input_chars = max_input_chars

    def validate(self, raw: Any) -> tuple[SpeechRequest, str]:
        req = validate_body(SpeechRequest, raw)
        if req.model not in self.pipeline.models:
            raise APIError(
                400,
                f"The model '{req.model}' does not exist or is not a speech model; available: {', '.join(self.pipeline.models)}.",
                param="model",
                code="model_not_found",
            )
        if not req.input.strip():
            raise APIError(400, "'input' is empty; give the text to speak.", param="input", code="invalid_value")
        if len(req.input) > self.max_input_chars:
            raise APIError(
                400,
                f"'input' is {len(req.input)} characters; the maximum is {self.max_input_chars}.",
                param="input",
                code="string_above_max_length",
            )
        voice = self.pipeline.voices.get(req.voice.lower()) if self.pipeline.voices else req.voice
        if voice is None:
            raise APIError(
                400,
                f"Unknown voice '{req.voice}'; available: {', '.join(sorted(self.pipeline.voices))}.",
                param="voice",
                code="invalid_value",
            )
        if not (MIN_SPEED <= req.speed <= MAX_SPEED):
            raise APIError(
                400, f"'speed' must be between {MIN_SPEED} and {MAX_SPEED}, got {req.speed}.", param="speed", code="invalid_value"
            )
        fmt = req.response_format.strip().lower()
        try:
            content_type(fmt)
        except AudioFormatError as exc:
            raise APIError(400, str(exc), param="response_format", code="invalid_value") from None
        if fmt not in available_formats():
            raise APIError(
                400,
                f"response_format '{fmt}' is not available on this server; available: {', '.join(available_formats())}.",
                param="response_format",
                code="unsupported_value",
            )
        return req.model_copy(update={"response_format": fmt}), voice

    async def speak(self, raw: Any, principal: str) -> Response:
        req, voice = self.validate(raw)
        t0 = time.monotonic()
        session = await open_oneshot(self.sessions, self.pipeline.name, principal)
        try:
            stream = session.submit({"voice": voice, "seed": req.seed})
            session.send_input(stream, Payload(PayloadKind.TEXT, session.fence, text=req.input))
            stream.end_input()
            outputs = stream.payloads()
            # Wait for the first chunk before answering, so a request that fails
            # before producing audio gets a real error status instead of a cut stream.
            try:
                first = await outputs.__anext__()
            except StopAsyncIteration:
                first = None
        except StageError as exc:
            await self.sessions.end(session, "failed")
            raise APIError(500, f"speech generation failed: {exc}", type="server_error", code="generation_failed") from None
        except RequestAborted as exc:
            await self.sessions.end(session, "aborted")
            raise APIError(
                503, f"The session ended before any audio ({session.close_reason or exc.reason}).", type="server_error", code="session_closed"
            ) from None
        except BaseException:
            await asyncio.shield(self.sessions.end(session, "client_disconnected"))
            raise
        encoder = StreamingEncoder(req.response_format)
        tempo = TempoFilter(req.speed)
        body = self._body(session, stream, outputs, first, encoder, tempo, req, t0)
        media = "text/event-stream" if req.stream_format == "sse" else encoder.content_type
        return _ClosingStreamingResponse(
            body,
            lambda: self.sessions.end(session, "client_disconnected"),
            media_type=media,
            headers={"x-request-id": stream.request_id, "x-session-id": session.id},
        )

    async def _body(
        self,
        session: Session,
        stream: RequestStream,
        outputs: AsyncIterator[tuple[str, Payload, bool]],
        first: tuple[str, Payload, bool] | None,
        encoder: StreamingEncoder,
        tempo: TempoFilter,
        req: SpeechRequest,
        t0: float,
    ) -> AsyncIterator[bytes]:
        sse = req.stream_format == "sse"
        # PyAV codecs cost a few ms per chunk; keep them off the event loop.
        offload = req.response_format not in ("pcm", "wav")
        samples = 0
        sent_first = False
        outcome = "client_disconnected"  # until the last byte is handed over

        async def encode(pcm: Any) -> bytes:
            if offload:
                return await asyncio.to_thread(encoder.encode, pcm)
            return encoder.encode(pcm)

        def frame(data: bytes) -> bytes:
            if not sse:
                return data
            return _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})

        try:
            pending = [first] if first is not None else []
            while True:
                if pending:
                    item = pending.pop()
                else:
                    try:
                        item = await outputs.__anext__()
                    except StopAsyncIteration:
                        break
                session.touch()
                pcm = item[1].arrays["pcm"]
                samples += len(pcm)
                data = await encode(tempo.process(pcm))
                if data:
                    if not sent_first:
                        metrics.TTFP_SECONDS.labels(api="speech").observe(time.monotonic() - t0)
                        sent_first = True
                    yield frame(data)
            tail = await encode(tempo.flush())
            tail += encoder.finish()
            if tail:
                yield frame(tail)
            metrics.AUDIO_SECONDS.labels(api="speech").inc(samples / 24000.0)
            metrics.E2E_SECONDS.labels(api="speech").observe(time.monotonic() - t0)
            if sse:
                usage = dict(stream.done.usage or {}) if stream.done is not None else {}
                usage.setdefault("input_tokens", 0)
                usage.setdefault("output_tokens", 0)
                usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
                yield _sse({"type": "speech.audio.done", "usage": usage})
            outcome = "completed"
        except (StageError, RequestAborted) as exc:
            # Headers are out; an SSE client hears an error event, a raw-audio client
            # sees the stream end early (the chunked body is never terminated cleanly).
            outcome = "failed" if isinstance(exc, StageError) else "aborted"
            if not sse:
                raise
            if isinstance(exc, StageError):
                yield _sse({"type": "error", "error": error_body(str(exc), "server_error", None, "generation_failed")["error"]})
            else:
                msg = f"The session ended before the audio was complete ({session.close_reason or exc.reason})."
                yield _sse({"type": "error", "error": error_body(msg, "server_error", None, "session_closed")["error"]})
        finally:
            encoder.close()
            # Done, failed or disconnected: the one-shot session ends, which aborts
            # whatever still runs, frees connector keys and returns the slot.
            await asyncio.shield(self.sessions.end(session, outcome))


class _ClosingStreamingResponse(StreamingResponse):
    """Ends the session even if the client vanished before the body started.

    (An async generator that never started never runs its `finally`.)
    """

    def __init__(self, content: AsyncIterator[bytes], close: Callable[[], Awaitable[None]], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._close = close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await asyncio.shield(self._close())


def _sse(obj: Mapping[str, Any]) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def build_router(speech: SpeechService | None, model_ids: list[tuple[str, str]]) -> APIRouter:
    router = APIRouter()
    created = int(time.time())

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": mid, "object": "model", "created": created, "owned_by": f"omni-rt:{p}"} for mid, p in model_ids],
        }

    @router.get("/v1/models/{model_id}")
    async def get_model(model_id: str) -> dict[str, Any]:
        for mid, p in model_ids:
            if mid == model_id:
                return {"id": mid, "object": "model", "created": created, "owned_by": f"omni-rt:{p}"}
        raise APIError(404, f"The model '{model_id}' does not exist.", param="model", code="model_not_found")

    @router.post("/v1/audio/speech")
    async def create_speech(request: Request) -> Response:
        if speech is None:
            raise APIError(404, "No speech pipeline is enabled on this server.", code="not_found")
        return await speech.speak(await parse_json(request), principal_of(request).name)

    return router
