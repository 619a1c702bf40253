"""Calls that last: truncation keeps a long conversation within the thinker's context,
idle_timeout_ms nudges a silent caller, settings no server applies are refused by name.
In-process (fake engines, EnergyVad), through the openai SDK where a client would be."""

from __future__ import annotations

import base64
from typing import Any

import openai
import pytest

from testkit import serve
from testkit.wire import b64, connect, quiet, tone


@pytest.fixture
async def h():
    async with serve(["voice"]) as harness:
        yield harness


def sdk(h) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key="sk-unused", base_url=str(h.client.make_url("/v1")), max_retries=0)


def conversation_of(h):
    (s,) = [s for s in h.sessions.sessions() if s.kind == "realtime"]
    from protocols.realtime import Conversation

    return s.kept(Conversation)


SENTENCE = "please remind me what we said about the delivery window and the invoice number earlier today"  # 17 words


async def _turn(conn, events: list, item: dict) -> Any:
    await conn.conversation.item.create(item=item)
    await conn.response.create(response={"max_output_tokens": 4})
    async for ev in conn:
        events.append(ev)
        if ev.type == "error":
            raise AssertionError(ev.error)
        if ev.type == "response.done":
            return ev.response
    raise AssertionError("the connection closed before response.done")


async def test_an_hour_long_call_stays_answered_within_the_context(h):
    """300 turns (a long phone call: text, audio, a tool call and its output) against a
    thinker whose context holds about a dozen: every answer completes; the oldest whole
    turns leave the conversation (`conversation.item.deleted`), a call with its output
    together; what the server holds stays bounded."""
    h.engine("thinker").max_model_len = 400
    events: list = []
    sizes = []
    async with sdk(h).realtime.connect(model="gpt-realtime") as conn:
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "audio": {"input": {"turn_detection": None}}})
        call_ids = set()
        for turn in range(300):
            if turn % 7 == 3:
                item = {"type": "message", "role": "user",
                        "content": [{"type": "input_audio", "audio": base64.b64encode(tone(0.3)).decode()}]}
            else:
                item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"{turn}: {SENTENCE}"}]}
            done = await _turn(conn, events, item)
            assert done.status == "completed", (turn, done.status_details)
            if turn == 5:  # a tool round trip early in the call
                await conn.conversation.item.create(item={"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{}"})
                await conn.conversation.item.create(item={"type": "function_call_output", "call_id": "call_1", "output": "order 42"})
            for ev in events:
                if ev.type == "conversation.item.added" and getattr(ev.item, "type", None) in ("function_call", "function_call_output"):
                    call_ids.add(ev.item.id)
            sizes.append(len(conversation_of(h).items))
    deleted = [ev.item_id for ev in events if ev.type == "conversation.item.deleted"]
    assert len(deleted) > 200
    assert call_ids and call_ids <= set(deleted)  # the call and its output went, together
    # bounded, not growing: the context holds a dozen turns (two items each, an answer and a question)
    assert max(sizes[100:]) <= 60 and max(sizes[250:]) <= max(sizes[100:150]) + 4, (sizes[100:150], sizes[250:])
    conv_items = conversation_of(h).items if [s for s in h.sessions.sessions() if s.kind == "realtime"] else {}
    assert not set(deleted) & set(conv_items)


async def test_disabled_truncation_fails_as_before_and_retention_ratio_truncates_before_the_limit(h):
    h.engine("thinker").max_model_len = 400
    ws = await connect(h, "/v1/realtime?model=gpt-realtime")
    await ws.until("session.created")
    await ws.send("session.update", session={"type": "realtime", "truncation": "disabled", "output_modalities": ["text"],
                                             "audio": {"input": {"turn_detection": None}}})
    assert (await ws.until("session.updated"))["session"]["truncation"] == "disabled"
    for _ in range(40):
        await ws.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": SENTENCE}]})
        await ws.send("response.create", response={"max_output_tokens": 2})
        done = (await ws.until("response.done"))["response"]
        if done["status"] == "failed":
            assert done["status_details"]["error"]["code"] == "context_length_exceeded"
            break
    else:
        raise AssertionError("the conversation never passed the context")
    assert "conversation.item.deleted" not in ws.types()
    # retention_ratio with a post-instructions limit: the oldest turns go before the
    # context refuses anything, down to half the limit
    ratio = {"type": "retention_ratio", "retention_ratio": 0.5, "token_limits": {"post_instructions": 150}}
    await ws.send("session.update", session={"type": "realtime", "truncation": ratio})
    assert (await ws.until("session.updated"))["session"]["truncation"] == ratio
    await ws.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "and now?"}]})
    await ws.send("response.create", response={"max_output_tokens": 2})
    done = (await ws.until("response.done"))["response"]
    assert done["status"] == "completed"
    assert "conversation.item.deleted" in ws.types()
    assert done["usage"]["input_tokens"] < 150
    await ws.ws.close()


