"""Asyncio client for `POST /v1/audio/speech` that measures what a listener feels.

`speak()` streams one response and records:

* ``ttfp_s``  time to first audio payload, from just before the request is sent to the
  first non-empty audio bytes (``pcm``/other: first body bytes; ``wav``: first bytes
  after the RIFF header; ``sse``: first ``speech.audio.delta`` whose audio is non-empty);
* ``e2el_s``  end-to-end latency, from the same start to the end of the body;
* ``audio_s`` audio seconds received (``pcm``/``sse``: bytes / 2 / 24000; ``wav``:
  data bytes / block size / rate read from the header, which is (bytes - 44) / 2 /
  24000 for the standard header); ``None`` for compressed formats (mp3, opus, ...);
* the raw audio bytes (unless ``keep_audio=False``), the HTTP status and, on failure,
  a `SpeechError` carrying the status and the server's error message.

Transport failures (connection refused, timeouts, truncated chunked bodies) propagate
as the usual ``httpx`` exceptions.

This module talks to the server over HTTP only and imports nothing from it.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

PCM_SAMPLE_RATE = 24000
PCM_SAMPLE_WIDTH = 2  # s16le
WAV_STD_HEADER = 44
_WAV_HEADER_SCAN_LIMIT = 1 << 20  # give up looking for the data chunk after 1 MiB

__all__ = ["SpeechError", "SpeechResult", "speak", "speech_url"]


class SpeechError(Exception):
    """The server refused or failed a speech request.

    ``status`` is the HTTP status (200 for an error reported inside an SSE stream or a
    stream that ended without ``speech.audio.done``); ``message``/``type``/``param``/
    ``code`` come from the server's ``{"error": {...}}`` body when it sent one;
    ``body`` is the raw body text (truncated); ``elapsed_s`` is how long the request
    took until the error was known.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        body: str | None = None,
        elapsed_s: float | None = None,
    ) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.body = body
        self.elapsed_s = elapsed_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.code,
        }


@dataclass
class SpeechResult:
    status: int
    response_format: str
    stream_format: str
    ttfp_s: float | None  # None when no audio arrived at all
    e2el_s: float
    audio_bytes: int  # audio payload bytes (wav header excluded, sse decoded)
    audio_s: float | None  # None for formats whose duration we cannot compute
    audio: bytes | None  # raw audio payload, None if keep_audio=False
    chunks: int  # non-empty audio payloads received (body chunks or sse deltas)
    max_gap_s: float | None  # longest wait between two audio payloads
    sample_rate: int = PCM_SAMPLE_RATE
    usage: dict[str, Any] | None = None  # from speech.audio.done (sse)
    request_id: str | None = None  # x-request-id response header when present
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rtf(self) -> float | None:
        """Real-time factor: end-to-end latency / audio seconds (lower is better)."""
        if not self.audio_s:
            return None
        return self.e2el_s / self.audio_s


def speech_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        return base + "/audio/speech"
    return base + "/v1/audio/speech"


def _parse_error(status: int, raw: bytes, elapsed_s: float) -> SpeechError:
    text = raw.decode("utf-8", errors="replace")
    message = text.strip()[:500] or f"HTTP {status} with empty body"
    fields: dict[str, Any] = {}
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict):
            message = str(err.get("message") or message)
            fields = {k: err.get(k) for k in ("type", "param", "code")}
        elif isinstance(err, str):
            message = err
        elif "detail" in obj:  # servers that answer errors as {"detail": ...}
            message = str(obj["detail"])
    return SpeechError(
        status,
        message,
        type=_opt_str(fields.get("type")),
        param=_opt_str(fields.get("param")),
        code=_opt_str(fields.get("code")),
        body=text[:2000],
        elapsed_s=elapsed_s,
    )


def _opt_str(v: Any) -> str | None:
    return None if v is None else str(v)


