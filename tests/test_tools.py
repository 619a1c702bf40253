"""Function calling on the real server (the tiny Qwen2.5-Omni thinker on vLLM, its
hermes parser and structured outputs) with the official openai SDK: chat plain and
streamed, realtime GA and beta, the tool's result answered, cancel during a call's
arguments, a call cut by max_output_tokens; and the thinker's prompt as the
checkpoint's own chat template renders tools, calls and results.

The random tiny model would never call a tool on its own: `required` and a named
function make vLLM's grammar produce the call, so the arguments must parse and
satisfy the tool's JSON schema whatever the weights say."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from pydantic import TypeAdapter

from testkit.harness import ADMIN_KEY

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Lima", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER}}
RT_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER}
MODEL = "gpt-4o-audio-preview"


def sync_client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key=ADMIN_KEY)


def async_client(server):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{server.url}/v1", websocket_base_url=f"ws://127.0.0.1:{server.port}/v1", api_key=ADMIN_KEY)


CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "get_weather"}}}


@pytest.mark.parametrize("choice", list(CHOICES))
def test_chat_forced_calls_satisfy_the_schema(server, choice):
    c = sync_client(server)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[CHAT_TOOL],
                                  tool_choice=CHOICES[choice], parallel_tool_calls=False)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # the result goes back; the answer (no more calls) is text
    history: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}, ch.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 4}'}]
    r2 = c.chat.completions.create(model=MODEL, messages=history, tools=[CHAT_TOOL], tool_choice="none", max_tokens=6)
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls
    r3 = c.chat.completions.create(model=MODEL, messages=history[:1], tools=[CHAT_TOOL], tool_choice="none", max_tokens=1)
    assert r2.usage.prompt_tokens > r3.usage.prompt_tokens  # the call and its result are in the prompt


@pytest.mark.parametrize("choice", list(CHOICES))
def test_chat_streamed_calls_arrive_as_tool_call_deltas(server, choice):
    c = sync_client(server)
    stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=[CHAT_TOOL],
                                       tool_choice=CHOICES[choice], parallel_tool_calls=False, stream=True)
    pieces: list[Any] = []
    finish = None
    for chunk in stream:
        if chunk.choices:
            pieces += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert pieces[0].id and pieces[0].function.name == "get_weather" and {p.index for p in pieces} == {0}
    assert all(p.id is None for p in pieces[1:])
    jsonschema.validate(json.loads("".join(p.function.arguments or "" for p in pieces)), WEATHER)


async def events(conn, ta: TypeAdapter, stop: str, seen: list[dict[str, Any]]) -> dict[str, Any]:
    """Raw server events up to `stop`, each validated against the SDK's types."""
    while True:
        ev = json.loads(await conn.recv_bytes())
        ta.validate_python(ev)
        seen.append(ev)
        if ev["type"] == stop:
            return ev
        assert ev["type"] != "error", ev


async def forced_session(conn, ta: TypeAdapter, seen: list[dict[str, Any]]) -> None:
    """A GA session in manual mode whose responses must call get_weather."""
    await events(conn, ta, "session.created", seen)
    await conn.session.update(session={"type": "realtime", "tools": [RT_TOOL], "tool_choice": "required", "audio": {"input": {"turn_detection": None}}})
    await events(conn, ta, "session.updated", seen)