@pytest.mark.parametrize("bad", ["sometimes", {"type": "retention_ratio", "retention_ratio": 1.5}, {"type": "keep_all"}])
async def test_bad_truncation_is_an_error_naming_the_field(h, bad):
    ws = await connect(h, "/v1/realtime?model=gpt-realtime")
    await ws.until("session.created")
    await ws.send("session.update", session={"type": "realtime", "truncation": bad})
    err = (await ws.until("error"))["error"]
    assert err["param"].startswith("session.truncation"), err
    await ws.ws.close()


async def test_noise_reduction_is_refused_by_name_not_echoed(h):
    ws = await connect(h, "/v1/realtime?model=gpt-realtime")
    await ws.until("session.created")
    await ws.send("session.update", session={"type": "realtime", "audio": {"input": {"noise_reduction": {"type": "near_field"}}}})
    err = (await ws.until("error"))["error"]
    assert err["param"] == "session.audio.input.noise_reduction" and "noise reduction" in err["message"]
    await ws.send("session.update", session={"type": "realtime", "audio": {"input": {"noise_reduction": None}}})
    assert (await ws.until("session.updated"))["session"]["audio"]["input"]["noise_reduction"] is None
    await ws.ws.close()


async def test_a_silent_caller_is_nudged_after_idle_timeout_ms(h):
    """server_vad with idle_timeout_ms: after the answer's audio played, that long with no
    speech commits the silence (`timeout_triggered`, `committed`) and answers it; speech
    before then cancels the nudge."""
    ws = await connect(h, "/v1/realtime?model=gpt-realtime")
    await ws.until("session.created")
    td = {"type": "server_vad", "silence_duration_ms": 300, "idle_timeout_ms": 2000}
    await ws.send("session.update", session={"type": "realtime", "max_output_tokens": 4, "audio": {"input": {"turn_detection": td}}})
    assert (await ws.until("session.updated"))["session"]["audio"]["input"]["turn_detection"]["idle_timeout_ms"] == 2000

    async def stream(pcm: bytes) -> None:
        for i in range(0, len(pcm), 4800):
            await ws.send("input_audio_buffer.append", audio=b64(pcm[i : i + 4800]))

    await stream(quiet(3.0))  # nothing answered yet: no idle timer
    assert "input_audio_buffer.timeout_triggered" not in ws.types()
    await stream(tone(0.5) + quiet(0.5))
    first = await ws.until("response.done")
    audio_ms = sum(len(base64.b64decode(e["delta"])) // 48 for e in ws.seen if e["type"] == "response.output_audio.delta")
    assert first["response"]["status"] == "completed" and audio_ms > 0
    n = len(ws.seen)
    await stream(quiet(1.0) + tone(0.4) + quiet(0.5))  # the caller speaks before the timeout: answered, no nudge
    await ws.until("response.done")
    assert "input_audio_buffer.timeout_triggered" not in ws.types()[n:]
    n = len(ws.seen)
    await stream(quiet(2.0 + audio_ms / 1000 + 0.5))
    trig = await ws.until("input_audio_buffer.timeout_triggered")
    assert trig["audio_end_ms"] - trig["audio_start_ms"] >= 2000
    committed = await ws.until("input_audio_buffer.committed")
    assert committed["item_id"] == trig["item_id"]
    assert (await ws.until("response.done"))["response"]["status"] == "completed"
    t = ws.types()[n:]
    assert t.index("input_audio_buffer.timeout_triggered") < t.index("input_audio_buffer.committed") < t.index("response.created")
    assert "input_audio_buffer.speech_started" not in t
    # a bad value names the field
    await ws.send("session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 5}}}})
    assert (await ws.until("error"))["error"]["param"] == "session.audio.input.turn_detection.idle_timeout_ms"
    await ws.ws.close()


def _png(w: int = 40, h: int = 30, seed: int = 0) -> str:
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype(np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def test_an_image_is_refused_with_an_error_naming_the_profile_whose_thinker_sees_none():
    """The cascade profile's thinker is a text LM: an image is refused, naming the
    pipeline and profile, and nothing is half-added."""
    async with serve(["voice"], {"pipelines": {"voice": {"profile": "cascade"}}}) as h:
        ws = await connect(h, "/v1/realtime?model=gpt-realtime")
        await ws.until("session.created")
        image = {"type": "input_image", "image_url": _png()}
        await ws.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "look"}, image]})
        err = (await ws.until("error"))["error"]
        assert err["code"] == "unsupported_content" and err["param"] == "item.content[1].type", err
        assert "'voice' pipeline ('cascade' profile)" in err["message"]
        assert "conversation.item.added" not in ws.types()  # nothing half-added
        await ws.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]})
        await ws.until("conversation.item.added")  # the session goes on
        await ws.ws.close()


