"""`POST /v1/chat/completions` on the voice pipeline (OpenAI's shape, text and audio).

Each call is a one-shot session (admitted against the caps; 429 `session_limit` over
them). `modalities: ["text"]` (default) runs the thinker only; `["text", "audio"]`
with `audio: {voice, format}` also runs talker and code2wav, and answers with
`message.audio {id, data, transcript, expires_at}` (or, streaming, `delta.audio`
chunks). User messages may carry `input_audio {data, format}` parts; the last one is
encoded and spliced into the prompt.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import numpy as np
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from media.audio_formats import AudioFormatError, StreamingEncoder, available_formats, decode_audio, pcm16_bytes
from media.images import ImageError, check_data_url
from omni_rt import metrics
from omni_rt.errors import ClientError, OmniError, RequestAborted
from omni_rt.payloads import AUDIO_PLACEHOLDER, FINISH_REASON, IMAGE_PLACEHOLDER, TOOL_CALL, Payload, PayloadKind
from omni_rt.specs import PipelineSpec
from protocols.auth import principal_of
from protocols.errors import error_body
from protocols.http import Streamed, json_response, prepend, read_json, send_streamed, sse, validate_body
from protocols.registry import Mount
from protocols.tools import parse_tool_choice, parse_tools
from sessions import SessionManager

# OpenAI's chat audio formats -> the encoder's names
AUDIO_FORMATS = {"wav": "wav", "mp3": "mp3", "flac": "flac", "opus": "opus", "aac": "aac", "pcm16": "pcm"}


class AudioParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    voice: str
    format: str


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # many optional OpenAI fields are accepted and ignored

    model: str = Field(min_length=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioParams | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=4096)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    n: int = Field(default=1, ge=1, le=1)
    tools: Any = None  # checked by protocols.tools (its errors name the field)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


def _tool_calls(msg: dict[str, Any], i: int) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, as the chat templates take them."""
    raw = msg.get("tool_calls")
    if not isinstance(raw, list):
        raise ClientError(f"Invalid type for 'messages[{i}].tool_calls': expected an array.", param=f"messages[{i}].tool_calls", code="invalid_type")
    out = []
    for j, c in enumerate(raw):
        p = f"messages[{i}].tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments", ""), str) or not isinstance(c.get("id"), str):
            raise ClientError(f"'{p}' must be {{id, type: 'function', function: {{name, arguments}}}}.", param=p, code="invalid_value")
        out.append({"id": c["id"], "type": "function", "function": {"name": fn["name"], "arguments": fn.get("arguments", "")}})
    return out


def _content_parts(msg: dict[str, Any], i: int, images: list[tuple[str, str]]) -> tuple[str, list[tuple[str, str]]]:
    """Message content -> (text for the prompt, its audio parts as (param, base64 data));
    its image parts are added to `images` as (param, data URL)."""
    content = msg.get("content")
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise ClientError(f"Invalid type for 'messages[{i}].content': expected a string or an array.", param=f"messages[{i}].content", code="invalid_type")
    texts: list[str] = []
    audio: list[tuple[str, str]] = []
    for j, part in enumerate(content):
        p = f"messages[{i}].content[{j}]"
        if not isinstance(part, dict):
            raise ClientError(f"Invalid type for '{p}': expected an object.", param=p, code="invalid_type")
        t = part.get("type")
        if t == "text":
            if not isinstance(part.get("text"), str):
                raise ClientError(f"Missing required parameter: '{p}.text'.", param=f"{p}.text", code="missing_required_parameter")
            texts.append(part["text"])
        elif t == "input_audio":
            ia = part.get("input_audio")
            if not isinstance(ia, dict) or not isinstance(ia.get("data"), str):
                raise ClientError(f"Missing required parameter: '{p}.input_audio.data'.", param=f"{p}.input_audio.data", code="missing_required_parameter")
            audio.append((p, ia["data"]))
            texts.append(AUDIO_PLACEHOLDER)
        elif t == "image_url":
            iu = part.get("image_url")
            if not isinstance(iu, dict) or not isinstance(iu.get("url"), str):
                raise ClientError(f"Missing required parameter: '{p}.image_url.url'.", param=f"{p}.image_url.url", code="missing_required_parameter")
            images.append((f"{p}.image_url.url", iu["url"]))
            texts.append(IMAGE_PLACEHOLDER)
        else:
            raise ClientError(f"Invalid content part type {t!r} at '{p}'; supported: text, input_audio, image_url.", param=f"{p}.type", code="invalid_value")
    return " ".join(texts), audio


