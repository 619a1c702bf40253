"""Function calling, in-process over the fakes: session and per-response tools on
/v1/realtime (GA and beta), /v1/duplex and /v1/chat/completions, the function_call
and function_call_output items, cancel during a call's arguments, a call cut by
max_output_tokens, and every kind of bad tool input. Every realtime event is
validated against the openai SDK's own pydantic types (the dialect's)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from pydantic import TypeAdapter

from protocols.tools import MAX_SCHEMA_CHARS, MAX_TOOLS
from testkit import Speeds, serve
from testkit.wire import Events, b64, connect, quiet, tone

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER}
TIME = {"type": "function", "name": "get_time", "description": "The time.", "parameters": {"type": "object", "properties": {}}}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER}}


def adapter(beta: bool) -> TypeAdapter:
    if beta:
        from openai.types.beta.realtime import RealtimeServerEvent as BetaEvent

        return TypeAdapter(BetaEvent)
    from openai.types.realtime import RealtimeServerEvent

    return TypeAdapter(RealtimeServerEvent)


def conforms(ws: Events, beta: bool) -> None:
    """Every event seen is one of the SDK's server events, field for field."""
    ta = adapter(beta)
    for ev in ws.seen:
        if ev["type"] in ("connection.closed", "audio.binary"):
            continue
        ta.validate_python({"event_id": "evt_test", **ev})


@pytest.fixture
async def h():
    async with serve(["voice", "tts"]) as harness:
        yield harness


async def session(h, beta: bool = False, **update: Any) -> Events:
    ws = await connect(h, "/v1/realtime?model=gpt-realtime", {"openai-beta": "realtime=v1"} if beta else {})
    await ws.until("session.created")
    body = dict(update) if beta else {"type": "realtime", **update}
    await ws.send("session.update", session=body)
    await ws.until("session.updated", "error")
    return ws


async def say(ws: Events, text: str) -> None:
    await ws.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})


def thinker_saw(h) -> list[dict[str, Any]]:
    return h.processor("thinker").seen


