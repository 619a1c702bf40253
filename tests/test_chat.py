"""/v1/chat/completions on the voice pipeline with the official openai SDK."""

from __future__ import annotations

import base64
import io
import wave

import httpx
import numpy as np
import pytest

from tests.harness import ADMIN_HEADERS, ADMIN_KEY
from tests.test_realtime import speech_pcm16

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

MSG = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]


@pytest.fixture(scope="module")
def sdk(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key=ADMIN_KEY, max_retries=0, timeout=120)


def test_text_completion(sdk):
    r = sdk.chat.completions.create(model="gpt-4o-audio-preview", messages=MSG, max_tokens=16, seed=3)
    assert r.object == "chat.completion" and r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 16
    again = sdk.chat.completions.create(model="gpt-4o-audio-preview", messages=MSG, max_tokens=16, seed=3)
    assert again.choices[0].message.content == r.choices[0].message.content  # seeded


def test_temperature_and_top_p_reach_the_thinker(sdk):
    """temperature 0, or a top_p that keeps only the likeliest token, is greedy: unseeded
    answers agree (and agree with each other); the default samples, so they differ."""
    def answer(**kw) -> str:
        return sdk.chat.completions.create(model="gpt-4o-audio-preview", messages=MSG, max_tokens=12, **kw).choices[0].message.content

    greedy = {answer(temperature=0), answer(temperature=0), answer(top_p=1e-6), answer(top_p=1e-6)}
    assert len(greedy) == 1 and next(iter(greedy))
    assert len({answer() for _ in range(4)}) > 1


def test_text_streaming_with_usage(sdk):
    chunks = list(
        sdk.chat.completions.create(
            model="gpt-4o-audio-preview", messages=MSG, max_tokens=16, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens > 0


def stage_runs(server, stage: str) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=ADMIN_HEADERS).text
    line = next((x for x in text.splitlines() if x.startswith(f'omni_rt_stage_seconds_count{{pipeline="voice",stage="{stage}"}}')), None)
    return float(line.split()[-1]) if line else 0.0


def test_text_only_request_enters_at_the_thinker(server, sdk):
    """No input audio: the audio encoder stage does not run at all; with audio it does."""
    enc, thinker = stage_runs(server, "audio_encoder"), stage_runs(server, "thinker")
    text = "".join(c.choices[0].delta.content or "" for c in sdk.chat.completions.create(
        model="gpt-4o-audio-preview", messages=MSG, max_tokens=4, stream=True, seed=1) if c.choices)
    assert text
    assert stage_runs(server, "thinker") == thinker + 1 and stage_runs(server, "audio_encoder") == enc
    pcm = (np.sin(np.arange(4800) / 8) * 8000).astype("<i2").tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(24000), w.writeframes(pcm)
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(), "format": "wav"}}
    r = sdk.chat.completions.create(model="gpt-4o-audio-preview", messages=[{"role": "user", "content": [part]}], max_tokens=4, seed=1)
    # 0.2 s of audio: one 480 ms encoder block, of which 5 frames are kept
    assert r.usage.prompt_tokens_details.audio_tokens == 5 and r.usage.prompt_tokens > 5
    assert stage_runs(server, "audio_encoder") == enc + 1 and stage_runs(server, "thinker") == thinker + 2


def test_audio_out_non_streaming_wav(sdk):
    r = sdk.chat.completions.create(
        model="gpt-4o-audio-preview", messages=MSG, modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"}, max_tokens=8
    )
    msg = r.choices[0].message
    assert msg.content is None and isinstance(msg.audio.transcript, str) and msg.audio.id
    w = wave.open(io.BytesIO(base64.b64decode(msg.audio.data)))
    pcm = np.frombuffer(w.readframes(10**9), "<i2")
    assert w.getframerate() == 24000 and len(pcm) > 0


def test_audio_out_streaming_pcm16_with_audio_in(sdk):
    speech = speech_pcm16("What time is it?")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(24000), w.writeframes(speech)
    messages = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(), "format": "wav"}}]}]
    stream = sdk.chat.completions.create(
        model="gpt-4o-audio-preview", messages=messages, modalities=["text", "audio"], audio={"voice": "tara", "format": "pcm16"},
        max_tokens=8, stream=True,
    )
    audio, transcript = b"", ""
    for c in stream:
        d = c.choices[0].delta if c.choices else None
        a = getattr(d, "audio", None) if d is not None else None
        if a:
            a = a if isinstance(a, dict) else a.model_dump()
            audio += base64.b64decode(a["data"]) if a.get("data") else b""
            transcript += a.get("transcript") or ""
    assert len(audio) > 0 and len(audio) % 2 == 0 and transcript


@pytest.mark.parametrize(
    "body,param,code",
    [
        ({"model": "nope", "messages": MSG}, "model", "model_not_found"),
        ({"model": "gpt-realtime", "messages": []}, "messages", "invalid_value"),
        ({"model": "gpt-realtime", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
        ({"model": "gpt-realtime", "messages": MSG, "modalities": ["text", "audio"]}, "audio", "missing_required_parameter"),
        ({"model": "gpt-realtime", "messages": MSG, "modalities": ["text", "audio"], "audio": {"voice": "x", "format": "wav"}}, "audio.voice", "invalid_value"),
        ({"model": "gpt-realtime", "messages": MSG, "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}, "stream": True}, "audio.format", "invalid_value"),
        ({"model": "gpt-realtime", "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "***", "format": "wav"}}]}]}, "messages[0].content[0].input_audio.data", "invalid_value"),
        ({"model": "gpt-realtime", "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "aGVsbG8=", "format": "wav"}}]}]}, "messages[0].content[0].input_audio", "invalid_value"),
        ({"model": "gpt-realtime", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type", "invalid_value"),
        ({"model": "gpt-realtime", "messages": MSG, "max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"model": "gpt-realtime", "messages": MSG, "top_p": 0}, "top_p", "invalid_value"),
        ({"model": "gpt-realtime", "messages": MSG, "temperature": 3}, "temperature", "invalid_value"),
    ],
)
def test_bad_chat_input_is_a_400_naming_the_field(server, body, param, code):
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=ADMIN_HEADERS, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code, err
