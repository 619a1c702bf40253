"""`/v1/live/sessions` in-process (fake engines, EnergyVad) through the `openai` SDK's
own `client.live.connect()`: every server event is validated against the SDK's
`openai.types.live.ServerEvent` (the union, strictly: each event must be one of its
members with every required field)."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import openai
import pytest
from openai.types.live import ServerEvent
from pydantic import TypeAdapter

from testkit import serve
from testkit.wire import b64, connect, quiet, tone

EVENTS: TypeAdapter[Any] = TypeAdapter(ServerEvent)


@pytest.fixture
async def h():
    async with serve(["voice"]) as harness:
        yield harness


def live(h) -> Any:
    client = openai.AsyncOpenAI(api_key="sk-unused", base_url=str(h.client.make_url("/v1")), max_retries=0)
    return client.live.connect()


async def recv(conn, seen: list | None = None, timeout: float = 5.0) -> Any:
    """The next server event, validated against the SDK's ServerEvent union."""
    raw = json.loads(await asyncio.wait_for(conn.recv_bytes(), timeout))
    ev = EVENTS.validate_python(raw)
    assert ev.type == raw["type"], raw
    if seen is not None:
        seen.append(ev)
    return ev


async def until(conn, type: str, seen: list | None = None, timeout: float = 5.0) -> Any:
    while True:
        ev = await recv(conn, seen, timeout)
        if ev.type == type:
            return ev


async def start(conn, **session: Any) -> Any:
    """session.start, then session.started and the session's resume token (an `info`)."""
    await conn.session.start(session={"model": "gpt-live-1", **session}, event_id="evt_start")
    ev = await recv(conn)
    assert ev.type == "session.started", ev
    token = await recv(conn)
    assert token.type == "info" and token.code == "session.resume_token" and token.message, token
    ev.resume_token = token.message
    return ev


async def speak(conn, seconds: float = 0.6) -> None:
    for pcm in (quiet(0.2), tone(seconds), quiet(1.2)):
        for i in range(0, len(pcm), 4800):
            await conn.session.input_audio.append(audio=b64(pcm[i : i + 4800]))


async def test_a_live_session_hears_speech_and_answers_with_audio_and_transcripts(h):
    async with live(h) as conn:
        started = await start(conn, instructions="Be brief.", audio={"format": {"type": "audio/pcm", "rate": 24000}, "output": {"voice": "cedar"}})
        s = started.session
        assert started.client_event_id == "evt_start" and s.model == "gpt-live-1" and s.status == "active"
        assert s.audio.output.voice == "cedar" and s.audio.format.rate == 24000 and s.instructions == "Be brief."
        assert s.expires_at > 0 and s.id.startswith("sess")
        await speak(conn)
        seen: list = []
        usage = await until(conn, "session.usage.updated", seen, timeout=10)
        types = [e.type for e in seen]
        assert "session.output_audio.delta" in types and "session.output_transcript.delta" in types, types
        assert "session.input_transcript.delta" in types, types  # the profile's streaming ASR, while the user spoke
        assert types.index("session.input_transcript.delta") < types.index("session.output_audio.delta")
        assert usage.usage.seconds >= 0
        said = "".join(e.delta for e in seen if e.type == "session.output_transcript.delta")
        assert said.strip(), said
        await conn.session.close(event_id="evt_close")
        closed = await until(conn, "session.closed")
        assert closed.reason == "close_requested" and closed.client_event_id == "evt_close" and closed.session.id == s.id


async def test_mute_sends_silence_to_the_model_and_unmute_hears_again(h):
    async with live(h) as conn:
        await start(conn)
        await conn.session.input_audio.mute(event_id="m1")
        muted = await recv(conn)
        assert muted.type == "session.input_audio.muted" and muted.client_event_id == "m1"
        await speak(conn)
        with pytest.raises(TimeoutError):
            await until(conn, "session.output_audio.delta", timeout=1.5)  # muted: nothing was heard
        await conn.session.input_audio.unmute(event_id="m2")
        assert (await until(conn, "session.input_audio.unmuted")).client_event_id == "m2"
        await speak(conn)
        await until(conn, "session.output_audio.delta", timeout=10)


