"""/v1/live/sessions on the real server (tiny checkpoints: the Qwen2.5-Omni thinker on
vLLM, its streaming STT stage, the talker and SNAC) with the official SDK's
`client.live.connect()`, unchanged: a spoken question (espeak-ng, 16 kHz PCM as the
session's format) is heard by the end-of-turn model and answered with audio in that
format and its transcript; every server event is valid against the SDK's types."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import numpy as np
import pytest
from openai.types.live import ServerEvent
from pydantic import TypeAdapter

from testkit.harness import ADMIN_KEY, silence, speech_pcm16

pytestmark = pytest.mark.integration

EVENTS: TypeAdapter[Any] = TypeAdapter(ServerEvent)


async def test_the_sdks_live_client_holds_a_spoken_session(server):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{server.url}/v1", websocket_base_url=f"ws://127.0.0.1:{server.port}/v1", api_key=ADMIN_KEY)
    speech = silence(0.3, rate=16000) + speech_pcm16("Hello, can you tell me what the weather is like today?", rate=16000)
    seen: list[Any] = []
    async with client.live.connect() as conn:
        await conn.session.start(session={"model": "gpt-live-1", "instructions": "Answer briefly.",
                                          "audio": {"format": {"type": "audio/pcm", "rate": 16000}, "output": {"voice": "marin"}}})

        async def microphone() -> None:  # the question, then silence for as long as the call lasts (100 ms a chunk)
            for i in range(0, len(speech), 3200):
                await conn.session.input_audio.append(audio=base64.b64encode(speech[i : i + 3200]).decode())
            while True:
                await conn.session.input_audio.append(audio=base64.b64encode(silence(0.1, rate=16000)).decode())
                await asyncio.sleep(0.05)

        mic: asyncio.Task[None] | None = None
        try:
            async with asyncio.timeout(90):
                while True:
                    raw = json.loads(await conn.recv_bytes())
                    ev = EVENTS.validate_python(raw)
                    seen.append(ev)
                    if ev.type == "session.started":
                        assert ev.session.audio.format.rate == 16000
                        mic = asyncio.create_task(microphone())
                    elif ev.type == "error":
                        raise AssertionError(ev.error)
                    elif ev.type == "session.usage.updated":
                        break
        finally:
            if mic is not None:
                mic.cancel()
                await asyncio.gather(mic, return_exceptions=True)
        await conn.session.close()
        async with asyncio.timeout(10):
            while (ev := EVENTS.validate_python(json.loads(await conn.recv_bytes()))).type != "session.closed":
                pass
    types = [e.type for e in seen]
    assert "session.input_transcript.delta" in types and "session.output_transcript.delta" in types, types
    pcm = b"".join(base64.b64decode(e.delta) for e in seen if e.type == "session.output_audio.delta")
    assert len(pcm) > 2 * 16000 * 0.2, len(pcm)  # at least 0.2 s of 16 kHz PCM16
    assert np.abs(np.frombuffer(pcm, "<i2")).max() > 0
    assert ev.reason == "close_requested"


async def test_the_readme_example_speakable_context_is_said(server):
    """README's Live example: commentary appended after session.start is spoken next."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{server.url}/v1", websocket_base_url=f"ws://127.0.0.1:{server.port}/v1", api_key=ADMIN_KEY)
    said, audio = [], 0
    async with client.live.connect() as conn:
        await conn.session.start(session={"model": "gpt-live-1", "instructions": "Be brief."})
        await conn.session.commentary.append(content="Greet the caller.", delegation_id=None)
        async with asyncio.timeout(60):
            async for ev in conn:
                EVENTS.validate_python(ev.model_dump(exclude_unset=True))
                if ev.type == "error":
                    raise AssertionError(ev.error)
                if ev.type == "session.output_transcript.delta":
                    said.append(ev.delta)
                if ev.type == "session.output_audio.delta":
                    audio += len(base64.b64decode(ev.delta))
                if ev.type == "session.usage.updated":
                    break
        await conn.session.close()
    assert "".join(said).strip() and audio > 0
