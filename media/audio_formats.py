"""Streaming audio encoders for the OpenAI-compatible ``/v1/audio/speech`` endpoint.

``response_format`` selects one of :data:`SUPPORTED_FORMATS`; ``speed`` is applied
with :class:`media.audio_tempo.TempoFilter` (tempo change without pitch change,
FFmpeg ``atempo``).

Typical use, per request::

    enc = StreamingEncoder(fmt, sample_rate=24000)     # may raise AudioFormatError
    tempo = TempoFilter(speed, sample_rate=24000)      # may raise ValueError
    for chunk in model_chunks:                         # float32 mono in [-1, 1]
        data = enc.encode(tempo.process(chunk))
        if data:
            send(data)
    send(enc.encode(tempo.flush()) + enc.finish())

Format notes:

* ``wav``: 44-byte RIFF/WAVE header whose RIFF and ``data`` sizes are the
  0xFFFFFFFF "unknown length" placeholders (streamed WAV, as OpenAI sends it),
  then raw s16le. Python's ``wave`` module and FFmpeg both read such a stream.
* ``pcm``: raw s16le mono at ``sample_rate`` (OpenAI: 24 kHz), no header.
* ``mp3`` (libmp3lame), ``opus`` (libopus in an Ogg container), ``flac``
  (FLAC in its native container), ``aac`` (ADTS): encoded by PyAV into a
  non-seekable in-memory sink, so bytes come out as packets are muxed, not only
  at :meth:`StreamingEncoder.finish`. Encoders buffer a little (frame sizes,
  look-ahead), so ``encode`` may return ``b""`` for very small chunks.

Objects here are not thread-safe; use one per request.
"""

from __future__ import annotations

import functools
import struct
from fractions import Fraction
from typing import Any

import numpy as np

try:  # PyAV is optional for wav/pcm.
    import av
    import av.filter

    _AV_IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the environment
    av = None
    _AV_IMPORT_ERROR = f"PyAV is not importable ({exc})"

__all__ = [
    "SUPPORTED_FORMATS",
    "AudioFormatError",
    "StreamingEncoder",
    "available_formats",
    "content_type",
]

#: Every ``response_format`` value the OpenAI API defines, in its order.
SUPPORTED_FORMATS: tuple[str, ...] = ("mp3", "opus", "aac", "flac", "wav", "pcm")

_CONTENT_TYPES = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "flac": "audio/flac",
    "aac": "audio/aac",
}

# PyAV-backed formats: (muxer, encoder candidates in preference order,
# encoder sample format fed to PyAV, bit rate or None, extra muxer options).
# Only libopus is listed for opus: FFmpeg's native opus encoder is flagged
# experimental.
_AV_SPECS: dict[str, tuple[str, tuple[str, ...], str, int | None, dict[str, str]]] = {
    "mp3": ("mp3", ("libmp3lame",), "s16p", 64_000, {}),
    # page_duration (µs): the Ogg muxer closes a page once it spans this much
    # audio (default 1 s, which would hold back a second of audio per page).
    "opus": ("ogg", ("libopus",), "flt", 32_000, {"page_duration": "40000"}),
    # No 8 KiB PADDING block: it only makes sense for a seekable file.
    "flac": ("flac", ("flac",), "s16", None, {"metadata_header_padding": "0"}),
    "aac": ("adts", ("aac",), "fltp", 64_000, {}),
}

# Rate to use when the encoder does not accept the input rate (PyAV's
# resampler then converts); Opus is natively 48 kHz.
_FALLBACK_RATE = {"opus": 48_000}


