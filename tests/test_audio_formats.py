import io
import struct
import wave
from itertools import pairwise

import av  # noqa: E402 - a required dependency: missing means failure, not a skip
import numpy as np
import pytest

from media import audio_formats
from media.audio_formats import (
    SUPPORTED_FORMATS,
    AudioFormatError,
    StreamingEncoder,
    available_formats,
    content_type,
)
from media.audio_tempo import TempoFilter

SR = 24000
AVAILABLE = available_formats()
AV_FORMATS = [f for f in AVAILABLE if f not in ("wav", "pcm")]
# Uneven chunk boundaries over 1 s at 24 kHz (includes a 1-sample chunk).
BOUNDS = [0, 1000, 1777, 5000, 9001, 15000, 15001, 24000]


def sine(seconds=1.0, freq=440.0, amp=0.5, sr=SR):
    t = np.arange(int(round(seconds * sr))) / sr
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def dominant_freq(y, sr):
    y = np.asarray(y, dtype=np.float64)
    spec = np.abs(np.fft.rfft(y * np.hanning(len(y))))
    return np.argmax(spec) * sr / len(y)


def rms(y):
    return float(np.sqrt(np.mean(np.asarray(y, dtype=np.float64) ** 2)))


def encode_chunks(fmt, x, bounds, sr=SR):
    enc = StreamingEncoder(fmt, sample_rate=sr)
    parts = [enc.encode(x[a:b]) for a, b in pairwise(bounds)]
    parts.append(enc.finish())
    return parts