async def test_images_reach_the_thinker_through_the_sdk_the_latest_four_a_prompt(h):
    """input_image on the default profile (its Qwen2.5-Omni thinker sees images):
    through the openai SDK, the item comes back as sent (its type validated by the SDK),
    the prompt holds a placeholder per image with the images beside it in order; past
    the thinker's 4 a prompt, the oldest are left out of it (still in the history)."""
    from omni_rt.payloads import IMAGE_PLACEHOLDER

    urls = [_png(seed=i) for i in range(6)]
    async with sdk(h).realtime.connect(model="gpt-realtime") as conn:
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "audio": {"input": {"turn_detection": None}}})
        events: list = []
        done = await _turn(conn, events, {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "What is in"}, {"type": "input_image", "image_url": urls[0], "detail": "low"}, {"type": "input_text", "text": "this?"}]})
        assert done.status == "completed"
        added = [e for e in events if e.type == "conversation.item.added" and e.item.role == "user"]
        part = added[0].item.content[1]
        assert part.type == "input_image" and part.image_url == urls[0] and part.detail == "low"
        seen = h.processor("thinker").seen[-1]
        assert seen["params"]["images"] == [urls[0]]
        assert seen["messages"][-1]["content"] == f"What is in {IMAGE_PLACEHOLDER} this?"
        for u in urls[1:]:
            done = await _turn(conn, events, {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": u}]})
            assert done.status == "completed"
        assert len([it for it in conversation_of(h).items.values() if it.images()]) == 6  # the history keeps them all
    seen = h.processor("thinker").seen[-1]
    assert seen["params"]["images"] == urls[2:]  # the latest four
    prompt = " ".join(m["content"] for m in seen["messages"])
    assert prompt.count(IMAGE_PLACEHOLDER) == 4 and "What is in this?" in prompt


@pytest.mark.parametrize(("url", "says"), [
    ("data:image/png;base64,iVBORw0KGgo=", "cannot be read as an image"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("https://example.com/cat.png", "fetches nothing"),
    ("data:image/tiff;base64,AAAA", "image/tiff"),
    ("", "data URL"),
])
async def test_a_bad_image_is_the_clients_error_on_its_event(h, url, says):
    ws = await connect(h, "/v1/realtime?model=gpt-realtime")
    await ws.until("session.created")
    await ws.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": url}]})
    err = (await ws.until("error"))["error"]
    assert err["code"] == "invalid_value" and err["param"] == "item.content[0].image_url" and says in err["message"], err
    assert "conversation.item.added" not in ws.types()
    await ws.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": _png()}]})
    await ws.until("conversation.item.added")  # the next good one is taken
    await ws.ws.close()
