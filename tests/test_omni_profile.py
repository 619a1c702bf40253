"""The omni voice profiles end to end, each on its own server: `omni` (the tiny
Qwen2.5-Omni serves the thinker on vLLM, its own talker and its own token2wav) and
`omni3` (the tiny Qwen3-Omni: its MoE thinker on vLLM, its talker + code predictor, its
causal code2wav), through the official SDK: a spoken turn is answered in the checkpoint's
own voice, the speakers are the session's voices (OpenAI names map to them, others are
refused naming the choices), a barge-in stops the answer, and /v1/chat/completions speaks
through the same stages."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest

from testkit.harness import silence, speech_pcm16, voice_profile_server
from tests.test_realtime import append, until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent


# per profile: the checkpoint's speakers, and the samples a code frame decodes to
SPEAKERS = {"omni": ("chelsie", "ethan"), "omni3": ("chelsie", "ethan", "aiden")}
FRAME_SAMPLES = {"omni": 480, "omni3": 1920}


@pytest.fixture(scope="module", params=["omni", "omni3"])
def omni_server(request, models_dir, tmp_path_factory):
    for server in voice_profile_server(models_dir, tmp_path_factory.mktemp(request.param), request.param):
        server.profile = request.param
        yield server


def _client(server):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{server.url}/v1", websocket_base_url=f"ws://127.0.0.1:{server.port}/v1", api_key="x")


async def test_spoken_turn_answered_in_the_checkpoints_voice(omni_server):
    speech = speech_pcm16("Hello, can you tell me what the weather is like today?")
    async with _client(omni_server).realtime.connect(model="gpt-realtime") as conn:
        created = await conn.recv()
        assert created.type == "session.created"
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 8, "audio": {"output": {"voice": "ash"}}})
        updated = await conn.recv()
        assert updated.type == "session.updated"
        assert updated.session.audio.output.voice == "ash"
        await append(conn, silence(0.6) + speech + silence(1.0), chunk=4800)
        seen: list = []
        done = await until(conn, "response.done", seen)
        assert done.response.status == "completed", done.response.status_details
        pcm = b"".join(base64.b64decode(e.delta) for e in seen if e.type == "response.output_audio.delta")
        audio = np.frombuffer(pcm, "<i2")
        # the vocoder's 24 kHz audio (token2wav: 20 ms a code; code2wav: 80 ms a frame,
        # less the samples its last window's transposed convolutions leave out)
        assert len(audio) >= 24000 * 0.2
        if omni_server.profile == "omni":
            assert len(audio) % FRAME_SAMPLES["omni"] == 0
        assert np.abs(audio).max() > 0
        transcript = "".join(e.delta for e in seen if e.type == "response.output_audio_transcript.delta")
        assert transcript == done.response.output[0].content[0].transcript


async def test_voices_are_the_checkpoints_speakers(omni_server):
    async with _client(omni_server).realtime.connect(model="gpt-realtime") as conn:
        await conn.recv()
        await conn.session.update(session={"type": "realtime", "audio": {"output": {"voice": SPEAKERS[omni_server.profile][-1]}}})
        assert (await conn.recv()).type == "session.updated"
        await conn.session.update(session={"type": "realtime", "audio": {"output": {"voice": "tara"}}})  # Orpheus', not this model's
        err = await conn.recv()
        assert err.type == "error"
        assert all(name in err.error.message for name in SPEAKERS[omni_server.profile])


async def test_barge_in_cancels_the_spoken_answer(omni_server):
    async with _client(omni_server).realtime.connect(model="gpt-realtime") as conn:
        await conn.recv()
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 32, "audio": {"input": {"turn_detection": None}}})
        assert (await conn.recv()).type == "session.updated"
        await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me a long story."}]})
        await conn.response.create()
        seen: list = []
        await until(conn, "response.output_audio.delta", seen)
        await conn.response.cancel()
        done = await until(conn, "response.done", seen)
        assert done.response.status == "cancelled"
        # the session goes on: the next answer is spoken again
        await conn.response.create(response={"max_output_tokens": 4})
        after: list = []
        done = await until(conn, "response.done", after)
        assert done.response.status == "completed"
        assert any(e.type == "response.output_audio.delta" for e in after)


async def test_chat_completion_speaks_through_the_omni_stages(omni_server):
    out = await _client(omni_server).chat.completions.create(
        model="gpt-4o-audio-preview", modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"}, max_tokens=6,
        messages=[{"role": "user", "content": "Say something."}],
    )
    audio = out.choices[0].message.audio
    assert audio is not None and base64.b64decode(audio.data)[:4] == b"RIFF"
    assert audio.transcript == out.choices[0].message.content or audio.transcript


async def test_an_image_in_the_conversation_is_answered_out_loud(omni_server):
    """input_image through the SDK on the omni profiles: the thinker sees the picture
    on vLLM and the talker recomputes the thinker's states over its rows (the checkpoint's
    vision tower), so the answer about it is spoken; the usage counts its tokens."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(4).random((90, 120, 3)) * 255).astype(np.uint8)).save(buf, "JPEG")
    url = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
    async with _client(omni_server).realtime.connect(model="gpt-realtime") as conn:
        await conn.recv()
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 8, "audio": {"input": {"turn_detection": None}}})
        assert (await conn.recv()).type == "session.updated"
        await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "What do you see?"}, {"type": "input_image", "image_url": url}]})
        await conn.response.create()
        seen: list = []
        done = await until(conn, "response.done", seen)
    assert done.response.status == "completed", done.response.status_details
    assert done.response.usage.input_token_details.image_tokens > 0
    pcm = b"".join(base64.b64decode(e.delta) for e in seen if e.type == "response.output_audio.delta")
    assert len(pcm) > 0 and np.abs(np.frombuffer(pcm, "<i2")).max() > 0