@pytest.mark.parametrize("beta", [False, True])
async def test_a_forced_call_streams_its_arguments_and_makes_no_audio(h, beta):
    ws = await session(h, beta, tools=[TOOL], tool_choice="required")
    updated = [e for e in ws.seen if e["type"] == "session.updated"][-1]["session"]
    assert updated["tools"] == [TOOL] and updated["tool_choice"] == "required"
    await say(ws, "What is the weather in Paris?")
    await ws.send("response.create")
    done = (await ws.until("response.done"))["response"]
    types = ws.types()
    assert done["status"] == "completed", done
    (call,) = done["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "completed"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER)
    deltas = [e for e in ws.seen if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(d["delta"] for d in deltas) == call["arguments"]
    assert {d["call_id"] for d in deltas} == {call["call_id"]} and {d["item_id"] for d in deltas} == {call["id"]}
    args_done = next(e for e in ws.seen if e["type"] == "response.function_call_arguments.done")
    assert (args_done["arguments"], args_done["name"], args_done["output_index"]) == (call["arguments"], "get_weather", 0)
    # the item's life: added, its arguments, done; then the response; no message, no audio
    order = [t for t in types if t.startswith("response.") and "delta" not in t]
    assert order == ["response.created", "response.output_item.added", "response.function_call_arguments.done",
                     "response.output_item.done", "response.done"], order
    assert not any("audio" in t or "content_part" in t or "text" in t for t in types), types
    conforms(ws, beta)


async def test_the_result_joins_the_conversation_and_the_next_response_answers_it(h):
    ws = await session(h, tools=[TOOL], tool_choice="required")
    await say(ws, "Weather in Lima for two days?")
    await ws.send("response.create")
    call = (await ws.until("response.done"))["response"]["output"][0]
    await ws.send("conversation.item.create", item={"type": "function_call_output", "call_id": call["call_id"], "output": '{"temp_c": 19}'})
    added = await ws.until("conversation.item.added")
    assert added["item"]["type"] == "function_call_output" and added["item"]["call_id"] == call["call_id"]
    assert added["previous_item_id"] == call["id"]
    # this response may not call again: it answers, out loud
    await ws.send("response.create", response={"tool_choice": "none"})
    done = (await ws.until("response.done"))["response"]
    assert done["status"] == "completed" and [o["type"] for o in done["output"]] == ["message"]
    assert any(e["type"] == "response.output_audio.delta" for e in ws.seen)
    seen = thinker_saw(h)[-1]
    msgs, params = seen["messages"], seen["params"]
    assert params["tool_choice"] == "none"
    assistant = next(m for m in msgs if m.get("tool_calls"))
    assert assistant["tool_calls"] == [{"id": call["call_id"], "type": "function", "function": {"name": "get_weather", "arguments": call["arguments"]}}]
    tool = msgs[msgs.index(assistant) + 1]
    assert tool == {"role": "tool", "content": '{"temp_c": 19}', "tool_call_id": call["call_id"], "name": "get_weather"}
    conforms(ws, False)


async def test_function_items_can_be_retrieved_deleted_and_replayed(h):
    ws = await session(h, tools=[TOOL, TIME])
    # a client replaying history puts the call and its output in itself
    await ws.send("conversation.item.create", item={"type": "function_call", "id": "item_fc1", "call_id": "call_1", "name": "get_time", "arguments": "{}"})
    await ws.until("conversation.item.added")
    await ws.send("conversation.item.create", item={"type": "function_call_output", "id": "item_out1", "call_id": "call_1", "output": "noon"})
    await ws.until("conversation.item.added")
    await ws.send("conversation.item.retrieve", item_id="item_fc1")
    got = (await ws.until("conversation.item.retrieved"))["item"]
    assert (got["type"], got["call_id"], got["name"], got["arguments"]) == ("function_call", "call_1", "get_time", "{}")
    await ws.send("conversation.item.truncate", item_id="item_fc1", content_index=0, audio_end_ms=0)
    assert (await ws.until("error"))["error"]["param"] == "item_id"  # only audio answers are truncated
    await ws.send("conversation.item.delete", item_id="item_out1")
    await ws.until("conversation.item.deleted")
    await ws.send("response.create", response={"tool_choice": {"type": "function", "name": "get_time"}})
    done = (await ws.until("response.done"))["response"]
    assert done["output"][0]["name"] == "get_time" and done["output"][0]["arguments"] == "{}"
    msgs = thinker_saw(h)[-1]["messages"]
    assert [m["role"] for m in msgs] == ["assistant"] and msgs[0]["tool_calls"][0]["id"] == "call_1"
    conforms(ws, False)


async def test_response_overrides_take_tools_choice_and_instructions_for_one_response(h):
    ws = await session(h, tools=[TOOL], instructions="Session instructions.")
    await say(ws, "hi")
    await ws.send("response.create", response={"tools": [TIME], "tool_choice": "required", "instructions": "Call get_time."})
    done = (await ws.until("response.done"))["response"]
    assert done["output"][0]["name"] == "get_time"
    seen = thinker_saw(h)[-1]
    assert [t["function"]["name"] for t in seen["params"]["tools"]] == ["get_time"]
    assert seen["messages"][0] == {"role": "system", "content": "Call get_time."}
    # the session's own settings are untouched: the next response is auto over get_weather
    await ws.send("response.create", response={"max_output_tokens": 3})
    await ws.until("response.done")
    seen = thinker_saw(h)[-1]
    assert seen["params"]["tool_choice"] == "auto" and [t["function"]["name"] for t in seen["params"]["tools"]] == ["get_weather"]


async def test_cancel_during_a_calls_arguments_sends_nothing_more_of_it():
    async with serve(["voice"], speeds=Speeds(token_s=0.05)) as h:
        ws = await session(h, tools=[TOOL], tool_choice="required")
        await say(ws, "weather?")
        await ws.send("response.create")
        first = await ws.until("response.function_call_arguments.delta")
        await ws.send("response.cancel")
        done = (await ws.until("response.done"))["response"]
        mark = ws.seen.index(next(e for e in ws.seen if e["type"] == "response.done"))
        assert done["status"] == "cancelled" and done["status_details"]["reason"] == "client_cancelled"
        assert done["output"] == []  # the half call is not part of the answer
        before = ws.types()[:mark]
        assert "response.function_call_arguments.done" not in before and "response.output_item.done" not in before
        assert any(e["type"] == "conversation.item.deleted" and e["item_id"] == first["item_id"] for e in ws.seen)
        # nothing of it follows, and the conversation goes on without it
        await ws.send("conversation.item.retrieve", item_id=first["item_id"])
        assert (await ws.until("error"))["error"]["code"] == "item_retrieve_invalid_item_id"
        assert not [e for e in ws.seen[mark:] if e.get("response_id") == done["id"]]
        conforms(ws, False)


async def test_barge_in_during_a_calls_arguments_cancels_it():
    """Server VAD on: the user speaks, a forced call starts streaming, the user talks
    over it. The call is cancelled (turn_detected) and nothing of it is sent after."""
    async with serve(["voice"], speeds=Speeds(token_s=0.05)) as h:
        ws = await session(h, tools=[TOOL], tool_choice="required")
        for chunk in (quiet(0.2), tone(0.4), quiet(0.6)):
            await ws.send("input_audio_buffer.append", audio=b64(chunk))
        first = await ws.until("response.function_call_arguments.delta", timeout=10)
        await ws.send("input_audio_buffer.append", audio=b64(tone(0.3)))  # the user cuts in
        done = (await ws.until("response.done"))["response"]
        assert done["id"] == first["response_id"], done
        assert done["status"] == "cancelled" and done["status_details"]["reason"] == "turn_detected" and done["output"] == []
        mark = len(ws.seen)
        assert "response.function_call_arguments.done" not in ws.types()
        await ws.send("input_audio_buffer.append", audio=b64(quiet(0.6)))  # the next turn: a whole call
        nxt = (await ws.until("response.done", timeout=10))["response"]
        assert nxt["status"] == "completed" and nxt["output"][0]["type"] == "function_call"
        assert not [e for e in ws.seen[mark:] if e.get("response_id") == done["id"]]
        conforms(ws, False)


async def test_a_call_cut_by_max_output_tokens_is_incomplete(h):
    ws = await session(h, tools=[TOOL], tool_choice="required")
    await say(ws, "weather?")
    await ws.send("response.create", response={"max_output_tokens": 3})
    done = (await ws.until("response.done"))["response"]
    assert done["status"] == "incomplete" and done["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
    assert done["output"][0]["status"] == "incomplete"
    with pytest.raises(ValueError):
        json.loads(done["output"][0]["arguments"])
    conforms(ws, False)


async def test_duplex_speaks_the_same_calls(h):
    ws = await connect(h, "/v1/duplex")
    await ws.until("session.created")
    await ws.send("session.update", session={"tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"}})
    await ws.until("session.updated")
    await say(ws, "weather?")
    await ws.send("response.create")
    done = (await ws.until("response.done"))["response"]
    call = done["output"][0]
    assert call["type"] == "function_call" and done["status"] == "completed"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER)
    assert all("server_event_seq" in e for e in ws.seen if e["type"].startswith("response."))


BAD_SESSIONS = [
    ({"tools": [{**TOOL, "parameters": {"type": "object", "properties": []}}]}, "session.tools[0].parameters"),
    ({"tools": [{**TOOL, "parameters": {"type": "string"}}]}, "session.tools[0].parameters"),
    ({"tools": [{**TOOL, "parameters": "city"}]}, "session.tools[0].parameters"),
    ({"tools": [TOOL, TOOL]}, "session.tools[1].name"),
    ({"tools": [{**TOOL, "name": "get weather!"}]}, "session.tools[0].name"),
    ({"tools": [{**TOOL, "type": "mcp"}]}, "session.tools[0].type"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "book_flight"}}, "session.tool_choice"),
    ({"tool_choice": "sometimes"}, "session.tool_choice"),
    ({"tools": [{**TOOL, "name": f"t{i}"} for i in range(MAX_TOOLS + 1)]}, "session.tools"),
    ({"tools": [{**TOOL, "parameters": {"type": "object", "description": "x" * MAX_SCHEMA_CHARS}}]}, "session.tools[0].parameters"),
]