class _WavHeader:
    """Finds where PCM data starts in a streamed RIFF/WAVE body and reads its format."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.data_offset: int | None = None
        self.channels = 1
        self.sample_rate = PCM_SAMPLE_RATE
        self.bits = 16

    def feed(self, chunk: bytes) -> bytes:
        """Feed body bytes; returns the audio data bytes contained in them (if any)."""
        if self.data_offset is not None:
            return chunk
        self.buf += chunk
        off = self._locate()
        if off is None:
            return b""
        self.data_offset = off
        rest = bytes(self.buf[off:])
        self.buf = bytearray()
        return rest

    def _locate(self) -> int | None:
        b = self.buf
        if len(b) < 12:
            return None
        if b[:4] != b"RIFF" or b[8:12] != b"WAVE":
            # Not a RIFF header we understand: assume the standard 44-byte header.
            return WAV_STD_HEADER if len(b) >= WAV_STD_HEADER else None
        o = 12
        while o + 8 <= len(b):
            cid = bytes(b[o : o + 4])
            (size,) = struct.unpack_from("<I", b, o + 4)
            if cid == b"data":
                return o + 8
            if cid == b"fmt " and o + 8 + 16 <= len(b):
                _fmt, ch, rate, _brate, _align, bits = struct.unpack_from("<HHIIHH", b, o + 8)
                if ch and rate and bits:
                    self.channels, self.sample_rate, self.bits = ch, rate, bits
            elif cid == b"fmt ":
                return None  # need the rest of the fmt chunk
            o += 8 + size + (size & 1)
        if len(b) > _WAV_HEADER_SCAN_LIMIT:
            return WAV_STD_HEADER
        return None

    @property
    def bytes_per_second(self) -> float:
        return self.channels * (self.bits / 8) * self.sample_rate


async def speak(
    client: httpx.AsyncClient,
    base_url: str,
    text: str,
    *,
    voice: str = "tara",
    response_format: str = "pcm",
    stream_format: str = "audio",
    speed: float = 1.0,
    seed: int | None = None,
    model: str = "tts",
    keep_audio: bool = True,
    sample_rate: int = PCM_SAMPLE_RATE,
    extra_body: dict[str, Any] | None = None,
) -> SpeechResult:
    """Request speech for `text` and stream the answer; see the module docstring.

    Raises `SpeechError` on a non-200 answer (or an SSE error event / a stream without
    ``speech.audio.done``); transport errors propagate as ``httpx`` exceptions.
    """
    body: dict[str, Any] = {
        "model": model,
        "input": text,
        "voice": voice,
        "response_format": response_format,
        "speed": speed,
        "stream_format": stream_format,
    }
    if seed is not None:
        body["seed"] = seed
    if extra_body:
        body.update(extra_body)

    url = speech_url(base_url)
    audio = bytearray() if keep_audio else None
    n_audio = 0
    chunks = 0
    ttfp: float | None = None
    last_t: float | None = None
    max_gap: float | None = None
    usage: dict[str, Any] | None = None

    def on_audio(data: bytes, now: float) -> None:
        nonlocal n_audio, chunks, ttfp, last_t, max_gap
        if not data:
            return
        if ttfp is None:
            ttfp = now - t0
        if last_t is not None:
            gap = now - last_t
            if max_gap is None or gap > max_gap:
                max_gap = gap
        last_t = now
        chunks += 1
        n_audio += len(data)
        if audio is not None:
            audio.extend(data)

    t0 = time.perf_counter()
    async with client.stream("POST", url, json=body) as resp:
        status = resp.status_code
        if status != 200:
            raw = await resp.aread()
            raise _parse_error(status, raw, time.perf_counter() - t0)
        request_id = resp.headers.get("x-request-id")
        ctype = resp.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype == "application/json":
            # A JSON body on a 200 is never audio: do not count it as such.
            raw = await resp.aread()
            err = _parse_error(status, raw, time.perf_counter() - t0)
            err.code = err.code or "unexpected_json"
            raise err

        if stream_format == "sse":
            done = False
            data_lines: list[str] = []

            def dispatch(now: float) -> None:
                nonlocal done, usage
                if not data_lines:
                    return
                data = "\n".join(data_lines)
                data_lines.clear()
                if data.strip() == "[DONE]":
                    return
                try:
                    ev = json.loads(data)
                except ValueError as exc:
                    raise SpeechError(200, f"undecodable SSE event: {data[:200]!r}", code="bad_event",
                                      elapsed_s=now - t0) from exc
                if not isinstance(ev, dict):
                    return
                etype = ev.get("type")
                if etype == "speech.audio.delta":
                    b64 = ev.get("audio") or ""
                    try:
                        pcm = base64.b64decode(b64, validate=True)
                    except (binascii.Error, ValueError) as exc:
                        raise SpeechError(200, "speech.audio.delta with invalid base64 audio",
                                          code="bad_event", elapsed_s=now - t0) from exc
                    on_audio(pcm, now)
                elif etype == "speech.audio.done":
                    done = True
                    u = ev.get("usage")
                    usage = u if isinstance(u, dict) else None
                elif etype == "error" or "error" in ev:
                    err = ev.get("error")
                    err = err if isinstance(err, dict) else {"message": str(err or ev)}
                    raise SpeechError(
                        200,
                        str(err.get("message") or "error event"),
                        type=_opt_str(err.get("type")),
                        param=_opt_str(err.get("param")),
                        code=_opt_str(err.get("code")),
                        body=data[:2000],
                        elapsed_s=now - t0,
                    )

            async for line in resp.aiter_lines():
                now = time.perf_counter()
                if line == "":
                    dispatch(now)
                elif line.startswith("data:"):
                    v = line[5:]
                    data_lines.append(v[1:] if v.startswith(" ") else v)
                # "event:", "id:", "retry:" and ":" comments carry nothing we use.
            dispatch(time.perf_counter())
            if not done:
                raise SpeechError(200, "SSE stream ended without speech.audio.done",
                                  code="incomplete_stream", elapsed_s=time.perf_counter() - t0)
        elif response_format == "wav":
            hdr = _WavHeader()
            async for chunk in resp.aiter_bytes():
                now = time.perf_counter()
                on_audio(hdr.feed(chunk), now)
            if hdr.data_offset is None:
                # Body shorter than a header: nothing was audio.
                pass
            else:
                sample_rate = hdr.sample_rate
        else:
            async for chunk in resp.aiter_bytes():
                on_audio(chunk, time.perf_counter())
        e2el = time.perf_counter() - t0

    if stream_format == "sse" or response_format == "pcm":
        audio_s: float | None = n_audio / PCM_SAMPLE_WIDTH / sample_rate
    elif response_format == "wav":
        bps = hdr.bytes_per_second if hdr.data_offset is not None else PCM_SAMPLE_WIDTH * sample_rate
        audio_s = n_audio / bps
    else:
        audio_s = None
    return SpeechResult(
        status=status,
        response_format=response_format,
        stream_format=stream_format,
        ttfp_s=ttfp,
        e2el_s=e2el,
        audio_bytes=n_audio,
        audio_s=audio_s,
        audio=bytes(audio) if audio is not None else None,
        chunks=chunks,
        max_gap_s=max_gap,
        sample_rate=sample_rate,
        usage=usage,
        request_id=request_id,
    )