@pytest.mark.parametrize("dialect", ["ga", "beta"])
async def test_realtime_forced_call_its_result_and_the_spoken_answer(server, dialect):
    if dialect == "ga":
        from openai.types.realtime import RealtimeServerEvent
    else:
        from openai.types.beta.realtime import RealtimeServerEvent
    ta = TypeAdapter(RealtimeServerEvent)
    c = async_client(server)
    rt = c.realtime if dialect == "ga" else c.beta.realtime
    seen: list[dict[str, Any]] = []
    async with rt.connect(model="gpt-realtime") as conn:
        await events(conn, ta, "session.created", seen)
        if dialect == "ga":
            await conn.session.update(session={"type": "realtime", "tools": [RT_TOOL], "tool_choice": "required", "audio": {"input": {"turn_detection": None}}})
        else:
            await conn.session.update(session={"tools": [RT_TOOL], "tool_choice": "required", "turn_detection": None})
        updated = await events(conn, ta, "session.updated", seen)
        assert updated["session"]["tools"][0]["name"] == "get_weather"
        await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Lima?"}]})
        await conn.response.create()
        done = (await events(conn, ta, "response.done", seen))["response"]
        assert done["status"] == "completed", done
        (call,) = done["output"]
        assert call["type"] == "function_call" and call["status"] == "completed"
        jsonschema.validate(json.loads(call["arguments"]), WEATHER)
        deltas = "".join(e["delta"] for e in seen if e["type"] == "response.function_call_arguments.delta")
        assert deltas == call["arguments"]
        assert not [e for e in seen if "audio" in e["type"]]  # a pure call says nothing
        await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call["call_id"], "output": '{"temp_c": 21}'})
        await conn.response.create(response={"tool_choice": "none", "max_output_tokens": 8})
        mark = len(seen)
        answer = (await events(conn, ta, "response.done", seen))["response"]
        assert answer["status"] == "completed" and [o["type"] for o in answer["output"]] == ["message"]
        audio = "response.output_audio.delta" if dialect == "ga" else "response.audio.delta"
        assert any(e["type"] == audio for e in seen[mark:])


async def test_realtime_cancel_during_the_arguments_sends_no_half_call(server):
    from openai.types.realtime import RealtimeServerEvent

    ta = TypeAdapter(RealtimeServerEvent)
    seen: list[dict[str, Any]] = []
    async with async_client(server).realtime.connect(model="gpt-realtime") as conn:
        await forced_session(conn, ta, seen)
        await conn.response.create()
        first = await events(conn, ta, "response.function_call_arguments.delta", seen)
        await conn.response.cancel()
        done = (await events(conn, ta, "response.done", seen))["response"]
        assert done["status"] == "cancelled" and done["output"] == []
        types = [e["type"] for e in seen]
        assert "response.function_call_arguments.done" not in types and "response.output_item.done" not in types
        assert any(e["type"] == "conversation.item.deleted" and e["item_id"] == first["item_id"] for e in seen)
        # the session goes on: the next forced call is whole
        await conn.response.create()
        again = (await events(conn, ta, "response.done", seen))["response"]
        assert again["status"] == "completed"
        jsonschema.validate(json.loads(again["output"][0]["arguments"]), WEATHER)


async def test_realtime_call_cut_by_max_output_tokens_is_incomplete(server):
    from openai.types.realtime import RealtimeServerEvent

    ta = TypeAdapter(RealtimeServerEvent)
    seen: list[dict[str, Any]] = []
    async with async_client(server).realtime.connect(model="gpt-realtime") as conn:
        await forced_session(conn, ta, seen)
        await conn.response.create(response={"max_output_tokens": 6})
        done = (await events(conn, ta, "response.done", seen))["response"]
        assert done["status"] == "incomplete" and done["status_details"]["reason"] == "max_output_tokens", done
        assert not [o for o in done["output"] if o["type"] == "function_call" and o["status"] == "completed"], done


def test_the_thinker_renders_tools_calls_and_results_with_the_checkpoints_template(models_dir):
    """What the model is shown: the tools offered in the system turn, the call in the
    assistant turn, the result as a tool response (tiny Qwen2.5-Omni and the cascade's
    Qwen2 chat LM, whose templates are the family's)."""
    from omni_rt.engines.fake import FakeArEngine
    from omni_rt.specs import StageSpec
    from pipelines.voice import ThinkerProcessor

    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
            {"role": "tool", "content": '{"temp_c": 4}', "tool_call_id": "c1", "name": "get_weather"}]
    for model in ("tiny-qwen2.5-omni", "tiny-qwen2-thinker"):
        spec = StageSpec.model_validate({"name": "thinker", "kind": "ar", "engine": "fake", "model": str(models_dir / model), "processor": "pipelines.voice:ThinkerProcessor"})
        proc = ThinkerProcessor(spec, FakeArEngine(), {})
        proc._load()
        assert proc.tool_calling is not None and proc.tool_calling.parser_name == "hermes"
        prompt = proc.render(msgs, tools=[CHAT_TOOL])
        assert '"name": "get_weather"' in prompt and "<tools>" in prompt, prompt
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>' in prompt, prompt
        assert '<tool_response>\n{"temp_c": 4}\n</tool_response>' in prompt, prompt
        assert "<tools>" not in proc.render(msgs)  # tool_choice none: not offered, the history still shown
        # the markers are tokens of the vocabulary, let through when tools are on
        ids = proc.tool_calling.marker_ids
        assert len(ids) == 2 and all(i >= proc.text_vocab for i in ids)
        stream = proc.tool_stream({"tools": [CHAT_TOOL], "tool_choice": "required"})
        sampling = proc.sampling({}, stream)
        assert [ids[0], ids[0] + 1] in sampling["allowed_token_ranges"] and sampling["min_tokens"] == 0
        assert "structural_tag" in sampling["structured_outputs"]
        assert '"max_whitespace_cnt": 2' in sampling["structured_outputs"]["structural_tag"]
        assert proc.sampling({}, None).get("structured_outputs") is None