class AudioFormatError(ValueError):
    """Bad or unavailable ``response_format`` (map to HTTP 400, param ``response_format``)."""

    field = "response_format"

    def __init__(self, message: str, fmt: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.fmt = fmt


def _normalize(fmt: Any) -> str:
    if not isinstance(fmt, str):
        raise AudioFormatError(
            f"response_format must be a string, one of: {', '.join(SUPPORTED_FORMATS)}",
            fmt,
        )
    name = fmt.strip().lower()
    if name not in _CONTENT_TYPES:
        raise AudioFormatError(
            f"response_format {fmt!r} is not supported; "
            f"expected one of: {', '.join(SUPPORTED_FORMATS)}",
            fmt,
        )
    return name


def content_type(fmt: str) -> str:
    """HTTP ``Content-Type`` for a ``response_format`` (raises AudioFormatError if unknown)."""
    return _CONTENT_TYPES[_normalize(fmt)]


@functools.cache
def _probe(fmt: str) -> tuple[str | None, str | None]:
    """(encoder name, None) if ``fmt`` can be produced here, else (None, reason)."""
    if fmt in ("wav", "pcm"):
        return fmt, None
    if av is None:
        return None, _AV_IMPORT_ERROR
    muxer, codecs, _, _, _ = _AV_SPECS[fmt]
    if muxer not in av.formats_available:
        return None, f"FFmpeg in PyAV {av.__version__} has no {muxer!r} muxer"
    for name in codecs:
        try:
            av.codec.Codec(name, "w")
        except Exception:
            continue
        return name, None
    return None, (
        f"FFmpeg in PyAV {av.__version__} has no {' / '.join(codecs)} encoder"
    )


def available_formats() -> list[str]:
    """The ``response_format`` values this server can produce (detected once)."""
    return [f for f in SUPPORTED_FORMATS if _probe(f)[0] is not None]


def _as_mono_float(pcm: Any) -> np.ndarray:
    x = np.asarray(pcm)
    if x.dtype.kind != "f":
        raise TypeError(f"expected float PCM samples in [-1, 1], got dtype {x.dtype}")
    if x.ndim != 1:
        if x.ndim == 2 and 1 in x.shape:
            x = x.reshape(-1)
        else:
            raise ValueError(f"expected mono PCM (1-D array), got shape {x.shape}")
    return x


def _to_s16(x: np.ndarray) -> np.ndarray:
    y = np.clip(x, -1.0, 1.0).astype(np.float32, copy=False) * np.float32(32767.0)
    np.nan_to_num(y, copy=False)
    return np.rint(y, out=y).astype("<i2")


def pcm16_bytes(x: np.ndarray) -> bytes:
    """Float PCM in [-1, 1] as PCM16 LE bytes (clipped, rounded)."""
    return _to_s16(np.asarray(x, dtype=np.float32).reshape(-1)).tobytes()


def _wav_header(sample_rate: int) -> bytes:
    return (
        b"RIFF"
        + struct.pack("<I", 0xFFFFFFFF)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", 0xFFFFFFFF)
    )


class _Sink:
    """Write-only, non-seekable file object: FFmpeg then writes progressively
    (no back-patching of headers) and flushes after every muxed packet."""

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: Any) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        if not self._parts:
            return b""
        out = b"".join(self._parts)
        self._parts.clear()
        return out