@pytest.mark.parametrize(("update", "param"), BAD_SESSIONS)
async def test_bad_tools_get_an_error_naming_the_field_and_the_session_goes_on(h, update, param):
    ws = await session(h, **update)
    err = ws.seen[-1]
    assert err["type"] == "error" and err["error"]["param"] == param, err
    assert err["error"]["type"] == "invalid_request_error"
    await ws.send("session.update", session={"type": "realtime", "tools": [TOOL]})
    assert (await ws.until("session.updated"))["session"]["tools"] == [TOOL]  # nothing of the bad update stuck
    conforms(ws, False)


async def test_a_choice_set_before_the_tools_is_kept_and_answers_until_they_come(h):
    ws = await session(h, tool_choice="required")  # pipecat's first session.update
    assert ws.seen[-1]["session"]["tool_choice"] == "required" and ws.seen[-1]["session"]["tools"] == []
    await say(ws, "hi")
    await ws.send("response.create", response={"max_output_tokens": 2})
    assert [o["type"] for o in (await ws.until("response.done"))["response"]["output"]] == ["message"]
    await ws.send("session.update", session={"type": "realtime", "tools": [TOOL]})
    assert (await ws.until("session.updated"))["session"]["tool_choice"] == "required"
    await ws.send("response.create")
    assert (await ws.until("response.done"))["response"]["output"][0]["type"] == "function_call"