BOUNDED = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
FREE = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"], "additionalProperties": False}


def _tool(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": schema}}


@pytest.mark.parametrize("schema", ["bounded", "free"])
def test_the_grammar_writes_only_calls_that_parse_back(models_dir, schema):
    """The grammar the thinker hands vLLM for a forced call (the hermes parser's
    structural tag, compiled by xgrammar as vLLM compiles it): a string admits no control
    character (JSON forbids them unescaped; xgrammar's own rule for `maxLength` let them
    through) and no `</tool_call>` (the parser ends the call there, even inside a string:
    the arguments came out cut), and still holds its bounds and the enum."""
    import xgrammar as xgr

    from omni_rt.engines.fake import FakeArEngine
    from omni_rt.specs import StageSpec
    from pipelines.voice import ThinkerProcessor

    spec = StageSpec.model_validate({"name": "thinker", "kind": "ar", "engine": "fake", "model": str(models_dir / "tiny-qwen2.5-omni"),
                                     "processor": "pipelines.voice:ThinkerProcessor"})
    proc = ThinkerProcessor(spec, FakeArEngine(), {})
    proc._load()
    params = {"bounded": BOUNDED, "free": FREE}[schema]
    stream = proc.tool_stream({"tools": [_tool(params)], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert stream is not None and stream.structured_outputs is not None
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False).compile_structural_tag(stream.structured_outputs["structural_tag"])
    key = "city" if schema == "bounded" else "note"

    def accepts(value: str, unit: str = "celsius") -> bool:
        m = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        args = {key: "VALUE", "unit": unit} if schema == "bounded" else {key: "VALUE"}
        text = "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": args}).replace("VALUE", value) + "\n</tool_call>"
        return m.accept_string(text) and m.is_terminated()

    assert accepts("Paris") and accepts("A" * 24) and accepts("ü" * 24)
    for ch in ("\x00", "\x01", "\t", "\n", "\r", "\x1f"):
        assert not accepts(f"Pa{ch}ris"), repr(ch)
    assert not accepts("Pa</tool_call>ris")
    if schema == "bounded":
        assert not accepts("A" * 25) and not accepts("ü" * 25)
        assert not accepts("Paris", "kelvin")
    else:
        assert accepts("A" * 200) and accepts('say \\"hi\\"')  # a free string keeps its escapes


@pytest.mark.parametrize("schema", ["bounded", "free"])
def test_forced_calls_parse_strictly_on_every_seed(server, schema):
    """A named function forced through the SDK's chat completions on many seeds: the
    arguments parse with Python's strict json.loads and hold the schema, or the call
    was cut by the token budget and says so (finish_reason length), as OpenAI reports it."""
    c = sync_client(server)
    params = {"bounded": BOUNDED, "free": FREE}[schema]
    cut = 0
    for seed in range(12):
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Lima?"}], tools=[_tool(params)],
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}}, seed=seed, temperature=1.0,
                                      max_tokens=256)
        ch = r.choices[0]
        (call,) = ch.message.tool_calls
        if ch.finish_reason == "length":
            cut += 1
            continue
        assert ch.finish_reason == "tool_calls", (seed, ch)
        args = json.loads(call.function.arguments)  # strict: control characters in strings are an error
        jsonschema.validate(args, params)
    if schema == "bounded":
        assert cut == 0  # a call with a string of at most 24 characters (4 bytes each at most) always fits 256 tokens
