"""The cascade voice profile end to end on real engines (its own server: tiny Whisper on
vLLM -> the tiny Qwen2 text chat LM on vLLM -> talker -> code2wav), through the
official SDK: real speech in, the turn is transcribed on commit, answered from the
transcript, in speech; the item keeps the transcript for later turns, and input
transcription events come with it."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.harness import silence, speech_pcm16, voice_profile_server
from tests.test_realtime import append, until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cascade_server(models_dir, tmp_path_factory):
    yield from voice_profile_server(models_dir, tmp_path_factory.mktemp("cascade"), "cascade")


async def test_cascade_turn_through_the_sdk(cascade_server):
    from openai import AsyncOpenAI

    c = AsyncOpenAI(base_url=f"{cascade_server.url}/v1", websocket_base_url=f"ws://127.0.0.1:{cascade_server.port}/v1", api_key="x")
    speech = speech_pcm16("Hello, can you tell me what the weather is like today?")
    async with c.realtime.connect(model="gpt-realtime") as conn:
        await conn.recv()
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 8,
                                           "audio": {"input": {"transcription": {"model": "whisper-1"}}}})
        assert (await conn.recv()).type == "session.updated"
        await append(conn, silence(0.6) + speech + silence(1.0), chunk=4800)
        seen: list = []
        done = await until(conn, "response.done", seen)
        assert done.response.status == "completed"
        types = [e.type for e in seen]
        assert "response.output_audio.delta" in types
        committed = next(e for e in seen if e.type == "input_audio_buffer.committed")
        # the transcript the cascade answered is the item's, once its request is done
        await conn.send({"type": "conversation.item.retrieve", "item_id": committed.item_id})
        got = await until(conn, "conversation.item.retrieved", seen)
        transcript = got.item.content[0].transcript
        assert isinstance(transcript, str) and transcript
        if "conversation.item.input_audio_transcription.completed" not in [e.type for e in seen]:
            await until(conn, "conversation.item.input_audio_transcription.completed", seen)
        completed = next(e for e in seen if e.type == "conversation.item.input_audio_transcription.completed")
        # the same Whisper transcribed the same audio (greedy both times)
        assert completed.transcript == transcript
