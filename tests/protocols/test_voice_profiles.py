"""The voice pipeline's profiles that take speech through /v1/realtime (in-process, fakes): what
the thinker is given for the user's speech in each, and that nothing else changes.

- default: the thinker takes the audio itself (AUDIO payloads with the response);
- cascade: asr transcribes each utterance on commit and the thinker gets the text.
"""

from __future__ import annotations

import pytest

from testkit import serve
from testkit.wire import b64, connect, tone


async def _turn(h, seconds: float = 1.0):
    ws = await connect(h, "/v1/realtime?model=gpt-realtime")
    await ws.until("session.created")
    await ws.send("session.update", session={"type": "realtime", "instructions": "Be brief."})
    await ws.until("session.updated")
    for _ in range(int(seconds / 0.2)):
        await ws.send("input_audio_buffer.append", audio=b64(tone(0.2)))
    await ws.send("input_audio_buffer.commit")
    committed = await ws.until("input_audio_buffer.committed")
    await ws.send("response.create", response={"max_output_tokens": 4})
    done = await ws.until("response.done")
    assert done["response"]["status"] == "completed"
    assert any(e["type"] == "response.output_audio.delta" for e in ws.seen)
    return ws, committed["item_id"], done


async def test_default_profile_gives_the_thinker_the_audio_itself():
    async with serve(["voice"]) as h:
        assert h.runtime.profiles["voice"].entry == "thinker"
        ws, item_id, done = await _turn(h)
        seen = h.processor("thinker").seen
        assert [s["audio_rows"] for s in seen] == [25]  # 1 s of audio, as 40 ms rows
        assert seen[0]["messages"][-1]["content"] == "<|audio|>"
        assert done["response"]["usage"]["input_token_details"]["audio_tokens"] == 25
        # no request ran for the utterance before the answer: only thinker work
        assert "audio_encoder" not in h.runtime.pools
        await ws.ws.close()


async def test_cascade_profile_transcribes_on_commit_and_answers_the_transcript():
    async with serve(["voice"], {"pipelines": {"voice": {"profile": "cascade"}}}) as h:
        assert h.runtime.profiles["voice"].entry == "asr"
        ws, item_id, _ = await _turn(h)
        seen = h.processor("thinker").seen
        assert seen[0]["audio_rows"] == 0  # the thinker hears no audio...
        said = seen[0]["messages"][-1]["content"]
        assert said.startswith("w") and "<|audio|>" not in said  # ...but the asr's transcript
        # the item keeps the transcript: a later turn's prompt reads it
        await ws.send("conversation.item.retrieve", item_id=item_id)
        got = await ws.until("conversation.item.retrieved")
        assert got["item"]["content"][0]["transcript"] == said
        await ws.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "and then?"}]})
        await ws.until("conversation.item.done")
        await ws.send("response.create", response={"max_output_tokens": 2})
        await ws.until("response.done")
        users = [m["content"] for m in seen[1]["messages"] if m["role"] == "user"]
        assert users == [said, "and then?"]
        await ws.ws.close()


@pytest.mark.parametrize("profile", ["default", "cascade"])
async def test_every_profile_serves_chat_audio_in(profile):
    """/v1/chat/completions with an input_audio part enters at the profile's entry."""
    import base64
    import io

    from clients.realtime import write_wav_pcm16

    buf = io.BytesIO()
    write_wav_pcm16(buf, tone(1.0), 24000)
    audio = base64.b64encode(buf.getvalue()).decode()
    async with serve(["voice"], {"pipelines": {"voice": {"profile": profile}}}) as h:
        r = await h.client.post("/v1/chat/completions", json={
            "model": "gpt-4o-audio-preview", "max_tokens": 3,
            "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": audio, "format": "wav"}}]}]})
        body = await r.json()
        assert r.status == 200, body
        assert body["choices"][0]["message"]["content"]
        seen = h.processor("thinker").seen[-1]
        if profile == "cascade":
            assert seen["audio_rows"] == 0 and "<|audio|>" not in seen["messages"][-1]["content"]
        else:
            assert seen["audio_rows"] == 25


async def test_the_kept_utterance_is_bounded_and_the_refusal_is_visible():
    """Where the thinker takes audio itself the buffer keeps the PCM: beyond 300 s an
    append is refused with an error event (not dropped silently), and after a commit
    the session goes on."""
    async with serve(["voice"]) as h:
        ws = await connect(h, "/v1/realtime?model=gpt-realtime")
        await ws.until("session.created")
        await ws.send("session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        await ws.until("session.updated")
        await ws.send("input_audio_buffer.append", audio=b64(tone(200.0, amp=0.0)))
        await ws.send("input_audio_buffer.append", audio=b64(tone(200.0, amp=0.0)), event_id="too-long")
        err = await ws.until("error", timeout=20)
        assert err["error"]["code"] == "input_audio_buffer_too_long" and err["error"]["event_id"] == "too-long"
        await ws.send("input_audio_buffer.commit")
        await ws.until("input_audio_buffer.committed", timeout=20)
        await ws.send("response.create", response={"max_output_tokens": 2})
        done = await ws.until("response.done", timeout=20)
        assert done["response"]["status"] == "completed"
        assert h.processor("thinker").seen[-1]["audio_rows"] == 5000  # the 200 s accepted, as 40 ms rows
        await ws.ws.close()