class StreamingEncoder:
    """Encode float32 mono PCM chunks into ``fmt``, returning bytes as they are ready.

    ``encode(pcm)`` returns the bytes to send now (possibly ``b""``);
    ``finish()`` flushes the codec/container and returns the remaining bytes.
    Raises :class:`AudioFormatError` at construction for an unknown format or one
    this server's PyAV/FFmpeg cannot encode.
    """

    def __init__(self, fmt: str, sample_rate: int = 24000) -> None:
        self.format = _normalize(fmt)
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate <= 0:
            raise ValueError(f"sample_rate must be a positive int, got {sample_rate!r}")
        self.sample_rate = sample_rate
        self.content_type = _CONTENT_TYPES[self.format]
        self._finished = False
        self._header_sent = False
        self._samples_in = 0
        self._container: Any = None
        self._stream: Any = None

        encoder, reason = _probe(self.format)
        if encoder is None:
            raise AudioFormatError(
                f"response_format {self.format!r} is not available on this server: {reason}; "
                f"available: {', '.join(available_formats())}",
                fmt,
            )
        if self.format in _AV_SPECS:
            try:
                self._open_av(encoder)
            except Exception as exc:
                self.close()
                raise AudioFormatError(
                    f"response_format {self.format!r} is not available on this server: "
                    f"cannot open {encoder} encoder at {sample_rate} Hz ({exc})",
                    fmt,
                ) from exc

    # -- PyAV formats ---------------------------------------------------
    def _open_av(self, encoder: str) -> None:
        muxer, _, sample_fmt, bit_rate, mux_opts = _AV_SPECS[self.format]
        rates = av.codec.Codec(encoder, "w").audio_rates
        rate = self.sample_rate
        if rates and rate not in rates:
            rate = _FALLBACK_RATE.get(self.format) or min(
                (r for r in rates if r >= rate), default=max(rates)
            )
        self._sink = _Sink()
        self._container = av.open(
            self._sink, mode="w", format=muxer, container_options=dict(mux_opts)
        )
        stream = self._container.add_stream(encoder, rate=rate)
        stream.layout = "mono"
        stream.format = sample_fmt
        if bit_rate:
            stream.bit_rate = bit_rate
        stream.codec_context.thread_count = 1
        self._stream = stream
        # Open the encoder and write the container header now: encoder errors
        # surface here (construction) and the header goes out with the first
        # encode() instead of waiting for the first packet.
        self._container.start_encoding()
        # Fed-frame format: the encoder's own, so PyAV's internal resampler only
        # re-chunks to the codec frame size (and converts the rate if needed).
        self._frame_fmt = sample_fmt
        self._time_base = Fraction(1, self.sample_rate)

    def _frame(self, x: np.ndarray):
        if self._frame_fmt in ("s16", "s16p"):
            data = _to_s16(x)
        else:
            data = np.clip(x, -1.0, 1.0).astype(np.float32, copy=False)
            np.nan_to_num(data, copy=False)
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(data.reshape(1, -1)), format=self._frame_fmt, layout="mono"
        )
        frame.sample_rate = self.sample_rate
        frame.time_base = self._time_base
        frame.pts = self._samples_in
        return frame

    # -- public API -----------------------------------------------------
    def encode(self, pcm: np.ndarray) -> bytes:
        """Encode one chunk of float mono PCM; return the bytes ready now."""
        if self._finished:
            raise RuntimeError("StreamingEncoder.encode() called after finish()/close()")
        x = _as_mono_float(pcm)
        if self._container is None:  # wav / pcm
            out = _to_s16(x).tobytes() if x.size else b""
            self._samples_in += x.size
            if self.format == "wav" and not self._header_sent:
                self._header_sent = True
                return _wav_header(self.sample_rate) + out
            return out
        if x.size == 0:
            return b""
        frame = self._frame(x)
        self._samples_in += x.size
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        return self._sink.take()

    def finish(self) -> bytes:
        """Flush the encoder and container; return the last bytes (idempotent)."""
        if self._finished:
            return b""
        self._finished = True
        if self._container is None:
            if self.format == "wav" and not self._header_sent:
                self._header_sent = True
                return _wav_header(self.sample_rate)
            return b""
        try:
            for packet in self._stream.encode(None):
                self._container.mux(packet)
            self._container.close()
        finally:
            self._container = None
        return self._sink.take()

    def close(self) -> None:
        """Release resources without returning pending bytes (e.g. client gone)."""
        self._finished = True
        container, self._container = self._container, None
        if container is not None:
            try:
                container.close()
            except Exception:
                pass

    def __enter__(self) -> StreamingEncoder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def decode_audio(data: bytes, sample_rate: int = 24000, max_seconds: float = 600.0) -> np.ndarray:
    """Decode an audio file (wav, mp3, flac, ogg/opus, …) to float32 mono at `sample_rate`.

    Raises AudioFormatError for data FFmpeg cannot read or longer than `max_seconds`.
    """
    import io

    import av

    out: list[np.ndarray] = []
    total = 0
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise AudioFormatError("the data holds no audio stream", "input_audio")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate)
            for frame in container.decode(audio=0):
                for f in resampler.resample(frame):
                    a = f.to_ndarray().reshape(-1).astype(np.float32, copy=False)
                    out.append(a)
                    total += len(a)
                    if total > max_seconds * sample_rate:
                        raise AudioFormatError(f"audio longer than {max_seconds:g} s", "input_audio")
            for f in resampler.resample(None):
                out.append(f.to_ndarray().reshape(-1).astype(np.float32, copy=False))
    except AudioFormatError:
        raise
    except (av.error.FFmpegError, ValueError, IndexError) as exc:
        raise AudioFormatError(f"the audio cannot be decoded: {exc}", "input_audio") from None
    return np.concatenate(out) if out else np.zeros(0, np.float32)
