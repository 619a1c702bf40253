"""/v1/chat/completions on the voice pipeline with the official openai SDK."""

from __future__ import annotations

import base64
import io
import wave

import httpx
import pytest

from testkit.harness import ADMIN_HEADERS, ADMIN_KEY
from tests.test_realtime import speech_pcm16

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

MSG = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]


@pytest.fixture(scope="module")
def sdk(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key=ADMIN_KEY, max_retries=0, timeout=120)


def test_text_completion(sdk):
    r = sdk.chat.completions.create(model="gpt-4o-audio-preview", messages=MSG, max_tokens=16, seed=3)
    # the test server masks the stop token (SERVER_OVERLAY): the answer runs to max_tokens
    assert r.object == "chat.completion" and r.choices[0].finish_reason == "length"
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


def stage_runs(server, stage: str) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=ADMIN_HEADERS).text
    line = next((x for x in text.splitlines() if x.startswith(f'omni_rt_stage_seconds_count{{pipeline="voice",stage="{stage}"}}')), None)
    return float(line.split()[-1]) if line else 0.0


def test_audio_out_streaming_pcm16_with_audio_in(sdk):
    speech = speech_pcm16("What time is it?")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes(speech)
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


