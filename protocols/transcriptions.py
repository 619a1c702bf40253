"""`POST /v1/audio/transcriptions` and `/v1/audio/translations` (OpenAI's speech-to-text
API) on an ASR pipeline.

Multipart fields as OpenAI's: `file` (wav, mp3, flac, ogg/opus, webm, m4a…: decoded with
PyAV, at most 25 MB), `model`, `language` (ISO-639-1, one the model knows), `prompt`,
`response_format` (`json`, `text`, `verbose_json`, `srt`, `vtt`), `temperature` (0–1),
`stream` (SSE: `transcript.text.delta {delta}` … `transcript.text.done {text, usage}`).
Each call is a `oneshot` session. The stage answers TEXT payloads whose `meta` says the
segment they belong to (`segment`, `start`, `end`: seconds into the audio).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from aiohttp import web

from media.audio_formats import AudioFormatError, decode_audio
from omni_rt import metrics
from omni_rt.errors import ClientError, OmniError, RequestAborted
from omni_rt.payloads import Payload, PayloadKind
from omni_rt.specs import PipelineSpec
from protocols.auth import principal_of
from protocols.errors import error_body
from protocols.http import Streamed, check_length, json_response, prepend, read_form, send_streamed, sse
from protocols.registry import Mount
from sessions import SessionManager

MAX_FILE_BYTES = 25 * 1000 * 1000  # OpenAI's limit
MAX_SECONDS = 1800.0
RATE = 16000
FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
FIELDS = frozenset({"file", "model", "language", "prompt", "response_format", "temperature", "stream", "timestamp_granularities[]",
                    "timestamp_granularities", "include[]", "include", "chunking_strategy"})


@runtime_checkable
class Transcriber(Protocol):
    """What this wire needs from the ASR stage."""

    def languages(self) -> list[str]: ...



def _stamp(t: float, sep: str) -> str:
    ms = int(round(t * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def render(fmt: str, text: str, segments: list[dict[str, Any]], task: str, language: str, duration: float, usage: dict[str, Any]) -> web.Response:
    """The finished transcript in `response_format`."""
    if fmt == "json":
        return json_response({"text": text, "usage": usage})
    if fmt == "text":
        return web.Response(text=text + "\n", content_type="text/plain")
    if fmt == "verbose_json":
        return json_response({"task": task, "language": language, "duration": round(duration, 3), "text": text, "segments": segments, "usage": usage})
    cues = [s for s in segments if s["text"].strip()]
    if fmt == "srt":
        body = "".join(f"{i}\n{_stamp(s['start'], ',')} --> {_stamp(s['end'], ',')}\n{s['text'].strip()}\n\n" for i, s in enumerate(cues, 1))
        return web.Response(text=body, content_type="application/x-subrip")
    body = "WEBVTT\n\n" + "".join(f"{_stamp(s['start'], '.')} --> {_stamp(s['end'], '.')}\n{s['text'].strip()}\n\n" for s in cues)
    return web.Response(text=body, content_type="text/vtt")


class TranscriptionService:
    def __init__(self, sessions: SessionManager, pipeline: PipelineSpec, languages: list[str]) -> None:
        self.sessions = sessions
        self.pipeline = pipeline
        self.languages = languages

    async def read(self, request: web.Request) -> dict[str, Any]:
        """The multipart form, validated: file bytes and settings."""
        check_length(request, MAX_FILE_BYTES + (1 << 20))
        if request.content_type != "multipart/form-data":
            raise ClientError("Send the request as multipart/form-data with a 'file' field.", code="unsupported_media_type", http_status=415)
        form = await read_form(
            request, ClientError(f"The file is larger than {MAX_FILE_BYTES} bytes.", code="request_too_large", param="file", http_status=413)
        )
        unknown = sorted(set(form) - FIELDS)
        if unknown:
            raise ClientError(f"Unrecognized request argument supplied: {unknown[0]}", code="unknown_parameter", param=unknown[0])
        f = form.get("file")
        if f is None:
            raise ClientError("Missing required parameter: 'file'.", code="missing_required_parameter", param="file")
        data = f.file.read() if hasattr(f, "file") else str(f).encode()
        if len(data) > MAX_FILE_BYTES:
            raise ClientError(f"The file is larger than {MAX_FILE_BYTES} bytes.", code="request_too_large", param="file", http_status=413)
        if not data:
            raise ClientError("The file is empty.", param="file")

        def text(key: str) -> str | None:
            v = form.get(key)
            if v is None:
                return None
            if not isinstance(v, str):
                raise ClientError(f"'{key}' must be a plain form field.", code="invalid_type", param=key)
            return v

        model = text("model")
        if not model:
            raise ClientError("Missing required parameter: 'model'.", code="missing_required_parameter", param="model")
        if model not in self.pipeline.models:
            raise ClientError(f"The model '{model}' does not exist; available: {', '.join(self.pipeline.models)}.", code="model_not_found", param="model")
        fmt = (text("response_format") or "json").strip().lower()
        if fmt not in FORMATS:
            raise ClientError(f"response_format '{fmt}' is not supported; use one of {', '.join(FORMATS)}.", param="response_format")
        language = text("language")
        if language is not None:
            language = language.strip().lower()
            if language not in self.languages:
                raise ClientError(f"Language '{language}' is not one this model knows; known: {', '.join(self.languages)}.", param="language")
        raw_t = text("temperature")
        temperature = 0.0
        if raw_t is not None:
            try:
                temperature = float(raw_t)
            except ValueError:
                raise ClientError("'temperature' must be a number.", code="invalid_type", param="temperature") from None
            if not 0.0 <= temperature <= 1.0:
                raise ClientError("'temperature' must be between 0 and 1.", param="temperature")
        raw_s = (text("stream") or "false").strip().lower()
        if raw_s not in ("true", "false"):
            raise ClientError("'stream' must be true or false.", code="invalid_type", param="stream")
        prompt = text("prompt")
        if prompt is not None and len(prompt) > 4096:
            raise ClientError("'prompt' is longer than 4096 characters.", param="prompt")
        return {"data": data, "model": model, "format": fmt, "language": language, "temperature": temperature,
                "stream": raw_s == "true", "prompt": prompt}

    async def transcribe(self, request: web.Request, task: str) -> web.StreamResponse:
        req = await self.read(request)
        try:
            pcm = await asyncio.to_thread(decode_audio, req["data"], RATE, MAX_SECONDS)
        except AudioFormatError as exc:
            raise ClientError(f"The file could not be decoded as audio: {exc.message}.", param="file") from None
        if len(pcm) < RATE // 10:
            raise ClientError("The audio is shorter than 0.1 s.", param="file")
        duration = len(pcm) / RATE
        t0 = time.monotonic()
        session = await self.sessions.open("oneshot", self.pipeline.name, principal=principal_of(request).name)
        try:
            params = {"task": task, "language": req["language"], "prompt": req["prompt"], "temperature": req["temperature"]}
            stream = session.submit(params)
            session.send_input(stream, Payload(PayloadKind.AUDIO, session.fence, arrays={"pcm": pcm}, meta={"sample_rate": RATE}))
            stream.end_input()
            outputs = stream.payloads().__aiter__()
            try:  # the first output before answering: a refused request is still a plain HTTP error
                first = await outputs.__anext__()
            except StopAsyncIteration:
                first = None
        except RequestAborted as exc:
            await self.sessions.end(session, "aborted")
            raise OmniError(f"The session ended before the transcript ({session.close_reason or exc.reason}).", code="session_closed",
                            http_status=503) from None
        except BaseException:
            await asyncio.shield(self.sessions.end(session, "failed"))
            raise

        async def texts() -> AsyncIterator[Payload]:
            async for _, p, _ in prepend(first, outputs):
                session.touch()
                yield p

        def usage() -> dict[str, Any]:
            u = dict(stream.done.usage or {}) if stream.done is not None else {}
            return {"type": "duration", "seconds": round(duration, 3), "output_tokens": int(u.get("output_tokens", 0))}

        language = req["language"] or "en"
        if req["stream"]:
            return await send_streamed(request, Streamed(self._sse(session, texts(), usage, t0), "text/event-stream",
                                                         lambda: self.sessions.end(session, "client_disconnected"),
                                                         headers={"x-session-id": session.id}))
        outcome = "failed"
        try:
            segments: dict[int, dict[str, Any]] = {}
            async for p in texts():
                seg = int(p.meta.get("segment", 0))
                s = segments.setdefault(seg, {"id": seg, "start": float(p.meta.get("start", 0.0)), "end": float(p.meta.get("end", duration)),
                                              "text": ""})
                s["text"] += p.text or ""
            outcome = "completed"
        except RequestAborted as exc:
            raise OmniError(f"The request was stopped ({session.close_reason or exc.reason}).", code="session_closed", http_status=503) from None
        finally:
            await asyncio.shield(self.sessions.end(session, outcome))
        ordered = [segments[k] for k in sorted(segments)]
        text = "".join(s["text"] for s in ordered).strip()
        metrics.E2E_SECONDS.labels(api="transcriptions").observe(time.monotonic() - t0)
        resp = render(req["format"], text, ordered, task, language, duration, usage())
        resp.headers["x-session-id"] = session.id
        return resp

    async def _sse(self, session: Any, texts: AsyncIterator[Payload], usage: Any, t0: float) -> AsyncIterator[bytes]:
        outcome = "client_disconnected"
        text = ""
        try:
            async for p in texts:
                if p.text:
                    text += p.text
                    yield sse({"type": "transcript.text.delta", "delta": p.text})
            yield sse({"type": "transcript.text.done", "text": text.strip(), "usage": usage()})
            outcome = "completed"
            metrics.E2E_SECONDS.labels(api="transcriptions").observe(time.monotonic() - t0)
        except OmniError as exc:
            outcome = "failed"
            yield sse({"type": "error", "error": error_body(exc)["error"]})
        finally:
            await asyncio.shield(self.sessions.end(session, outcome))


def mount(m: Mount) -> None:
    service = TranscriptionService(m.sessions, m.pipeline, m.processor(Transcriber).languages())

    async def transcriptions(request: web.Request) -> web.StreamResponse:
        return await service.transcribe(request, "transcribe")

    async def translations(request: web.Request) -> web.StreamResponse:
        return await service.transcribe(request, "translate")

    m.route("POST", "/v1/audio/transcriptions", transcriptions, "speech to text (OpenAI)")
    m.route("POST", "/v1/audio/translations", translations, "speech to English text (OpenAI)")
