"""The audio formats the voice wires speak, and their codecs: PCM16 at a declared rate,
and G.711 (μ-law `audio/pcmu`, A-law `audio/pcma`) at 8 kHz, the telephone network's.

Names, as the wires write them:

| format | Realtime GA `audio.*.format` | Realtime beta `*_audio_format` | Twilio `mediaFormat.encoding` |
|---|---|---|---|
| PCM16 at 24 kHz | `{type: audio/pcm, rate: 24000}` | `pcm16` | |
| μ-law at 8 kHz | `{type: audio/pcmu}` | `g711_ulaw` | `audio/x-mulaw` |
| A-law at 8 kHz | `{type: audio/pcma}` | `g711_alaw` | |

The G.711 codec is the standard library's `audioop` (Python < 3.13) or its maintained
continuation `audioop-lts` (3.13+, the same module name); soxr resamples the 8 kHz legs
to and from the model rate with its filter state kept across a stream's chunks.

    dec = InputDecoder(WireFormat.parse_realtime("g711_ulaw", "session.input_audio_format"), 24000)
    pcm = dec.decode(payload)               # float32 mono at 24 kHz
    enc = OutputEncoder(PCMU, 24000)
    wire = enc.encode(key, pcm16_24k)       # μ-law bytes at 8 kHz (key: one answer)
    wire += enc.finish(key)                 # the filter's last few ms
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from media.audio_formats import pcm16_bytes

with warnings.catch_warnings():  # the stdlib module warns of its removal in 3.13 (audioop-lts continues it)
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

__all__ = ["G711_RATE", "PCMA", "PCMU", "InputDecoder", "OutputEncoder", "WireFormat", "WireFormatError", "decode_clip", "encode_clip"]

G711_RATE = 8000
Encoding = Literal["pcm16", "pcmu", "pcma"]


class WireFormatError(ValueError):
    """An audio format a wire does not speak; the message names what it does."""


@dataclass(frozen=True)
class WireFormat:
    encoding: Encoding
    rate: int

    @property
    def g711(self) -> bool:
        return self.encoding != "pcm16"

    @property
    def bytes_per_sample(self) -> int:
        return 1 if self.g711 else 2

    def ms_of(self, nbytes: int) -> float:
        """How many milliseconds `nbytes` of this format carry."""
        return nbytes / self.bytes_per_sample * 1000 / self.rate

    # ---- the Realtime API's names ---------------------------------------------------------
    def ga(self) -> dict[str, Any]:
        if self.encoding == "pcm16":
            return {"type": "audio/pcm", "rate": self.rate}
        return {"type": f"audio/{self.encoding}"}

    def beta(self) -> str:
        return {"pcm16": "pcm16", "pcmu": "g711_ulaw", "pcma": "g711_alaw"}[self.encoding]

    @staticmethod
    def parse_realtime(value: Any, pcm_rates: tuple[int, ...] = (24000,)) -> WireFormat:
        """A Realtime format in either shape (`pcm16`, `g711_ulaw`, `g711_alaw`, or
        `{type: audio/pcm|audio/pcmu|audio/pcma, rate}`); PCM at one of `pcm_rates`
        (the first is the default), G.711 at 8 kHz."""
        names = {"pcm16": "pcm16", "g711_ulaw": "pcmu", "g711_alaw": "pcma"}
        if isinstance(value, str) and value in names:
            enc = names[value]
            return WireFormat("pcm16", pcm_rates[0]) if enc == "pcm16" else WireFormat(enc, G711_RATE)  # type: ignore[arg-type]
        if isinstance(value, Mapping):
            kind = value.get("type", "audio/pcm")
            rate = value.get("rate")
            if kind == "audio/pcm":
                rate = pcm_rates[0] if rate is None else rate
                if isinstance(rate, int) and not isinstance(rate, bool) and rate in pcm_rates:
                    return WireFormat("pcm16", rate)
                raise WireFormatError(f"Unsupported sample rate {rate!r} for audio/pcm; use one of {', '.join(map(str, pcm_rates))}.")
            if kind in ("audio/pcmu", "audio/pcma"):
                if rate not in (None, G711_RATE):
                    raise WireFormatError(f"{kind} is 8000 Hz; got rate {rate!r}.")
                return WireFormat(kind.removeprefix("audio/"), G711_RATE)
        rates = ", ".join(map(str, pcm_rates))
        raise WireFormatError(f"Unsupported audio format {value!r}; use pcm16 / g711_ulaw / g711_alaw, or "
                              f"{{type: audio/pcm (rate {rates}) | audio/pcmu | audio/pcma}}.")


PCMU = WireFormat("pcmu", G711_RATE)
PCMA = WireFormat("pcma", G711_RATE)


def _to_lin16(fmt: WireFormat, data: bytes) -> bytes:
    if fmt.encoding == "pcmu":
        return audioop.ulaw2lin(data, 2)
    if fmt.encoding == "pcma":
        return audioop.alaw2lin(data, 2)
    return data


def _from_lin16(fmt: WireFormat, pcm16: bytes) -> bytes:
    if fmt.encoding == "pcmu":
        return audioop.lin2ulaw(pcm16, 2)
    if fmt.encoding == "pcma":
        return audioop.lin2alaw(pcm16, 2)
    return pcm16


def _samples(fmt: WireFormat, data: bytes) -> np.ndarray:
    """Audio bytes in `fmt` as float32 samples at `fmt.rate`."""
    if not fmt.g711 and len(data) % 2:
        raise WireFormatError("16-bit PCM needs an even number of bytes.")
    return _floats(_to_lin16(fmt, data))


def _floats(pcm16: bytes) -> np.ndarray:
    return np.frombuffer(pcm16, "<i2").astype(np.float32) / 32768.0


class InputDecoder:
    """One caller's incoming audio in `fmt` as float32 mono at `rate` (a stream: the
    resampler keeps its state between chunks)."""

    def __init__(self, fmt: WireFormat, rate: int) -> None:
        self.fmt, self.rate = fmt, rate
        self._rs: Any = None

    def decode(self, data: bytes) -> np.ndarray:
        x = _samples(self.fmt, data)
        if self.fmt.rate == self.rate:
            return x
        if self._rs is None:
            import soxr

            self._rs = soxr.ResampleStream(self.fmt.rate, self.rate, 1, dtype="float32")
        return np.asarray(self._rs.resample_chunk(x), np.float32)


class OutputEncoder:
    """Answers' PCM16 at `rate` as `fmt` bytes. Each answer (`key`) is its own stream:
    a new key starts the resampler again, `finish(key)` gives what it still holds."""

    def __init__(self, fmt: WireFormat, rate: int) -> None:
        self.fmt, self.rate = fmt, rate
        self._key: Any = None
        self._rs: Any = None

    def encode(self, key: Any, pcm16: bytes) -> bytes:
        if self.fmt.rate != self.rate:
            if self._rs is None or key != self._key:
                import soxr

                self._key, self._rs = key, soxr.ResampleStream(self.rate, self.fmt.rate, 1, dtype="float32")
            pcm16 = pcm16_bytes(self._rs.resample_chunk(_floats(pcm16)))
        return _from_lin16(self.fmt, pcm16)

    def finish(self, key: Any) -> bytes:
        if self._rs is None or key != self._key:
            return b""
        tail = pcm16_bytes(self._rs.resample_chunk(np.zeros(0, np.float32), last=True))
        self._key, self._rs = None, None
        return _from_lin16(self.fmt, tail)


def decode_clip(fmt: WireFormat, data: bytes, rate: int) -> np.ndarray:
    """A whole clip in `fmt` (an item's audio) as float32 mono at `rate`."""
    x = _samples(fmt, data)
    if fmt.rate == rate or not len(x):
        return x
    import soxr

    return np.asarray(soxr.resample(x, fmt.rate, rate), np.float32)


def encode_clip(fmt: WireFormat, pcm16: bytes, rate: int) -> bytes:
    """A whole clip of PCM16 at `rate` as `fmt` bytes."""
    if fmt.rate != rate and pcm16:
        import soxr

        pcm16 = pcm16_bytes(soxr.resample(_floats(pcm16), rate, fmt.rate))
    return _from_lin16(fmt, pcm16)