def decode_av(data):
    """Decode bytes with PyAV -> (float mono samples, sample rate)."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        rate = stream.rate
        chunks = []
        for frame in container.decode(stream):
            a = frame.to_ndarray()
            if a.dtype == np.int16:
                a = a.astype(np.float32) / 32768.0
            elif a.dtype == np.int32:
                a = a.astype(np.float32) / 2**31
            chunks.append(a.reshape(-1))
    return np.concatenate(chunks), rate


def parse_wav_header(data):
    assert data[0:4] == b"RIFF"
    riff_size = struct.unpack("<I", data[4:8])[0]
    assert data[8:12] == b"WAVE"
    assert data[12:16] == b"fmt "
    fmt_size, tag, channels, rate, byte_rate, align, bits = struct.unpack("<IHHIIHH", data[16:36])
    assert data[36:40] == b"data"
    data_size = struct.unpack("<I", data[40:44])[0]
    return dict(riff_size=riff_size, fmt_size=fmt_size, tag=tag, channels=channels, rate=rate,
                byte_rate=byte_rate, align=align, bits=bits, data_size=data_size)


# --------------------------------------------------------------------------- formats


def test_supported_and_available_formats():
    assert set(SUPPORTED_FORMATS) == {"wav", "pcm", "mp3", "opus", "flac", "aac"}
    assert set(AVAILABLE) <= set(SUPPORTED_FORMATS)
    assert "wav" in AVAILABLE and "pcm" in AVAILABLE
    assert available_formats() == AVAILABLE  # stable (detected once)


@pytest.mark.parametrize(
    "fmt, ctype",
    [("wav", "audio/wav"), ("pcm", "audio/pcm"), ("mp3", "audio/mpeg"),
     ("opus", "audio/ogg"), ("flac", "audio/flac"), ("aac", "audio/aac")],
)
def test_content_type(fmt, ctype):
    assert content_type(fmt) == ctype


@pytest.mark.parametrize("bad", ["ogg", "m4a", "", "wave", None, 3])
def test_unknown_format_raises(bad):
    with pytest.raises(AudioFormatError) as ei:
        StreamingEncoder(bad)
    assert isinstance(ei.value, ValueError)
    assert "response_format" in str(ei.value)
    assert ei.value.field == "response_format"
    with pytest.raises(AudioFormatError):
        content_type(bad)


def test_unavailable_format_raises_at_construction(monkeypatch):
    monkeypatch.setattr(audio_formats, "_probe", lambda fmt: (None, "no libmp3lame encoder"))
    with pytest.raises(AudioFormatError) as ei:
        StreamingEncoder("mp3")
    msg = str(ei.value)
    assert "response_format 'mp3' is not available on this server" in msg
    assert "no libmp3lame encoder" in msg


# --------------------------------------------------------------------------- wav / pcm


def test_wav_header_and_payload():
    x = sine()
    parts = encode_chunks("wav", x, BOUNDS)
    data = b"".join(parts)
    assert len(parts[0]) == 44 + 2 * (BOUNDS[1] - BOUNDS[0])  # header + first chunk at once
    h = parse_wav_header(data)
    assert data[4:8] == b"\xff\xff\xff\xff" and data[40:44] == b"\xff\xff\xff\xff"
    assert h == dict(riff_size=0xFFFFFFFF, fmt_size=16, tag=1, channels=1, rate=SR,
                     byte_rate=2 * SR, align=2, bits=16, data_size=0xFFFFFFFF)
    assert len(data) == 44 + 2 * len(x)
    assert data.count(b"RIFF") == 1
    y = np.frombuffer(data[44:], dtype="<i2")
    assert len(y) == len(x)
    assert abs(dominant_freq(y, SR) - 440) < 2
    assert np.array_equal(y, np.rint(x * 32767).astype(np.int16))


def test_streamed_wav_readable_by_wave_module_and_pyav():
    x = sine()
    data = b"".join(encode_chunks("wav", x, BOUNDS))
    # Python's wave module accepts the 0xFFFFFFFF data size (nframes is bogus,
    # but readframes stops at EOF).
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, SR)
        frames = w.readframes(10**9)
    assert len(frames) == 2 * len(x)
    y, rate = decode_av(data)
    assert rate == SR and len(y) == len(x)


def test_pcm_exact_length_and_signal():
    x = sine()
    parts = encode_chunks("pcm", x, BOUNDS)
    data = b"".join(parts)
    assert len(data) == 2 * len(x)
    assert all(len(p) == 2 * (b - a) for p, (a, b) in zip(parts[:-1], pairwise(BOUNDS), strict=True))
    assert parts[-1] == b""
    y = np.frombuffer(data, dtype="<i2")
    assert abs(dominant_freq(y, SR) - 440) < 2


@pytest.mark.parametrize("fmt", ["wav", "pcm"])
def test_wav_pcm_bytes_on_first_encode(fmt):
    enc = StreamingEncoder(fmt)
    first = enc.encode(sine(0.1))
    assert len(first) == (44 if fmt == "wav" else 0) + 2 * 2400


def test_empty_wav_still_has_header():
    enc = StreamingEncoder("wav")
    assert enc.finish() == audio_formats._wav_header(SR)
    enc = StreamingEncoder("wav")
    assert len(enc.encode(np.zeros(0, np.float32))) == 44


def test_clipping_and_nan():
    enc = StreamingEncoder("pcm")
    x = np.array([2.0, -3.0, 1.0, -1.0, 0.0, 0.5, np.nan], dtype=np.float32)
    y = np.frombuffer(enc.encode(x), dtype="<i2")
    assert y.tolist() == [32767, -32767, 32767, -32767, 0, 16384, 0]


def test_input_validation():
    enc = StreamingEncoder("pcm")
    with pytest.raises(ValueError):
        enc.encode(np.zeros((2, 100), np.float32))  # stereo
    with pytest.raises(TypeError):
        enc.encode(np.zeros(100, np.int16))  # not float
    assert len(enc.encode(np.zeros((100, 1), np.float32))) == 200  # (n, 1) is mono
    assert len(enc.encode(np.zeros(100, np.float64))) == 200
    with pytest.raises(ValueError):
        StreamingEncoder("pcm", sample_rate=0)


@pytest.mark.parametrize("fmt", AVAILABLE)
def test_finish_idempotent_and_encode_after_finish(fmt):
    enc = StreamingEncoder(fmt)
    enc.encode(sine(0.2))
    enc.finish()
    assert enc.finish() == b""
    with pytest.raises(RuntimeError):
        enc.encode(sine(0.1))


# --------------------------------------------------------------------------- PyAV codecs


# Decoded-duration tolerance (seconds): lossless formats are exact; mp3/aac in
# a non-seekable stream carry no gapless info, so encoder priming/padding
# (~1-2 codec frames) shows up as extra samples; Ogg Opus trims via pre-skip
# and the final granule position.
DURATION_TOL = {"flac": (0.0, 0.0), "opus": (0.02, 0.02), "mp3": (0.02, 0.12), "aac": (0.02, 0.12)}


@pytest.mark.parametrize("fmt", AV_FORMATS)
def test_codec_roundtrip(fmt):
    x = sine()
    data = b"".join(encode_chunks(fmt, x, BOUNDS))
    y, rate = decode_av(data)
    duration = len(y) / rate
    below, above = DURATION_TOL[fmt]
    assert 1.0 - below - 1e-9 <= duration <= 1.0 + above + 1e-9, duration
    if fmt == "opus":
        assert data[:4] == b"OggS" and b"OpusHead" in data[:200]
        assert rate == 48000
    if fmt == "flac":
        assert data[:4] == b"fLaC"
        # Lossless: exactly the s16 samples wav/pcm would carry.
        expected = np.rint(x * 32767).astype(np.int16)
        assert np.array_equal(np.rint(y * 32768).astype(np.int16), expected)
        assert abs(dominant_freq(y, rate) - 440) < 2
    else:
        # Lossy: energy close to the sine's (0.5/sqrt(2) ~ 0.354), tone kept.
        assert 0.25 < rms(y) < 0.45, rms(y)
        assert abs(dominant_freq(y, rate) - 440) < 5
    if fmt == "aac":
        assert data[0] == 0xFF and (data[1] & 0xF6) == 0xF0  # ADTS sync word
    if fmt == "mp3":
        assert data[:3] == b"ID3" or (data[0] == 0xFF and data[1] & 0xE0 == 0xE0)


@pytest.mark.parametrize("fmt", AV_FORMATS)
def test_codec_streams_before_finish(fmt):
    """2 s fed in 100 ms chunks: most bytes come out before finish()."""
    x = sine(2.0)
    enc = StreamingEncoder(fmt)
    step = SR // 10
    outs = [enc.encode(x[i:i + step]) for i in range(0, len(x), step)]
    tail = enc.finish()
    before = sum(len(o) for o in outs)
    assert before > 0
    assert sum(1 for o in outs if o) >= len(outs) // 2
    assert before >= 0.6 * (before + len(tail)), (before, len(tail))
    y, rate = decode_av(b"".join(outs) + tail)
    assert len(y) / rate >= 1.95


@pytest.mark.parametrize("fmt", AV_FORMATS)
def test_codec_other_sample_rate(fmt):
    sr = 16000
    x = sine(1.0, sr=sr)
    data = b"".join(encode_chunks(fmt, x, [0, 4000, 9999, 16000], sr=sr))
    y, rate = decode_av(data)
    assert 0.98 <= len(y) / rate <= 1.12
    assert abs(dominant_freq(y, rate) - 440) < 5


# --------------------------------------------------------------------------- speed


def run_tempo(speed, x, bounds):
    tf = TempoFilter(speed, SR)
    outs = [tf.process(x[a:b]) for a, b in pairwise(bounds)]
    outs.append(tf.flush())
    for o in outs:
        assert o.dtype == np.float32 and o.ndim == 1
    return outs, np.concatenate(outs)


@pytest.mark.parametrize("speed", [0.25, 0.5, 0.8, 1.5, 2.0, 4.0])
def test_tempo_duration_and_pitch(speed):
    x = sine(2.0)
    bounds = [0, 2040, 2041, 9000, 20000, 33333, 48000]
    outs, y = run_tempo(speed, x, bounds)
    expected = len(x) / speed
    assert abs(len(y) - expected) <= 0.05 * expected, (len(y), expected)
    assert abs(dominant_freq(y, SR) - 440) < 3
    assert rms(y) > 0.25
    # streaming: output is produced before flush
    assert sum(len(o) for o in outs[:-1]) >= 0.8 * len(y)


def test_tempo_first_chunk_not_held_back():
    x = sine(0.4)
    tf = TempoFilter(2.0, SR)
    first = tf.process(x[: int(0.2 * SR)])  # 200 ms in -> most of 100 ms out
    assert len(first) >= 0.5 * 0.1 * SR


def test_tempo_passthrough():
    x = sine(0.3)
    tf = TempoFilter(1.0, SR)
    assert tf.process(x) is x
    assert len(tf.flush()) == 0
    assert TempoFilter(1, SR).process(x) is x


@pytest.mark.parametrize("bad", [0.0, 0.2, 0.249, 4.01, 5, -1.0, float("nan"), float("inf"), "2", True])
def test_tempo_speed_out_of_range(bad):
    with pytest.raises(ValueError) as ei:
        TempoFilter(bad, SR)
    assert "speed" in str(ei.value)


def test_tempo_then_encode():
    x = sine(1.0)
    tf = TempoFilter(2.0, SR)
    enc = StreamingEncoder("wav")
    data = b"".join(enc.encode(tf.process(x[a:b])) for a, b in pairwise(BOUNDS))
    data += enc.encode(tf.flush()) + enc.finish()
    y = np.frombuffer(data[44:], dtype="<i2")
    assert abs(len(y) - SR / 2) <= 0.05 * SR / 2
    assert abs(dominant_freq(y, SR) - 440) < 3