async def test_bad_function_items_and_overrides_get_errors(h):
    ws = await session(h, tools=[TOOL])
    await ws.send("conversation.item.create", item={"type": "function_call_output", "call_id": "call_nope", "output": "x"})
    assert (await ws.until("error"))["error"]["param"] == "item.call_id"
    await ws.send("conversation.item.create", item={"type": "function_call_output", "output": "x"})
    assert (await ws.until("error"))["error"]["param"] == "item.call_id"
    await ws.send("response.create", response={"tool_choice": {"type": "function", "name": "nope"}})
    assert (await ws.until("error"))["error"]["param"] == "response.tool_choice"
    await ws.send("response.create", response={"tools": [{**TOOL, "parameters": {"type": 3}}]})
    assert (await ws.until("error"))["error"]["param"] == "response.tools[0].parameters"
    await say(ws, "still here")
    await ws.send("response.create", response={"max_output_tokens": 2})
    assert (await ws.until("response.done"))["response"]["status"] == "completed"


# ---- /v1/chat/completions -------------------------------------------------------------------


async def chat(h, **body: Any) -> Any:
    body = {"model": "gpt-4o-audio-preview", "messages": [{"role": "user", "content": "Weather in Paris?"}], **body}
    return await h.client.post("/v1/chat/completions", json=body)


async def test_chat_forced_call_and_the_round_trip(h):
    r = await chat(h, tools=[CHAT_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.status == 200, await r.text()
    choice = (await r.json())["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    history = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
    r = await chat(h, messages=history, tools=[CHAT_TOOL], max_tokens=4)
    body = await r.json()
    assert r.status == 200 and body["choices"][0]["message"]["content"] and body["choices"][0]["finish_reason"] == "length"
    msgs = thinker_saw(h)[-1]["messages"]
    assert msgs[1]["tool_calls"] == [call] and msgs[2] == {"role": "tool", "content": "sunny", "tool_call_id": call["id"]}


async def test_chat_streams_tool_call_deltas_as_openai_does(h):
    r = await chat(h, tools=[CHAT_TOOL], tool_choice="required", stream=True)
    chunks = [json.loads(line[6:]) for line in (await r.text()).splitlines() if line.startswith("data: {")]
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("tool_calls")]
    head, rest = calls[0], calls[1:]
    assert head["index"] == 0 and head["id"] and head["type"] == "function" and head["function"]["name"] == "get_weather"
    assert rest and all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in rest)
    jsonschema.validate(json.loads("".join(c["function"]["arguments"] for c in calls)), WEATHER)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    from openai.types.chat import ChatCompletionChunk

    for c in chunks:
        ChatCompletionChunk.model_validate(c)


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "x"}}}]}, "tools[0].function.parameters"),
    ({"tools": [CHAT_TOOL, CHAT_TOOL]}, "tools[1].function.name"),
    ({"tools": [CHAT_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "tool", "tool_call_id": "call_x", "content": "hi"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]}, "messages[0].tool_calls[0]"),
])
async def test_chat_bad_tools_are_400s_naming_the_field(h, body, param):
    r = await chat(h, **body)
    err = (await r.json())["error"]
    assert r.status == 400 and err["param"] == param, err
