"""/v1/realtime semantics in-process (testkit: the real app over fake engines,
EnergyVad): event sequences in both dialects, turns and history, cancel, truncate,
barge-in, bad input, caps, faults."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest

from omni_rt.errors import ConnectorError
from protocols.realtime import AUDIO_PLACEHOLDER, Conversation
from testkit import serve
from testkit.wire import Events, b64, barge_in, connect, quiet, tone

BETA = {"openai-beta": "realtime=v1"}
BETA_ONLY = {"response.audio.delta", "response.audio.done", "response.audio_transcript.delta",
             "response.audio_transcript.done", "response.text.delta", "response.text.done", "conversation.item.created"}
GA_ONLY = {"response.output_audio.delta", "response.output_audio.done", "response.output_audio_transcript.delta",
           "response.output_audio_transcript.done", "response.output_text.delta", "response.output_text.done",
           "conversation.item.added", "conversation.item.done"}


@pytest.fixture
async def h():
    async with serve(["voice"], {"sessions": {"max_per_kind": {"realtime": 3}}}) as harness:
        yield harness


async def session(h, beta: bool = False, manual: bool = True) -> Events:
    ws = await connect(h, "/v1/realtime?model=gpt-realtime", BETA if beta else None)
    assert (await ws.until("session.created"))["session"]["id"].startswith("sess_")
    if manual:
        body = {"turn_detection": None} if beta else {"type": "realtime", "audio": {"input": {"turn_detection": None}}}
        await ws.send("session.update", session=body)
        await ws.until("session.updated")
    return ws


async def say(ws: Events, text: str) -> None:
    await ws.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})


@pytest.mark.parametrize("beta", [False, True])
async def test_text_turn_event_sequence_ids_and_dialect(h, beta):
    ws = await session(h, beta)
    await say(ws, "Hello!")
    await ws.send("response.create", response={"modalities" if beta else "output_modalities": ["text"], "max_output_tokens": 5})
    done = await ws.until("response.done")
    types = ws.types()
    item = "conversation.item.created" if beta else "conversation.item.added"
    text = "response.text.delta" if beta else "response.output_text.delta"
    i = types.index("response.created")
    assert types[i : i + 4] == ["response.created", "response.output_item.added", item, "response.content_part.added"]
    deltas = [e for e in ws.seen if e["type"] == text]
    assert len(deltas) == 5
    rid, iid = done["response"]["id"], done["response"]["output"][0]["id"]
    assert all(d["response_id"] == rid and d["item_id"] == iid for d in deltas)
    text_done = next(e for e in ws.seen if e["type"] == text.replace("delta", "done"))
    assert text_done["text"] == "".join(d["delta"] for d in deltas)
    assert done["response"]["status"] == "completed" and done["response"]["usage"]["output_tokens"] == 5
    assert not set(types) & (GA_ONLY if beta else BETA_ONLY)
    ids = [e["event_id"] for e in ws.seen]
    assert len(set(ids)) == len(ids)


async def test_audio_turns_are_encoded_heard_and_kept_in_history(h):
    ws = await session(h)
    for turn in range(2):
        for _ in range(5):  # 1 s of audio in 200 ms appends
            await ws.send("input_audio_buffer.append", audio=b64(tone(0.2)))
        await ws.send("input_audio_buffer.commit")
        await ws.send("response.create", response={"max_output_tokens": 6})
        done = await ws.until("response.done")
        assert done["response"]["status"] == "completed"
        assert done["response"]["usage"]["input_token_details"]["audio_tokens"] == 25  # 1 s in 40 ms rows
        if turn == 0:
            first = [e for e in ws.seen if e["type"] == "response.output_audio.delta"]
            assert first and ws.types().index("input_audio_buffer.committed") < ws.types().index("response.created")
    seen = h.processor("thinker").seen
    assert [s["audio_rows"] for s in seen] == [25, 25]
    # the second prompt carries the first turn: its answer and the first utterance
    assert len(seen[1]["messages"]) == len(seen[0]["messages"]) + 2
    assert seen[1]["messages"][1]["role"] == "assistant" and seen[1]["messages"][1]["content"].startswith("w")


async def test_cancel_mid_response_then_nothing_of_it_follows(h):
    ws = await session(h)
    await say(ws, "Tell me a long story")
    await ws.send("response.create", response={"max_output_tokens": 400})
    delta = await ws.until("response.output_audio.delta")
    await ws.send("response.cancel")
    done = await ws.until("response.done")
    assert done["response"]["id"] == delta["response_id"]
    assert done["response"]["status"] == "cancelled" and done["response"]["status_details"]["reason"] == "client_cancelled"
    assert done["response"]["output"][0]["status"] == "incomplete"
    await ws.send("response.cancel")
    assert (await ws.until("error"))["error"]["code"] == "response_cancel_not_active"
    assert not [e for e in ws.seen[ws.seen.index(done) :] if e.get("response_id") == done["response"]["id"]]
    assert h.runtime.orchestrator.running() == []


async def test_a_cancel_right_after_a_commit_keeps_the_whole_utterance(h):
    """The commit's encoder request is not fenced: cancelling the answer that is still
    running (its epoch advances) while the utterance is being encoded loses none of it."""
    ws = await session(h)
    await say(ws, "Talk")
    await ws.send("response.create", response={"max_output_tokens": 400})
    await ws.until("response.output_audio.delta")
    await ws.send("input_audio_buffer.append", audio=b64(tone(1.0)))
    await ws.send("input_audio_buffer.commit")
    await ws.send("response.cancel")  # right behind the commit
    assert (await ws.until("response.done"))["response"]["status"] == "cancelled"
    await ws.send("response.create", response={"output_modalities": ["text"], "max_output_tokens": 2})
    done = await ws.until("response.done")
    assert done["response"]["usage"]["input_token_details"]["audio_tokens"] == 25


async def test_truncate_clamps_accepts_duplicates_and_keeps_the_heard_transcript(h):
    ws = await session(h)
    await say(ws, "Talk")
    await ws.send("response.create", response={"max_output_tokens": 8})
    done = await ws.until("response.done")
    item_id = done["response"]["output"][0]["id"]
    sent_ms = sum(len(base64.b64decode(e["delta"])) for e in ws.seen if e["type"] == "response.output_audio.delta") * 1000 // 48000
    for _ in range(2):
        await ws.send("conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=10_000_000)
        assert (await ws.until("conversation.item.truncated"))["audio_end_ms"] == sent_ms
    await ws.send("conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=0)
    assert (await ws.until("conversation.item.truncated"))["audio_end_ms"] == 0
    await say(ws, "And?")
    await ws.send("response.create", response={"max_output_tokens": 2})
    await ws.until("response.done")
    # the answer the user did not hear is not in the next prompt
    assert [m["role"] for m in h.processor("thinker").seen[-1]["messages"]] == ["user", "user"]
    await ws.send("conversation.item.truncate", item_id="item_nope", content_index=0, audio_end_ms=0)
    assert (await ws.until("error"))["error"]["code"] == "item_not_found"


BAD = [
    ("not json", "invalid_json", None),
    (json.dumps([1, 2]), "invalid_json", None),
    (json.dumps({"type": "no.such.event", "event_id": "e1"}), "invalid_value", "type"),
    (json.dumps({"event_id": "e2"}), "missing_required_parameter", "type"),
    (json.dumps({"type": "input_audio_buffer.append"}), "missing_required_parameter", "audio"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": 5}), "invalid_type", "audio"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "***"}), "invalid_value", "audio"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": b64(b"abc")}), "invalid_value", "audio"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (21 * 1024 * 1024)}), "invalid_value", "audio"),
    (json.dumps({"type": "input_audio_buffer.commit"}), "input_audio_buffer_commit_empty", None),
    (json.dumps({"type": "session.update"}), "missing_required_parameter", "session"),
    (json.dumps({"type": "session.update", "session": 5}), "invalid_type", "session"),
    (json.dumps({"type": "session.update", "session": {"voice": "nobody"}}), "invalid_value", "session.voice"),
    (json.dumps({"type": "session.update", "session": {"turn_detection": {"threshold": "high"}}}), "invalid_type", "session.turn_detection.threshold"),
    (json.dumps({"type": "session.update", "session": {"turn_detection": {"threshold": 2}}}), "invalid_value", "session.turn_detection.threshold"),
    (json.dumps({"type": "session.update", "session": {"turn_detection": {"type": "semantic_vad", "eagerness": "eager"}}}), "invalid_value",
     "session.turn_detection.eagerness"),
    (json.dumps({"type": "session.update", "session": {"turn_detection": {"type": "push_to_talk"}}}), "invalid_value", "session.turn_detection.type"),
    (json.dumps({"type": "session.update", "session": {"audio": {"input": 5}}}), "invalid_type", "session.audio.input"),
    (json.dumps({"type": "session.update", "session": {"audio": {"output": [1]}}}), "invalid_type", "session.audio.output"),
    (json.dumps({"type": "conversation.item.retrieve", "item_id": "nope", "event_id": "e9"}), "item_retrieve_invalid_item_id", "item_id"),
    (json.dumps({"type": "response.create", "response": {"metadata": {"k": 5}}}), "invalid_type", "response.metadata"),
    (json.dumps({"type": "response.create", "response": {"metadata": {str(i): "v" for i in range(17)}}}), "invalid_value", "response.metadata"),
    (json.dumps({"type": "session.update", "session": {"input_audio_format": "opus"}}), "invalid_value", "session.input_audio_format"),
    (json.dumps({"type": "session.update", "session": {"audio": {"output": {"format": {"type": "audio/pcm", "rate": 16000}}}}}), "invalid_value",
     "session.audio.output.format"),
    (json.dumps({"type": "session.update", "session": {"temperature": 0.2}}), "invalid_value", "session.temperature"),
    (json.dumps({"type": "session.update", "session": {"temperature": "hot"}}), "invalid_type", "session.temperature"),
    (json.dumps({"type": "session.update", "session": {"max_output_tokens": 0}}), "invalid_value", "session.max_output_tokens"),
    (json.dumps({"type": "response.create", "response": {"temperature": 2}}), "invalid_value", "response.temperature"),
    (json.dumps({"type": "response.create", "response": "now"}), "invalid_type", "response"),
    (json.dumps({"type": "conversation.item.create"}), "missing_required_parameter", "item"),
    (json.dumps({"type": "conversation.item.create", "item": {"role": "robot", "content": []}}), "invalid_value", "item.role"),
    (json.dumps({"type": "conversation.item.create", "item": {"role": "user", "content": [{"type": "image"}]}}), "invalid_value",
     "item.content[0].type"),
    (json.dumps({"type": "conversation.item.delete", "item_id": "nope"}), "item_not_found", "item_id"),
    (json.dumps({"type": "conversation.item.truncate", "item_id": "nope", "audio_end_ms": 5}), "item_not_found", "item_id"),
    (json.dumps({"type": "response.cancel"}), "response_cancel_not_active", None),
]


async def test_bad_input_gets_error_events_in_openai_shape_and_the_socket_stays_open(h):
    ws = await session(h, manual=False)
    for frame, code, param in BAD:
        await ws.ws.send_str(frame)
        ev = await ws.until("error")
        assert ev["error"]["code"] == code, (frame[:70], ev)
        assert ev["error"]["param"] == param, (frame[:70], ev)
        assert set(ev["error"]) == {"type", "code", "message", "param", "event_id"}
    await ws.send("no.such.event", event_id="evt_42")
    assert (await ws.until("error"))["error"]["event_id"] == "evt_42"
    # still serving: a real turn works, and a second response.create while one runs is refused
    await ws.send("session.update", session={"turn_detection": None})
    await ws.until("session.updated")
    await say(ws, "hi")
    await ws.send("response.create", response={"max_output_tokens": 50})
    await ws.send("response.create")
    assert (await ws.until("error"))["error"]["code"] == "conversation_already_has_active_response"
    assert (await ws.until("response.done"))["response"]["status"] == "completed"


async def test_over_the_cap_an_error_event_then_close_1013(h):
    open_ = [await session(h) for _ in range(3)]
    extra = await connect(h, "/v1/realtime")
    ev = await extra.until("error")
    assert ev["error"]["code"] == "session_limit" and ev["error"]["type"] == "requests"
    await extra.until("connection.closed")
    assert extra.closed is not None and extra.closed[0] == 1013
    await open_[0].ws.close()
    for _ in range(100):  # the slot comes back when the first session has been freed
        if h.sessions.health()["local"] == 2:
            break
        await asyncio.sleep(0.005)
    again = await session(h)
    await again.ws.close()


async def test_over_real_time_capacity_a_capacity_error_event_then_close_1013():
    """Load-aware admission on the wire: with a prior cost of 0.3 RTF a session and
    nothing measured yet, two sessions fit under 0.65 and the third is refused."""
    overlay = {"sessions": {"realtime_admission": {"session_cost_rtf": 0.3, "window_s": 0.5}}}
    async with serve(["voice"], overlay) as h2:
        open_ = [await session(h2) for _ in range(2)]
        extra = await connect(h2, "/v1/realtime")
        ev = await extra.until("error")
        assert ev["error"]["code"] == "capacity" and ev["error"]["type"] == "requests"
        assert "real-time capacity" in ev["error"]["message"]
        await extra.until("connection.closed")
        assert extra.closed is not None and extra.closed[0] == 1013
        assert h2.sessions.health()["realtime_admission"]["refusing"] is True
        for i, ws in enumerate(open_):
            await ws.ws.close()
            for _ in range(200):
                if h2.sessions.realtime_sessions() == 1 - i:
                    break
                await asyncio.sleep(0.005)
            if i == 0:  # 2 × 0.3 = 0.6 fits the target, not 0.65 - 0.1: the hysteresis holds
                shut = await connect(h2, "/v1/realtime")
                assert (await shut.until("error"))["error"]["code"] == "capacity"
        again = await session(h2)  # none left: admitted again
        assert h2.sessions.health()["realtime_admission"]["refusing"] is False
        await again.ws.close()


async def test_server_vad_turn(h):
    ws = await session(h, manual=False)
    await ws.send("session.update", session={"type": "realtime", "max_output_tokens": 4})
    await ws.until("session.updated")
    audio = quiet(0.6) + tone(0.8) + quiet(0.8)
    for i in range(0, len(audio), 4800):
        await ws.send("input_audio_buffer.append", audio=b64(audio[i : i + 4800]))
    done = await ws.until("response.done")
    t = ws.types()
    i_start, i_stop = t.index("input_audio_buffer.speech_started"), t.index("input_audio_buffer.speech_stopped")
    i_commit, i_created = t.index("input_audio_buffer.committed"), t.index("response.created")
    assert i_start < i_stop < i_commit < t.index("conversation.item.added") < i_created
    started, stopped, committed = ws.seen[i_start], ws.seen[i_stop], ws.seen[i_commit]
    assert started["item_id"] == stopped["item_id"] == committed["item_id"]
    assert started["audio_start_ms"] == 600 - 300  # the 300 ms prefix padding is part of the utterance
    assert 1400 <= stopped["audio_end_ms"] <= 1410
    assert done["response"]["status"] == "completed"
    # the utterance: ~300 ms of padding + 800 ms of speech + the 500 ms of silence that
    # ended it (to the 100 ms appends' edges), in 40 ms rows
    assert 37 <= done["response"]["usage"]["input_token_details"]["audio_tokens"] <= 40


async def test_barge_in_cancels_the_answer_and_nothing_stale_follows(h):
    ws = await session(h, manual=False)
    rid, done, second, stale = await barge_in(ws)
    assert done["response"]["id"] == rid and done["response"]["status"] == "cancelled"
    assert done["response"]["status_details"]["reason"] == "turn_detected"
    assert ws.types().index("input_audio_buffer.speech_started") < ws.types().index("response.done")
    assert second["response"]["id"] != rid and second["response"]["status"] == "completed"
    assert stale == []


async def test_disconnect_mid_answer_frees_every_request_and_the_session(h):
    ws = await session(h)
    await say(ws, "Tell me a long story")
    await ws.send("response.create", response={"max_output_tokens": 400})
    await ws.until("response.output_audio.delta")
    assert h.runtime.orchestrator.running()
    await ws.ws.close()
    for _ in range(200):
        if not h.runtime.orchestrator.running() and not h.sessions.sessions():
            break
        await asyncio.sleep(0.005)
    assert h.runtime.orchestrator.running() == [] and h.sessions.sessions() == []
    assert sum(p.load() for p in h.runtime.pools.values()) == 0


async def test_an_audio_item_with_a_transcript_gets_its_speech_at_its_own_place(h):
    """The item that holds the latest encoded speech marks its place in the prompt
    even when the client also gave a transcript (the speech used to be spliced in at
    an older item's placeholder, or in a user message of its own)."""
    ws = await session(h)
    await ws.send("input_audio_buffer.append", audio=b64(tone(0.5)))
    await ws.send("input_audio_buffer.commit")  # an older audio turn, no transcript
    await ws.until("conversation.item.done")
    await ws.send("conversation.item.create", item={"type": "message", "role": "user", "content": [
        {"type": "input_audio", "audio": b64(tone(1.0)), "transcript": "what the user said"}]})
    await ws.until("conversation.item.done")
    await ws.send("response.create", response={"max_output_tokens": 2})
    await ws.until("response.done")
    seen = h.processor("thinker").seen[-1]
    assert seen["audio_rows"] == 25  # the newer utterance's speech
    # the speech goes in at the last placeholder: the newer item's own (the older turn,
    # with no transcript, keeps its bare marker)
    assert [m["content"] for m in seen["messages"]] == [AUDIO_PLACEHOLDER, AUDIO_PLACEHOLDER]


async def test_encoder_tasks_do_not_pile_up_over_a_long_session(h):
    ws = await session(h)
    for _ in range(5):
        await ws.send("input_audio_buffer.append", audio=b64(tone(0.2)))
        await ws.send("input_audio_buffer.commit")
        await ws.until("conversation.item.done")
    conv = h.sessions.sessions()[0].kept(Conversation)
    for _ in range(100):
        if not conv.input.collecting:
            break
        await asyncio.sleep(0.005)
    assert conv.input.collecting == set()


async def test_a_fault_in_the_server_is_an_error_event_then_1011_not_a_silent_disconnect(h, monkeypatch):
    """A core error inside the adapter (not a RuntimeError any more) is a fault of
    ours: the client hears a generic error and the socket closes 1011."""
    from protocols.realtime.conversation import Conversation

    def broken(self, ev):
        raise ConnectorError("handle lost: the object omni_rt_xyz is gone")

    monkeypatch.setattr(Conversation, "item_delete", broken)
    ws = await session(h)
    await ws.send("conversation.item.delete", item_id="x")
    ev = await ws.until("error")
    assert ev["error"]["type"] == "server_error" and ev["error"]["message"] == "internal error"
    await ws.until("connection.closed")
    assert ws.closed is not None and ws.closed[0] == 1011
    for _ in range(100):
        if not h.sessions.sessions():
            break
        await asyncio.sleep(0.005)
    assert h.sessions.sessions() == []


async def test_a_dead_engine_is_told_and_the_socket_goes_on(h):
    ws = await session(h)
    h.engine("thinker").mark_dead("test: the engine process died")
    await say(ws, "Hello")
    await ws.send("response.create")
    ev = await ws.until("error")
    assert ev["error"]["code"] == "engine_unavailable"
    r = await h.client.get("/health")
    assert r.status == 503 and (await r.json())["unhealthy_stages"] == ["thinker"]
    await say(ws, "Still there?")
    assert (await ws.until("conversation.item.done"))["item"]["role"] == "user"