def _decode_audio_parts(parts: list[tuple[str, str]]) -> np.ndarray:
    """Decode every input_audio part (each must be valid); the last one is spliced in."""
    audio = None
    for p, data in parts:
        try:
            raw = base64.b64decode(data, validate=True)
        except ValueError:
            raise ClientError(f"'{p}.input_audio.data' is not valid base64.", param=f"{p}.input_audio.data", code="invalid_value") from None
        try:
            audio = decode_audio(raw)
        except AudioFormatError as exc:
            raise ClientError(f"'{p}.input_audio': {exc.message}.", param=f"{p}.input_audio", code="invalid_value") from None
    assert audio is not None
    return audio


class Answer:
    """What the thinker said: text, function calls (index -> {id, name, arguments}),
    and why it ended (OpenAI's finish_reason)."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: dict[int, dict[str, str]] = {}
        self.reason: str | None = None

    @property
    def finish(self) -> str:
        return "tool_calls" if self.calls and self.reason != "length" else self.reason or "stop"

    def add(self, p: Payload) -> dict[str, Any] | None:
        """One thinker payload; a piece of a call is returned."""
        piece = p.meta.get(TOOL_CALL)
        if piece is not None:
            call = self.calls.setdefault(int(piece["index"]), {"id": str(piece.get("id") or ""), "name": str(piece.get("name") or ""), "arguments": ""})
            call["arguments"] += piece.get("arguments") or ""
            return dict(piece)
        if FINISH_REASON in p.meta:
            self.reason = str(p.meta[FINISH_REASON])
        self.text += p.text or ""
        return None


class ChatService:
    def __init__(self, sessions: SessionManager, pipeline: PipelineSpec) -> None:
        self.sessions = sessions
        self.pipeline = pipeline

    def validate(self, raw: Any) -> tuple[ChatRequest, list[dict[str, Any]], list[tuple[str, str]], str | None, str | None,
                                          list[tuple[str, str]]]:
        """The request, its messages, its audio parts (not decoded yet), voice, format,
        and its images ((param, data URL), not checked yet)."""
        req = validate_body(ChatRequest, raw)
        if req.model not in self.pipeline.models:
            raise ClientError(f"The model '{req.model}' does not exist; available: {', '.join(self.pipeline.models)}.", param="model", code="model_not_found")
        messages: list[dict[str, Any]] = []
        audio: list[tuple[str, str]] = []
        images: list[tuple[str, str]] = []
        calls: set[str] = set()
        for i, m in enumerate(req.messages):
            role = m.get("role")
            if role == "developer":
                role = "system"
            if role not in ("system", "user", "assistant", "tool"):
                raise ClientError(f"Invalid value for 'messages[{i}].role': {role!r}.", param=f"messages[{i}].role", code="invalid_value")
            seen_images = len(images)
            text, parts = _content_parts(m, i, images)
            if role != "user" and len(images) > seen_images:
                raise ClientError(f"'messages[{i}]': only user messages carry images.", param=f"messages[{i}].content", code="invalid_value")
            msg: dict[str, Any] = {"role": role, "content": text}
            if role == "assistant" and m.get("tool_calls") is not None:
                msg["tool_calls"] = _tool_calls(m, i)
                calls |= {c["id"] for c in msg["tool_calls"]}
            if role == "tool":
                if parts:
                    raise ClientError(f"'messages[{i}]': a tool message carries text only.", param=f"messages[{i}].content", code="invalid_value")
                call_id = m.get("tool_call_id")
                if not isinstance(call_id, str):
                    raise ClientError(f"Missing required parameter: 'messages[{i}].tool_call_id'.", param=f"messages[{i}].tool_call_id", code="missing_required_parameter")
                if call_id not in calls:
                    raise ClientError(f"'messages[{i}].tool_call_id' {call_id!r} answers no tool call of an earlier assistant message.",
                                      param=f"messages[{i}].tool_call_id", code="invalid_value")
                msg["tool_call_id"] = call_id
            audio += parts
            messages.append(msg)
        want_audio = "audio" in (req.modalities or ["text"])
        voice = fmt = None
        if want_audio:
            if req.audio is None:
                raise ClientError("'audio' is required when modalities include 'audio'.", param="audio", code="missing_required_parameter")
            voice = self.pipeline.voices.get(req.audio.voice.lower())
            if voice is None:
                raise ClientError(f"Unknown voice '{req.audio.voice}'; available: {', '.join(sorted(self.pipeline.voices))}.", param="audio.voice", code="invalid_value")
            fmt = AUDIO_FORMATS.get(req.audio.format)
            if fmt is None or fmt not in available_formats():
                raise ClientError(f"Unsupported audio.format '{req.audio.format}'; use one of {', '.join(AUDIO_FORMATS)}.", param="audio.format", code="invalid_value")
            if req.stream and fmt != "pcm":
                raise ClientError("Streaming audio output supports audio.format 'pcm16' only.", param="audio.format", code="invalid_value")
        return req, messages, audio, voice, fmt, images

    async def complete(self, raw: Any, principal: str) -> tuple[dict[str, Any], dict[str, str]] | Streamed:
        """The answer: a chat.completion body (and its headers), or the SSE stream."""
        req, messages, audio_parts, voice, fmt, images = self.validate(raw)
        tools = parse_tools(req.tools, "tools", nested=True)
        choice = parse_tool_choice(req.tool_choice, tools, "tool_choice", nested=True) if tools or req.tool_choice not in (None, "none", "auto") else "auto"
        # decoding input audio can take a while: off the event loop
        audio = await asyncio.to_thread(_decode_audio_parts, audio_parts) if audio_parts else None
        t0 = time.monotonic()
        session = await self.sessions.open("oneshot", self.pipeline.name, principal=principal)
        try:
            await self.sessions.rate_limits.check(principal, "tokens")
            params: dict[str, Any] = {"messages": messages, "max_output_tokens": req.max_completion_tokens or req.max_tokens, "seed": req.seed}
            if images:
                await self._check_images(session, images)
                params["images"] = [url for _, url in images]
            if tools:
                params.update(tools=list(tools), tool_choice=choice, parallel_tool_calls=req.parallel_tool_calls is not False)
            for key in ("temperature", "top_p"):  # the thinker's own defaults otherwise
                if getattr(req, key) is not None:
                    params[key] = getattr(req, key)
            if voice is not None:
                params["voice"] = voice
            # No input audio: nothing for the audio encoder, the request enters at the thinker.
            stream = session.submit(params, outputs={"thinker", *session.speech_outputs()} if voice is not None else {"thinker"},
                                    entry=None if audio is not None else "thinker")
            if audio is not None:
                session.send_input(stream, Payload(PayloadKind.AUDIO, session.fence, arrays={"pcm": audio}, meta={"sample_rate": 24000}))
            stream.end_input()
        except BaseException:
            await self.sessions.end(session, "failed")
            raise
        cid = f"chatcmpl-{secrets.token_hex(12)}"
        created = int(time.time())
        if not req.stream:
            answer = Answer()
            try:
                pcm = []
                async for stage, p, _ in stream.payloads():
                    if stage == "thinker":
                        answer.add(p)
                    else:
                        pcm.append(p.arrays["pcm"])
                    session.touch()
            except RequestAborted as exc:
                raise OmniError(f"the request was stopped ({session.close_reason or exc.reason})", code="session_closed", http_status=503) from None
            finally:
                await self.sessions.end(session, "completed")
            usage = self._usage(stream.done.usage if stream.done else None)
            self.sessions.charge_soon(principal, "tokens", usage["total_tokens"])
            text = answer.text
            message: dict[str, Any] = {"role": "assistant", "content": text if text or not answer.calls else None, "refusal": None}
            if answer.calls:
                message["tool_calls"] = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                                         for _, c in sorted(answer.calls.items())]
            if voice is not None:
                enc = StreamingEncoder(fmt or "wav")
                data = await asyncio.to_thread(lambda: enc.encode(np.concatenate(pcm) if pcm else np.zeros(0, np.float32)) + enc.finish())
                enc.close()
                message["content"] = None
                message["audio"] = {"id": f"audio_{secrets.token_hex(8)}", "data": base64.b64encode(data).decode(), "expires_at": created + 3600, "transcript": text}
            metrics.E2E_SECONDS.labels(api="chat").observe(time.monotonic() - t0)
            body = {"id": cid, "object": "chat.completion", "created": created, "model": req.model,
                    "choices": [{"index": 0, "message": message, "finish_reason": answer.finish, "logprobs": None}], "usage": usage}
            return body, {"x-session-id": session.id}
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        # The first output comes before the response starts: a request the model refuses
        # (a prompt longer than its context) is still a plain HTTP error.
        outputs = stream.payloads().__aiter__()
        try:
            first = await outputs.__anext__()
        except StopAsyncIteration:
            first = None
        except BaseException:
            await self.sessions.end(session, "failed")
            raise
        return Streamed(
            self._sse(session, stream, prepend(first, outputs), cid, created, req.model, voice is not None, include_usage, t0),
            "text/event-stream",
            lambda: self.sessions.end(session, "client_disconnected"),
            headers={"x-session-id": session.id},
        )

    async def _check_images(self, session: Any, images: list[tuple[str, str]]) -> None:
        """The request's images fit this server's thinker (it sees images, at most its
        limit a prompt) and each is a usable image (decoded off the event loop)."""
        limit, profile = session.image_limit()
        if limit <= 0:
            served = f"'{self.pipeline.name}' pipeline" + (f" ('{profile}' profile)" if profile else "")
            raise ClientError(f"Image input is not supported by this server's {served}: its thinker takes text and audio only.",
                              param=images[0][0], code="invalid_value")
        if len(images) > limit:
            raise ClientError(f"The request has {len(images)} images; this server's thinker takes at most {limit} a request.",
                              param=images[limit][0], code="invalid_value")
        for param, url in images:
            try:
                await asyncio.to_thread(check_data_url, url)
            except ImageError as exc:
                raise ClientError(f"'{param}' {exc}.", param=param, code="invalid_value") from None

    @staticmethod
    def _usage(u: Any) -> dict[str, Any]:
        u = dict(u or {})
        p, c = int(u.get("input_tokens", 0)), int(u.get("output_tokens", 0))
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"audio_tokens": int(u.get("input_audio_tokens", 0)), "cached_tokens": 0}}

    async def _sse(
        self, session: Any, stream: Any, outputs: AsyncIterator[Any], cid: str, created: int, model: str, audio: bool, include_usage: bool, t0: float
    ) -> AsyncIterator[bytes]:
        def chunk(delta: dict[str, Any], finish: str | None = None, usage: Any = None) -> bytes:
            body: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
            if usage is not None:
                body["choices"] = []
                body["usage"] = usage
            return sse(body)

        def text_chunk(delta: dict[str, Any]) -> Callable[[str], bytes]:
            # One chunk per token: the JSON around the text is made once, and only
            # the text is encoded per chunk (the bytes equal chunk(delta with text)).
            pre, post = chunk(delta).split(b'"\\u0000"')
            return lambda text: pre + json.dumps(text).encode() + post

        audio_id = f"audio_{secrets.token_hex(8)}"
        text_delta = text_chunk({"audio": {"id": audio_id, "transcript": "\0"}} if audio else {"content": "\0"})
        outcome = "client_disconnected"
        first_text = first_audio = True
        try:
            yield chunk({"role": "assistant", "content": "" if not audio else None})
            answer = Answer()
            async for stage, p, _ in outputs:
                session.touch()
                if stage == "thinker":
                    if first_text:
                        metrics.TTFT_SECONDS.labels(api="chat").observe(time.monotonic() - t0)
                        first_text = False
                    piece = answer.add(p)
                    if piece is not None:  # a piece of a call, as OpenAI streams delta.tool_calls
                        call: dict[str, Any] = {"index": piece["index"], "function": {"arguments": piece.get("arguments") or ""}}
                        if "id" in piece:
                            call.update(id=piece["id"], type="function")
                            call["function"]["name"] = piece.get("name") or ""
                        yield chunk({"tool_calls": [call]})
                    elif p.text:
                        yield text_delta(p.text)
                else:
                    if first_audio:
                        metrics.TTFP_SECONDS.labels(api="chat").observe(time.monotonic() - t0)
                        first_audio = False
                    data = pcm16_bytes(p.arrays["pcm"])
                    yield chunk({"audio": {"id": audio_id, "data": base64.b64encode(data).decode()}})
            yield chunk({}, finish=answer.finish)
            usage = self._usage(stream.done.usage if stream.done else None)
            self.sessions.charge_soon(session.principal, "tokens", usage["total_tokens"])
            if include_usage:
                yield chunk({}, usage=usage)
            yield sse("[DONE]")
            outcome = "completed"
            metrics.E2E_SECONDS.labels(api="chat").observe(time.monotonic() - t0)
        except OmniError as exc:
            outcome = "failed"
            if isinstance(exc, ClientError):
                err = error_body(exc)["error"]
            else:
                err = {"message": f"generation stopped: {exc.public_message()}", "type": "server_error", "param": None, "code": "generation_failed"}
            yield sse({"error": err})
        finally:
            await asyncio.shield(self.sessions.end(session, outcome))


def mount(m: Mount) -> None:
    chat = ChatService(m.sessions, m.pipeline)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        reply = await chat.complete(await read_json(request, upload=True), principal_of(request).name)
        if isinstance(reply, Streamed):
            return await send_streamed(request, reply)
        body, headers = reply
        return json_response(body, headers=headers)

    m.route("POST", "/v1/chat/completions", chat_completions, "chat, text and audio (OpenAI)")
