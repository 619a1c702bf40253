"""/v1/audio/transcriptions on the real server (tiny random Whisper on vLLM) through the
official openai SDK: an espeak-ng utterance as WAV and MP3, streamed and not, several
response formats, translations, and concurrent requests batched in the engine."""

from __future__ import annotations

import asyncio
import io
import wave

import numpy as np
import pytest

from media.audio_formats import StreamingEncoder
from testkit.harness import ADMIN_KEY, speech_pcm16

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


def wav_bytes(pcm16: bytes, rate: int = 24000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm16)
    return buf.getvalue()


@pytest.fixture(scope="module")
def utterance() -> bytes:
    return speech_pcm16("Please transcribe this short sentence.")


def client(server, cls=None):
    from openai import OpenAI

    return (cls or OpenAI)(base_url=f"{server.url}/v1", api_key=ADMIN_KEY, max_retries=0, timeout=120)


def test_the_sdk_transcribes_wav_and_mp3_in_each_format(server, utterance):
    c = client(server)
    t = c.audio.transcriptions.create(model="whisper-1", file=("q.wav", wav_bytes(utterance)), language="en")
    assert isinstance(t.text, str) and t.text.strip()  # random weights: some text, not the sentence
    enc = StreamingEncoder("mp3")
    mp3 = enc.encode(np.frombuffer(utterance, "<i2").astype(np.float32) / 32768) + enc.finish()
    enc.close()
    v = c.audio.transcriptions.create(model="whisper-1", file=("q.mp3", mp3), response_format="verbose_json")
    assert v.language and v.duration == pytest.approx(len(utterance) / 48000, abs=0.1) and v.segments[0].start == 0.0
    srt = c.audio.transcriptions.create(model="whisper-1", file=("q.wav", wav_bytes(utterance)), response_format="srt", language="en")
    assert srt.startswith("1\n00:00:00,000 --> ")
    tr = c.audio.translations.create(model="whisper-1", file=("q.wav", wav_bytes(utterance)))
    assert tr.text.strip()


def test_the_sdk_streams_a_transcript(server, utterance):
    c = client(server)
    events = list(c.audio.transcriptions.create(model="gpt-4o-transcribe", file=("q.wav", wav_bytes(utterance)), language="en", stream=True))
    types = [e.type for e in events]
    assert types[-1] == "transcript.text.done" and "transcript.text.delta" in types
    assert events[-1].text == "".join(e.delta for e in events if e.type == "transcript.text.delta").strip()


async def test_concurrent_transcriptions_share_the_engine(server, utterance):
    from openai import AsyncOpenAI

    c = client(server, AsyncOpenAI)
    data = wav_bytes(utterance)
    results = await asyncio.gather(*(c.audio.transcriptions.create(model="whisper-1", file=("q.wav", data), language="en") for _ in range(6)))
    assert all(r.text.strip() for r in results)
    with pytest.raises(Exception) as bad:
        await c.audio.transcriptions.create(model="whisper-1", file=("q.wav", b"not audio"), language="en")
    assert getattr(bad.value, "status_code", None) == 400


async def test_realtime_input_transcription_through_the_sdk(server, utterance):
    """GA session with audio.input.transcription: the committed utterance is transcribed
    by the shared asr stage; the events come after its commit, typed by the SDK."""
    import base64

    from openai import AsyncOpenAI

    c = AsyncOpenAI(base_url=f"{server.url}/v1", websocket_base_url=f"ws://127.0.0.1:{server.port}/v1", api_key=ADMIN_KEY)
    async with c.realtime.connect(model="gpt-realtime") as conn:
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None,
                                                                                  "transcription": {"model": "whisper-1", "language": "en"}}}})
        types = []
        async for ev in conn:
            types.append(ev.type)
            if ev.type == "session.updated":
                assert ev.session.audio.input.transcription.model == "whisper-1"
                break
        for i in range(0, len(utterance), 9600):
            await conn.input_audio_buffer.append(audio=base64.b64encode(utterance[i : i + 9600]).decode())
        await conn.input_audio_buffer.commit()
        async for ev in conn:
            types.append(ev.type)
            assert ev.type != "error", ev
            if ev.type == "conversation.item.input_audio_transcription.completed":
                assert ev.transcript.strip()
                break
        assert types.index("input_audio_buffer.committed") < types.index("conversation.item.input_audio_transcription.completed")
