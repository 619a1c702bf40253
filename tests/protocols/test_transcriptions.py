"""/v1/audio/transcriptions and /translations in-process (the real app over a fake ASR
stage): input formats, every response_format, streaming, and bad input."""

from __future__ import annotations

import json

import aiohttp
import numpy as np
import pytest

from media.audio_formats import StreamingEncoder, available_formats
from testkit import serve


@pytest.fixture
async def h():
    async with serve(["asr"]) as harness:
        yield harness


def audio(seconds: float, fmt: str = "wav") -> bytes:
    t = np.arange(int(24000 * seconds)) / 24000
    enc = StreamingEncoder(fmt)
    data = enc.encode((0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)) + enc.finish()
    enc.close()
    return data


def form(data: bytes, filename: str = "a.wav", **fields: str) -> aiohttp.FormData:
    f = aiohttp.FormData()
    f.add_field("file", data, filename=filename, content_type="application/octet-stream")
    for k, v in {"model": "whisper-1", **fields}.items():
        f.add_field(k, v)
    return f


@pytest.mark.parametrize("fmt", ["wav", "mp3", "flac", "opus"])
async def test_each_input_format_is_transcribed(h, fmt):
    if fmt not in available_formats():
        pytest.fail(f"{fmt} encoding is not available in this build of PyAV")
    r = await h.client.post("/v1/audio/transcriptions", data=form(audio(2.0, fmt), f"a.{fmt}"))
    body = await r.json()
    assert r.status == 200, body
    assert body["text"].startswith("w") and body["usage"]["type"] == "duration" and abs(body["usage"]["seconds"] - 2.0) < 0.1
    assert abs(h.processor("asr").seen[-1]["seconds"] - 2.0) < 0.1  # decoded to 16 kHz, whole
    assert h.sessions.sessions() == []


async def test_response_formats_and_segments(h):
    data = audio(65.0)  # three 30 s windows
    r = await h.client.post("/v1/audio/transcriptions", data=form(data, response_format="verbose_json", language="en"))
    v = await r.json()
    assert v["task"] == "transcribe" and v["language"] == "en" and abs(v["duration"] - 65.0) < 0.1
    assert [(s["id"], s["start"], s["end"]) for s in v["segments"]] == [(0, 0.0, 30.0), (1, 30.0, 60.0), (2, 60.0, pytest.approx(65.0, abs=0.1))]
    assert v["text"] == "".join(s["text"] for s in v["segments"]).strip()
    r = await h.client.post("/v1/audio/transcriptions", data=form(data, response_format="text"))
    assert r.content_type == "text/plain" and (await r.text()).strip() == v["text"]
    r = await h.client.post("/v1/audio/transcriptions", data=form(data, response_format="srt"))
    srt = await r.text()
    assert srt.startswith("1\n00:00:00,000 --> 00:00:30,000\n") and "\n3\n00:01:00,000 --> 00:01:05," in srt
    r = await h.client.post("/v1/audio/transcriptions", data=form(data, response_format="vtt"))
    vtt = await r.text()
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:30.000\n")
    r = await h.client.post("/v1/audio/translations", data=form(audio(1.0)))
    assert r.status == 200 and h.processor("asr").seen[-1]["params"]["task"] == "translate"


async def test_streaming_sends_deltas_then_done(h):
    r = await h.client.post("/v1/audio/transcriptions", data=form(audio(3.0), stream="true", prompt="Names: Ada.", temperature="0.2"))
    assert r.status == 200 and r.content_type == "text/event-stream"
    events = [json.loads(line[6:]) for line in (await r.text()).splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events][-1] == "transcript.text.done"
    deltas = [e["delta"] for e in events if e["type"] == "transcript.text.delta"]
    assert deltas and events[-1]["text"] == "".join(deltas).strip()
    assert h.processor("asr").seen[-1]["params"] == {"task": "transcribe", "language": None, "prompt": "Names: Ada.", "temperature": 0.2}


@pytest.mark.parametrize("fields, code, param", [
    ({"response_format": "docx"}, "invalid_value", "response_format"),
    ({"language": "xx"}, "invalid_value", "language"),
    ({"temperature": "hot"}, "invalid_type", "temperature"),
    ({"temperature": "3"}, "invalid_value", "temperature"),
    ({"stream": "maybe"}, "invalid_type", "stream"),
    ({"model": "gpt-9"}, "model_not_found", "model"),
    ({"colour": "red"}, "unknown_parameter", "colour"),
])
async def test_bad_settings_are_400s_naming_the_field(h, fields, code, param):
    r = await h.client.post("/v1/audio/transcriptions", data=form(audio(1.0), **fields))
    body = await r.json()
    assert r.status == 400 and (body["error"]["code"], body["error"]["param"]) == (code, param), body


async def test_bad_files_are_400s_and_big_ones_413(h):
    for data, why in [(b"", "empty"), (b"RIFF....not audio at all" * 10, "corrupt"), (audio(0.05), "too short")]:
        r = await h.client.post("/v1/audio/transcriptions", data=form(data))
        body = await r.json()
        assert r.status == 400 and body["error"]["param"] == "file", (why, body)
    no_file = aiohttp.FormData()
    no_file.add_field("model", "whisper-1")
    no_file.add_field("x", b"1", filename="x")  # still multipart
    r = await h.client.post("/v1/audio/transcriptions", data=no_file)
    assert r.status == 400
    r = await h.client.post("/v1/audio/transcriptions", data=form(b"\0" * (26 * 1000 * 1000)))
    assert r.status == 413 and (await r.json())["error"]["code"] == "request_too_large"
    r = await h.client.post("/v1/audio/transcriptions", json={"model": "whisper-1"})
    assert r.status == 415
    # the server goes on
    r = await h.client.post("/v1/audio/transcriptions", data=form(audio(1.0)))
    assert r.status == 200 and h.sessions.sessions() == []
