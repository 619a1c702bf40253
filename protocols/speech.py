"""`POST /v1/audio/speech` (OpenAI's speech API) on a TTS pipeline.

Thin: validate the wire request, submit it as a one-shot session, turn the PCM the
pipeline streams into the requested format as it arrives.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from media.audio_formats import AudioFormatError, StreamingEncoder, available_formats, content_type
from media.audio_tempo import MAX_SPEED, MIN_SPEED, TempoFilter
from omni_rt import metrics
from omni_rt.errors import ClientError, OmniError, RequestAborted
from omni_rt.payloads import Payload, PayloadKind
from omni_rt.request import RequestStream
from omni_rt.specs import PipelineSpec
from protocols.auth import principal_of
from protocols.errors import error_body
from protocols.http import Streamed, read_json, send_streamed, sse, validate_body
from protocols.registry import Mount
from sessions import Session, SessionManager


class SpeechRequest(BaseModel):
    # strict: no silent coercion of wrong JSON types (a number for `input`, a string
    # for `speed`); extra keys are rejected like OpenAI does.
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1)
    input: str
    voice: str = Field(min_length=1)
    instructions: str | None = Field(default=None, max_length=4096)
    response_format: str = "mp3"
    speed: float = 1.0
    stream_format: Literal["audio", "sse"] = "audio"
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1, description="omni-rt extension: sampling seed")



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
            raise ClientError(
                f"The model '{req.model}' does not exist or is not a speech model; available: {', '.join(self.pipeline.models)}.",
                param="model",
                code="model_not_found",
            )
        if not req.input.strip():
            raise ClientError("'input' is empty; give the text to speak.", param="input")
        if len(req.input) > self.max_input_chars:
            raise ClientError(
                f"'input' is {len(req.input)} characters; the maximum is {self.max_input_chars}.",
                param="input",
                code="string_above_max_length",
            )
        voice = self.pipeline.voices.get(req.voice.lower()) if self.pipeline.voices else req.voice
        if voice is None:
            raise ClientError(f"Unknown voice '{req.voice}'; available: {', '.join(sorted(self.pipeline.voices))}.", param="voice")
        if not (MIN_SPEED <= req.speed <= MAX_SPEED):
            raise ClientError(f"'speed' must be between {MIN_SPEED} and {MAX_SPEED}, got {req.speed}.", param="speed")
        fmt = req.response_format.strip().lower()
        try:
            content_type(fmt)
        except AudioFormatError as exc:
            raise ClientError(str(exc), param="response_format") from None
        if fmt not in available_formats():
            raise ClientError(
                f"response_format '{fmt}' is not available on this server; available: {', '.join(available_formats())}.",
                param="response_format",
                code="unsupported_value",
            )
        return req.model_copy(update={"response_format": fmt}), voice

    async def speak(self, raw: Any, principal: str) -> Streamed:
        req, voice = self.validate(raw)
        t0 = time.monotonic()
        session = await self.sessions.open("oneshot", self.pipeline.name, principal=principal)
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
        except RequestAborted as exc:
            await self.sessions.end(session, "aborted")
            raise OmniError(
                f"The session ended before any audio ({session.close_reason or exc.reason}).", code="session_closed", http_status=503
            ) from None
        except BaseException:
            await asyncio.shield(self.sessions.end(session, "failed"))
            raise
        encoder = StreamingEncoder(req.response_format)
        body = self._body(session, stream, outputs, first, encoder, TempoFilter(req.speed), req, t0)
        media = "text/event-stream" if req.stream_format == "sse" else encoder.content_type
        return Streamed(
            body,
            media,
            lambda: self.sessions.end(session, "client_disconnected"),
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
        is_sse = req.stream_format == "sse"
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
            if not is_sse:
                return data
            return sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})

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
            if is_sse:
                usage = dict(stream.done.usage or {}) if stream.done is not None else {}
                usage.setdefault("input_tokens", 0)
                usage.setdefault("output_tokens", 0)
                usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
                yield sse({"type": "speech.audio.done", "usage": usage})
            outcome = "completed"
        except OmniError as exc:
            # Headers are out: an SSE client hears an error event, a raw-audio client
            # sees the stream end early (the chunked body is never terminated cleanly).
            outcome = "aborted" if isinstance(exc, RequestAborted) else "failed"
            if not is_sse:
                raise
            if isinstance(exc, RequestAborted):
                exc = OmniError(f"The session ended before the audio was complete ({session.close_reason or exc.reason}).", code="session_closed")
            yield sse({"type": "error", "error": error_body(exc)["error"]})
        finally:
            encoder.close()
            # Done, failed or disconnected: the one-shot session ends, which aborts
            # whatever still runs, frees connector keys and returns the slot.
            await asyncio.shield(self.sessions.end(session, outcome))


def mount(m: Mount) -> None:
    speech = SpeechService(m.sessions, m.pipeline, m.server.max_input_chars)

    async def create_speech(request: web.Request) -> web.StreamResponse:
        return await send_streamed(request, await speech.speak(await read_json(request), principal_of(request).name))

    m.route("POST", "/v1/audio/speech", create_speech, "text to speech (OpenAI)")
