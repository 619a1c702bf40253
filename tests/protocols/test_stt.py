"""Input transcription while the user speaks: the stt stage (a fake step over the real
stage processor) streams `…delta` events during the utterance and `…completed` after
its commit; whisper-1 stays the asr stage's, on commit."""

from __future__ import annotations

import pytest

from testkit import serve
from testkit.wire import b64, connect, quiet, tone


@pytest.fixture
async def h():
    async with serve(["voice"]) as harness:
        yield harness


async def _session(h, model: str):
    ws = await connect(h, "/v1/realtime?model=gpt-realtime")
    await ws.until("session.created")
    await ws.send("session.update", session={"type": "realtime", "output_modalities": ["text"], "max_output_tokens": 2,
                                             "audio": {"input": {"transcription": {"model": model}}}})
    await ws.until("session.updated")
    return ws


async def _speak(ws, audio: bytes) -> None:
    for i in range(0, len(audio), 4800):  # 100 ms appends
        await ws.send("input_audio_buffer.append", audio=b64(audio[i : i + 4800]))


async def test_a_streaming_model_transcribes_while_the_user_speaks(h):
    ws = await _session(h, "gpt-4o-transcribe")
    await _speak(ws, quiet(0.3) + tone(2.0))
    delta = await ws.until("conversation.item.input_audio_transcription.delta")  # before the user stopped
    assert "input_audio_buffer.speech_stopped" not in ws.types() and "input_audio_buffer.committed" not in ws.types()
    started = next(e for e in ws.seen if e["type"] == "input_audio_buffer.speech_started")
    assert delta["item_id"] == started["item_id"] and delta["content_index"] == 0
    await _speak(ws, quiet(0.8))
    done = await ws.until("conversation.item.input_audio_transcription.completed")
    t = ws.types()
    assert t.index("input_audio_buffer.committed") < t.index("conversation.item.input_audio_transcription.completed")
    deltas = [e["delta"] for e in ws.seen if e["type"] == "conversation.item.input_audio_transcription.delta"]
    assert len(deltas) >= 3 and done["transcript"] == "".join(deltas).strip() and done["item_id"] == started["item_id"]
    assert 2.0 <= done["usage"]["seconds"] <= 3.0  # the utterance: prefix padding, speech, the silence that ended it
    await ws.until("response.done")
    await ws.send("conversation.item.retrieve", item_id=done["item_id"])
    item = (await ws.until("conversation.item.retrieved"))["item"]
    assert item["content"][0]["transcript"] == done["transcript"]
    # nothing of it went to the batch transcriber
    assert h.processor("asr").seen == []
    await ws.ws.close()


async def test_whisper_1_transcribes_on_commit_and_a_cleared_utterance_says_nothing(h):
    ws = await _session(h, "whisper-1")
    await _speak(ws, quiet(0.3) + tone(1.0) + quiet(0.8))
    done = await ws.until("conversation.item.input_audio_transcription.completed")
    t = ws.types()
    assert t.index("input_audio_buffer.committed") < t.index("conversation.item.input_audio_transcription.delta")
    assert done["transcript"] and len(h.processor("asr").seen) == 1
    await ws.until("response.done")
    await ws.ws.close()
    ws = await _session(h, "gpt-4o-mini-transcribe")
    await ws.send("session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
    await ws.until("session.updated")
    await _speak(ws, tone(2.0))
    await ws.until("conversation.item.input_audio_transcription.delta")
    await ws.send("input_audio_buffer.clear")
    await ws.until("input_audio_buffer.cleared")
    await _speak(ws, tone(0.5))  # the next utterance is its own
    await ws.send("input_audio_buffer.commit")
    committed = await ws.until("input_audio_buffer.committed")
    done = await ws.until("conversation.item.input_audio_transcription.completed")
    assert done["item_id"] == committed["item_id"]
    completed = [e for e in ws.seen if e["type"] == "conversation.item.input_audio_transcription.completed"]
    assert len(completed) == 1  # the cleared one said nothing more
    await ws.ws.close()