async def test_instructions_appended_mid_call_reach_the_next_answer(h):
    async with live(h) as conn:
        await start(conn, instructions="Be brief.", input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi there."}]}])
        await conn.session.instructions.append(content="The caller's name is Ada.", delegation_id=None, event_id="i1")
        ack = await until(conn, "session.instructions.appended")
        assert ack.client_event_id == "i1" and ack.end_ms >= ack.start_ms >= 0
        await conn.session.thinking.append(content="She called before.", delegation_id=None, event_id="t1")
        assert (await until(conn, "session.thinking.appended")).client_event_id == "t1"
        await speak(conn)
        await until(conn, "session.usage.updated", timeout=10)
    prompt = h.processor("thinker").seen[-1]["messages"]
    text = json.dumps(prompt)
    assert "Be brief." in text and "Hi there." in text and "The caller's name is Ada." in text and "She called before." in text


async def test_a_client_delegation_round_trip(h):
    """delegation {type: client}: the talking model calls its `delegate` function, the
    app gets session.delegation.created (and the task as an info event), answers with
    commentary naming the delegation, and the model speaks the outcome."""
    async with live(h) as conn:
        started = await start(conn, delegation={"type": "client"})
        assert started.session.delegation.type == "client"
        # (the fake thinker calls when the latest message says "<call>")
        await conn.session.commentary.append(content="The user wants a table for two tonight <call>", delegation_id=None)
        seen: list = []
        created = await until(conn, "session.delegation.created", seen, timeout=10)
        assert created.delegation.target == "client" and created.offset_ms >= 0
        task = await until(conn, "info", seen)
        assert task.code == "delegation.task" and task.message
        await until(conn, "session.usage.updated", seen, timeout=10)  # the turn that delegated ends
        await conn.session.commentary.append(content="Booked for 8 pm.", delegation_id=created.delegation.id, event_id="c2")
        after: list = []
        assert (await until(conn, "session.commentary.appended", after)).client_event_id == "c2"
        await until(conn, "session.usage.updated", after, timeout=10)
        assert any(e.type == "session.output_audio.delta" for e in after)
        await conn.session.commentary.append(content="x", delegation_id="del_nope", event_id="c3")
        err = await until(conn, "error")
        assert err.error.code == "delegation_not_found" and err.client_event_id == "c3" and err.error.client_event_id == "c3"
    seen_prompt = h.processor("thinker").seen[-1]["messages"]
    assert any(m.get("role") == "tool" and m.get("content") == "Booked for 8 pm." for m in seen_prompt), seen_prompt


@pytest.mark.parametrize(("event", "code", "param"), [
    ({"type": "decision.create"}, "unsupported_event", "type"),
    ({"type": "response.create"}, "unsupported_event", "type"),  # (this session delegates to the client)
    ({"type": "session.nope"}, "invalid_value", "type"),
    ({"type": "session.update", "session": {"model": "gpt-live-1.1"}}, "immutable_parameter", "session.model"),
    ({"type": "session.update", "session": {"delegation": {"type": "client"}}}, "immutable_parameter", "session.delegation.type"),
    ({"type": "session.input_audio.append", "audio": "@@@"}, "invalid_value", None),
    ({"type": "session.instructions.append"}, "invalid_type", "content"),
    ({"type": "session.start", "session": {"model": "gpt-live-1"}}, "session_already_started", "type"),
])
async def test_bad_events_get_an_error_naming_them_and_the_session_goes_on(h, event, code, param):
    async with live(h) as conn:
        await start(conn)
        await conn.send({**event, "event_id": "bad1"})
        err = await until(conn, "error")
        assert err.error.code == code and err.client_event_id == "bad1", err
        if param is not None:
            assert err.error.param == param, err
        await conn.session.input_audio.mute(event_id="ok")
        assert (await until(conn, "session.input_audio.muted")).client_event_id == "ok"


@pytest.mark.parametrize(("session", "param"), [
    ({"model": "gpt-nope"}, "session.model"),
    ({"model": "gpt-live-1", "store": True}, "session.store"),
    ({"model": "gpt-live-1", "delegation": {"type": "decisions", "decisions": {}}}, "session.delegation.type"),
    ({"model": "gpt-live-1", "delegation": {"type": "responses", "responses": {"model": "gpt-5", "tools": [{"type": "web_search"}]}}},
     "session.delegation.responses.tools[0].type"),
    ({"model": "gpt-live-1", "delegation": {"type": "responses", "responses": {}}}, "session.delegation.responses.model"),
    ({"model": "gpt-live-1", "audio": {"format": {"type": "audio/pcm", "rate": 44100}}}, "session.audio.format"),
    ({"model": "gpt-live-1", "audio": {"output": {"voice": "nobody"}}}, "session.audio.output.voice"),
    ({"model": "gpt-live-1", "input": [{"role": "tool", "content": []}]}, "session.input[0].role"),
    ({"model": "gpt-live-1", "surprise": 1}, "session.surprise"),
])
async def test_a_bad_start_is_refused_by_field(h, session, param):
    ws = await connect(h, "/v1/live/sessions")
    await ws.send("session.input_audio.append", audio=b64(quiet(0.1)), event_id="early")
    early = await ws.until("error")
    assert early["error"]["code"] == "session_not_started" and early["client_event_id"] == "early"
    EVENTS.validate_python(early)
    await ws.send("session.start", session=session, event_id="s1")
    err = await ws.until("error")
    assert err["error"]["param"] == param and err["client_event_id"] == "s1", err
    EVENTS.validate_python(err)
    await ws.send("session.start", session={"model": "gpt-live-1"})  # a good start after a bad one
    EVENTS.validate_python(await ws.until("session.started"))
    await ws.ws.close()


async def test_a_dropped_socket_is_resumed_by_the_sdks_reconnect(h):
    """The network drops (the socket dies without a close frame): the SDK's own
    reconnect, told the session's id and resume token by `on_reconnecting`, lands in the
    same session (`info` session.resumed, then a fresh resume token), and the
    conversation goes on with its history."""
    state: dict[str, Any] = {}

    def on_reconnecting(event: Any) -> Any:
        state["attempts"] = event.attempt
        return {"extra_query": {"session_id": state["id"], "resume_token": state["token"]}}

    client = openai.AsyncOpenAI(api_key="sk-unused", base_url=str(h.client.make_url("/v1")), max_retries=0)
    async with client.live.connect(on_reconnecting=on_reconnecting, initial_delay=0.05) as conn:
        started = await start(conn, instructions="Be brief.")
        state.update(id=started.session.id, token=started.resume_token)
        await conn.session.instructions.append(content="Remember the code word: heron.", delegation_id=None)
        await until(conn, "session.instructions.appended")
        seen: list = []
        resumed = asyncio.Event()

        async def read() -> None:  # the app's receive loop: the SDK's iterator is what reconnects
            async for ev in conn:
                seen.append(EVENTS.validate_python(ev.model_dump(exclude_unset=True)))
                if ev.type == "info" and ev.code == "session.resumed":
                    resumed.set()
                if ev.type == "session.usage.updated":
                    return

        reader = asyncio.create_task(read())
        conn._connection.transport.abort()  # the network drops: no close frame (1006)
        async with asyncio.timeout(10):
            await resumed.wait()
            await speak(conn)
            await reader
        infos = [e for e in seen if e.type == "info"]
        assert [e.code for e in infos[:2]] == ["session.resumed", "session.resume_token"] and state["attempts"] >= 1, infos
        assert infos[1].message != state["token"]
        assert any(e.type == "session.output_audio.delta" for e in seen)
    live_sessions = [s for s in h.processor("thinker").seen if "heron" in json.dumps(s["messages"])]
    assert live_sessions, "the answer after the reconnect has the session's history"


async def test_a_resume_with_a_bad_token_is_refused(h):
    async with live(h) as conn:
        started = await start(conn)
        ws = await connect(h, f"/v1/live/sessions?session_id={started.session.id}&resume_token=wrong")
        err = await ws.until("error")
        EVENTS.validate_python(err)
        assert err["error"]["code"] == "invalid_resume_token", err
        await conn.session.input_audio.mute(event_id="still")
        assert (await until(conn, "session.input_audio.muted")).client_event_id == "still"  # the session goes on


async def test_the_full_duplex_engine_speaks_while_it_listens():
    """session.model moshi (both pipelines served, one route): the full-duplex model's
    voice comes back while the user is still talking (the fake echoes each frame at half
    amplitude), its text stream is the output transcript, mute makes it hear silence,
    and what it cannot take (text context, delegation, a voice) is refused by name."""
    import numpy as np

    async with serve(["voice", "moshi"]) as h:
        client = openai.AsyncOpenAI(api_key="sk-unused", base_url=str(h.client.make_url("/v1")), max_retries=0)
        async with client.live.connect() as conn:
            await conn.session.start(session={"model": "moshi", "delegation": {"type": "client"}}, event_id="s0")
            err = await until(conn, "error")
            assert err.error.param == "session.delegation" and err.client_event_id == "s0"
            await conn.session.start(session={"model": "moshi", "audio": {"output": {"voice": "marin"}}})
            assert (await until(conn, "error")).error.param == "session.audio.output.voice"
            await start_moshi(conn)
            got: list[np.ndarray] = []
            seen: list = []

            async def read() -> None:
                while True:
                    ev = await recv(conn, seen, timeout=10)
                    if ev.type == "session.output_audio.delta":
                        got.append(np.frombuffer(base64.b64decode(ev.delta), "<i2").astype(np.float32) / 32767)

            reader = asyncio.create_task(read())
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            for i in range(60):  # 1.2 s in real time, 20 ms chunks
                if i == 40:
                    await conn.session.input_audio.mute()
                await conn.session.input_audio.append(audio=b64((np.full(480, 0.2, np.float32) * 32767).astype("<i2").tobytes()))
                await asyncio.sleep(max(0.0, t0 + (i + 1) * 0.02 - loop.time()))
            await asyncio.sleep(0.3)
            assert len(got) >= 8, len(got)  # its voice while the user still talked
            heard = np.concatenate(got)
            assert np.isclose(heard, 0.1, atol=2e-3).sum() > 4 * 1920  # the model answering what it heard
            assert np.isclose(heard[-1920:], 0.0, atol=2e-3).all()  # muted: it hears (and echoes) silence
            assert any(e.type == "session.output_transcript.delta" for e in seen)
            assert any(e.type == "session.input_audio.muted" for e in seen)
            await conn.session.instructions.append(content="be nice", delegation_id=None, event_id="i1")
            await asyncio.sleep(0.2)
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            errs = [e for e in seen if e.type == "error"]
            assert errs and errs[-1].error.code == "unsupported_event" and errs[-1].client_event_id == "i1"
            await conn.session.close()
            assert (await until(conn, "session.closed")).reason == "close_requested"


async def start_moshi(conn) -> Any:
    await conn.session.start(session={"model": "moshi"})
    started = await until(conn, "session.started")
    assert started.session.model == "moshi" and started.session.audio.output.voice is None
    await until(conn, "info")
    return started


async def test_a_responses_delegation_runs_on_the_servers_chat_lm_with_a_function_tool(h):
    """delegation {type: responses}: the talking model delegates; the task runs on this
    server's chat LM with the session's function tool, streamed as nested Responses
    events; the app runs the function (response.item.create + response.create), the run
    ends in text, and the talking model speaks the outcome."""
    tool = {"type": "function", "name": "book_table", "description": "Book a table.",
            "parameters": {"type": "object", "properties": {"people": {"type": "integer"}}, "required": ["people"]}}
    async with live(h) as conn:
        started = await start(conn, delegation={"type": "responses", "responses": {
            "model": "omni-rt-voice", "instructions": "You book tables. <call>", "tools": [tool], "max_output_tokens": 8}})
        assert started.session.delegation.type == "responses" and started.session.delegation.responses.tools[0].name == "book_table"
        await conn.session.commentary.append(content="The user wants a table for two <call>", delegation_id=None)
        seen: list = []
        created = await until(conn, "session.delegation.created", seen, timeout=10)
        assert created.delegation.target == "responses" and created.delegation.response_id
        nested: list[dict] = []
        while not nested or nested[-1]["type"] != "response.completed":
            ev = await until(conn, "response.event", seen, timeout=10)
            assert ev.delegation_id == created.delegation.id
            nested.append(ev.event)
        kinds = [e["type"] for e in nested]
        assert kinds[0] == "response.created" and "response.function_call_arguments.delta" in kinds, kinds
        call = next(e["item"] for e in nested if e["type"] == "response.output_item.done")
        assert call["type"] == "function_call" and call["name"] == "book_table" and json.loads(call["arguments"])["people"] >= 1
        assert [e["sequence_number"] for e in nested] == list(range(1, len(nested) + 1))
        await conn.response.create(event_id="early")  # no output yet: refused
        assert (await until(conn, "error")).error.code == "missing_tool_output"
        await conn.send({"type": "response.item.create", "item": {"type": "function_call_output", "call_id": call["call_id"],
                                                                 "output": "Booked for 8 pm."}})
        await conn.response.create()
        after: list = []
        nested = []
        while not nested or nested[-1]["type"] not in ("response.completed", "response.incomplete"):  # (the fake runs to its limit)
            nested.append((await until(conn, "response.event", after, timeout=10)).event)
        text = next(e["text"] for e in nested if e["type"] == "response.output_text.done")
        assert text.strip()
        await until(conn, "session.usage.updated", after, timeout=10)  # the talking model spoke the outcome
        assert any(e.type == "session.output_audio.delta" for e in after)
    prompts = h.processor("thinker").seen
    assert any(m.get("role") == "tool" and m.get("content") == "Booked for 8 pm." for p in prompts for m in p["messages"])
    spoken = prompts[-1]["messages"]
    assert any(m.get("role") == "tool" and m.get("content") == text.strip() for m in spoken), spoken


async def test_a_g711_session_speaks_mu_law_both_ways(h):
    """audio/pcmu at 8 kHz (a phone leg): μ-law in, μ-law out (one byte a sample)."""
    from media.wire_audio import PCMU, OutputEncoder

    enc = OutputEncoder(PCMU, 24000)
    ulaw = enc.encode("u", quiet(0.2) + tone(0.6) + quiet(1.2)) + enc.finish("u")
    async with live(h) as conn:
        started = await start(conn, audio={"format": {"type": "audio/pcmu"}})
        assert started.session.audio.format.type == "audio/pcmu" and started.session.audio.format.rate == 8000
        for i in range(0, len(ulaw), 800):
            await conn.session.input_audio.append(audio=b64(ulaw[i : i + 800]))
        seen: list = []
        await until(conn, "session.usage.updated", seen, timeout=10)
    out = b"".join(base64.b64decode(e.delta) for e in seen if e.type == "session.output_audio.delta")
    assert out and len(set(out)) > 2  # μ-law bytes, not PCM16 at 24 kHz


async def test_a_resume_while_the_old_socket_is_still_open_takes_the_session_over(h):
    """The SDK may reconnect before the server has seen the old socket die: the resume
    takes the session over, the old socket is closed, and the session lives on."""
    old = await connect(h, "/v1/live/sessions")
    await old.send("session.start", session={"model": "gpt-live-1"})
    started = await old.until("session.started")
    token = (await old.until("info"))["message"]
    new = await connect(h, f"/v1/live/sessions?session_id={started['session']['id']}&resume_token={token}")
    resumed = await new.until("info")
    assert resumed["code"] == "session.resumed"
    closed = await old.until("connection.closed", timeout=5)
    assert closed["code"] == 4000
    await new.send("session.input_audio.mute", event_id="after")
    muted = await new.until("session.input_audio.muted")
    assert muted["client_event_id"] == "after"
    assert h.sessions.sessions() and h.sessions.sessions()[0].is_open
    await new.ws.close()


async def test_a_session_the_server_ends_says_session_closed(h):
    """An end the client did not ask for (here the server closes it) is Live's
    session.closed with connection_lost, valid against the SDK's type."""
    async with live(h) as conn:
        started = await start(conn)
        await h.sessions.close(started.session.id)
        closed = await until(conn, "session.closed")
        assert closed.reason == "connection_lost" and closed.session.id == started.session.id
