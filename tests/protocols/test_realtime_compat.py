"""What the agent SDKs rely on (openai-agents, LiveKit, pipecat, the openai SDK's own
types), in-process: content-part types, item retrieval, response metadata,
semantic_vad, the newer voices, client secrets, an empty conversation, and a prompt
longer than the model's context."""

from __future__ import annotations

import pytest

from protocols.realtime import Conversation
from testkit import serve
from testkit.wire import Events, connect

KEY = "sk-compat-0001"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture
async def h():
    async with serve(["voice", "tts"]) as harness:
        yield harness


async def session(h, beta: bool = False, headers: dict[str, str] | None = None) -> Events:
    hdrs = dict(headers or {})
    if beta:
        hdrs["openai-beta"] = "realtime=v1"
    ws = await connect(h, "/v1/realtime?model=gpt-realtime", hdrs)
    await ws.until("session.created")
    return ws


async def text_item(ws: Events, text: str) -> None:
    await ws.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})


def conversation_of(h):
    (s,) = [s for s in h.sessions.sessions() if s.kind == "realtime"]
    return s.kept(Conversation)


@pytest.mark.parametrize("beta", [False, True])
@pytest.mark.parametrize("audio", [True, False])
async def test_content_part_events_say_audio_or_text_and_items_keep_their_types(h, beta, audio):
    ws = await session(h, beta)
    await text_item(ws, "hello")
    key = "modalities" if beta else "output_modalities"
    await ws.send("response.create", response={key: ["audio"] if audio else ["text"], "max_output_tokens": 3})
    done = await ws.until("response.done")
    parts = [e for e in ws.seen if e["type"] in ("response.content_part.added", "response.content_part.done")]
    assert [p["type"] for p in parts] == ["response.content_part.added", "response.content_part.done"]
    assert {p["part"]["type"] for p in parts} == {"audio" if audio else "text"}
    item_type = done["response"]["output"][0]["content"][0]["type"]
    if beta:
        assert item_type == ("audio" if audio else "text")
    else:
        assert item_type == ("output_audio" if audio else "output_text")


async def test_item_retrieve_answers_the_items_and_unknown_ids_get_their_own_code(h):
    ws = await session(h)
    await text_item(ws, "hi there")
    user = (await ws.until("conversation.item.added"))["item"]
    await ws.send("response.create", response={"max_output_tokens": 8})
    done = await ws.until("response.done")
    answer = done["response"]["output"][0]
    await ws.send("conversation.item.retrieve", item_id=user["id"])
    got = await ws.until("conversation.item.retrieved")
    assert got["item"]["id"] == user["id"] and got["item"]["content"][0]["text"] == "hi there"
    # after a truncate (what openai-agents does on every interruption), retrieve shows what was heard
    await ws.send("conversation.item.truncate", item_id=answer["id"], content_index=0, audio_end_ms=0)
    await ws.until("conversation.item.truncated")
    await ws.send("conversation.item.retrieve", item_id=answer["id"], event_id="evt_r1")
    got = await ws.until("conversation.item.retrieved")
    assert got["item"]["id"] == answer["id"] and got["item"]["content"][0]["transcript"] == ""
    await ws.send("conversation.item.retrieve", item_id="item_nope", event_id="evt_r2")
    err = (await ws.until("error"))["error"]
    assert (err["code"], err["param"], err["event_id"]) == ("item_retrieve_invalid_item_id", "item_id", "evt_r2")


async def test_response_metadata_is_echoed_on_created_and_done(h):
    ws = await session(h)
    await text_item(ws, "hi")
    meta = {"client_event_id": "ev_123", "topic": "weather"}
    await ws.send("response.create", response={"metadata": meta, "max_output_tokens": 2})
    assert (await ws.until("response.created"))["response"]["metadata"] == meta
    assert (await ws.until("response.done"))["response"]["metadata"] == meta
    await ws.send("response.create", response={"max_output_tokens": 2})
    assert (await ws.until("response.created"))["response"]["metadata"] is None
    await ws.until("response.done")


@pytest.mark.parametrize("beta", [False, True])
async def test_semantic_vad_is_accepted_with_the_rest_of_the_update(h, beta):
    ws = await session(h, beta)
    td = {"type": "semantic_vad", "eagerness": "high", "create_response": True, "interrupt_response": True}
    if beta:
        body = {"instructions": "Be brief.", "voice": "marin", "modalities": ["text"], "turn_detection": td}
    else:
        body = {"type": "realtime", "instructions": "Be brief.", "output_modalities": ["text"],
                "audio": {"input": {"turn_detection": td, "transcription": {"model": "whisper-1"}}, "output": {"voice": "marin"}}}
    await ws.send("session.update", session=body)
    s = (await ws.until("session.updated"))["session"]
    got_td = s["turn_detection"] if beta else s["audio"]["input"]["turn_detection"]
    assert got_td == td
    assert s["instructions"] == "Be brief."
    assert (s["voice"] if beta else s["audio"]["output"]["voice"]) == "marin"
    cfg = conversation_of(h).cfg
    assert cfg.turn_detection.silence_duration_ms == 300 and not cfg.audio_out
    # a partial update keeps the kind; another kind starts from its own defaults
    key = "turn_detection"
    await ws.send("session.update", session={key: {"eagerness": "low"}} if beta else {"audio": {"input": {key: {"eagerness": "low"}}}})
    await ws.until("session.updated")
    assert conversation_of(h).cfg.turn_detection.type == "semantic_vad"
    assert conversation_of(h).cfg.turn_detection.silence_duration_ms == 1500
    await ws.send("session.update", session={key: {"type": "server_vad"}} if beta else {"audio": {"input": {key: {"type": "server_vad"}}}})
    s = (await ws.until("session.updated"))["session"]
    got_td = s["turn_detection"] if beta else s["audio"]["input"]["turn_detection"]
    assert got_td["type"] == "server_vad" and got_td["silence_duration_ms"] == 500 and "eagerness" not in got_td


@pytest.mark.parametrize("voice", ["marin", "cedar"])
async def test_the_newer_voices_are_served_on_every_wire(h, voice):
    r = await h.client.post("/v1/audio/speech", json={"model": "tts-1", "voice": voice, "input": "Hello there.", "response_format": "pcm"})
    assert r.status == 200 and len(await r.read()) > 0
    r = await h.client.post("/v1/chat/completions", json={
        "model": "gpt-4o-audio-preview", "modalities": ["text", "audio"], "audio": {"voice": voice, "format": "wav"},
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status == 200, await r.text()
    ws = await session(h)
    await ws.send("session.update", session={"type": "realtime", "audio": {"output": {"voice": voice}}})
    assert (await ws.until("session.updated"))["session"]["audio"]["output"]["voice"] == voice
    await text_item(ws, "hi")
    await ws.send("response.create", response={"voice": voice, "max_output_tokens": 2})
    assert (await ws.until("response.done"))["response"]["status"] == "completed"


async def test_response_create_on_an_empty_conversation_is_answered(h, caplog):
    ws = await session(h)
    await ws.send("response.create", response={"max_output_tokens": 3})
    done = await ws.until("response.done")
    assert done["response"]["status"] == "completed"
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


async def test_a_prompt_longer_than_the_context_is_the_clients_error(h):
    h.engine("thinker").max_model_len = 20
    long = " ".join(["word"] * 50)
    r = await h.client.post("/v1/chat/completions", json={"model": "gpt-4o-audio-preview", "messages": [{"role": "user", "content": long}]})
    body = await r.json()
    assert r.status == 400, body
    assert body["error"]["code"] == "context_length_exceeded" and body["error"]["param"] == "messages"
    assert body["error"]["type"] == "invalid_request_error" and "20 tokens" in body["error"]["message"]
    r = await h.client.post("/v1/chat/completions", json={"model": "gpt-4o-audio-preview", "messages": [{"role": "user", "content": long}], "stream": True})
    assert r.status == 400 and (await r.json())["error"]["code"] == "context_length_exceeded"  # before the stream starts
    ws = await session(h)
    await text_item(ws, long)
    await ws.send("response.create")
    done = (await ws.until("response.done"))["response"]
    assert done["status"] == "failed"
    assert done["status_details"]["error"]["code"] == "context_length_exceeded"
    assert done["status_details"]["error"]["type"] == "invalid_request_error"
    # a short one still works
    h.engine("thinker").max_model_len = 4096
    await ws.send("response.create", response={"max_output_tokens": 2})
    assert (await ws.until("response.done"))["response"]["status"] == "completed"


# ---- client secrets ------------------------------------------------------------------------


@pytest.fixture
async def hk():
    async with serve(["voice"], {"server": {"api_keys": [{"key": KEY, "principal": "alice"}]}}) as harness:
        yield harness


async def secret(h, **body) -> dict:
    r = await h.client.post("/v1/realtime/client_secrets", json=body, headers=AUTH)
    assert r.status == 200, await r.text()
    return await r.json()


async def test_a_client_secret_starts_one_call_with_its_session(hk):
    sess = {"type": "realtime", "model": "gpt-realtime", "instructions": "Talk like a pirate.", "audio": {"output": {"voice": "marin"}}}
    got = await secret(hk, expires_after={"anchor": "created_at", "seconds": 60}, session=sess)
    assert got["value"].startswith("ek_") and got["expires_at"] > 0
    assert got["session"]["instructions"] == "Talk like a pirate." and got["session"]["audio"]["output"]["voice"] == "marin"
    bearer = {"authorization": f"Bearer {got['value']}"}
    # not good for anything but a Realtime call
    r = await hk.client.post("/v1/chat/completions", json={"model": "gpt-realtime", "messages": []}, headers=bearer)
    assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
    ws = await connect(hk, "/v1/realtime", bearer)
    s = (await ws.until("session.created"))["session"]
    assert s["instructions"] == "Talk like a pirate." and s["audio"]["output"]["voice"] == "marin" and s["model"] == "gpt-realtime"
    (live,) = [x for x in hk.sessions.sessions() if x.kind == "realtime"]
    assert live.principal == "alice"
    # one call only
    r = await hk.client.get("/v1/realtime", headers={**bearer, "upgrade": "websocket", "connection": "upgrade",
                                                     "sec-websocket-version": "13", "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ=="})
    assert r.status == 401


async def test_a_browser_websocket_passes_its_client_secret_as_a_subprotocol(hk):
    got = await secret(hk, session={"instructions": "From the browser."})
    ws = await hk.client.ws_connect("/v1/realtime", protocols=("realtime", f"openai-insecure-api-key.{got['value']}"))
    assert ws.protocol == "realtime"
    ev = Events(ws)
    assert (await ev.until("session.created"))["session"]["instructions"] == "From the browser."
    r = await hk.client.get("/v1/realtime", headers={"upgrade": "websocket", "connection": "upgrade", "sec-websocket-version": "13",
                                                     "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==",
                                                     "sec-websocket-protocol": "realtime, openai-insecure-api-key.wrong"})
    assert r.status == 401


async def test_client_secrets_expire_and_are_validated(hk):
    from protocols.auth import CLIENT_SECRETS

    got = await secret(hk, expires_after={"anchor": "created_at", "seconds": 10})
    store = hk.app[CLIENT_SECRETS]
    store.now = lambda: got["expires_at"] + 1.0
    ws_fail = await hk.client.get("/v1/realtime", headers={"authorization": f"Bearer {got['value']}", "upgrade": "websocket", "connection": "upgrade",
                                                           "sec-websocket-version": "13", "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ=="})
    assert ws_fail.status == 401 and "expired" in (await ws_fail.json())["error"]["message"]
    for body, param in [({"expires_after": {"seconds": 5}}, "expires_after.seconds"),
                        ({"session": {"audio": {"output": {"voice": "nobody"}}}}, "session.audio.output.voice"),
                        ({"session": {"type": "transcription"}}, "session.type"),
                        ({"session": {"model": "gpt-9"}}, "session.model")]:
        r = await hk.client.post("/v1/realtime/client_secrets", json=body, headers=AUTH)
        assert r.status == 400 and (await r.json())["error"]["param"] == param, (body, await r.text())
    r = await hk.client.post("/v1/realtime/client_secrets", json={})
    assert r.status == 401  # minting one needs a real key


async def test_beta_clients_ephemeral_session_through_the_sdk(hk):
    """`client.beta.realtime.sessions.create` (the older browser flow): the body is the
    session, the answer its beta shape plus `client_secret`, good for one beta call."""
    import openai

    sdk = openai.AsyncOpenAI(base_url=hk.url("/v1"), api_key=KEY, max_retries=0, timeout=10)
    try:
        got = await sdk.beta.realtime.sessions.create(
            model="gpt-4o-realtime-preview", voice="alloy", instructions="Answer in one sentence.", modalities=["text"],
            client_secret={"expires_after": {"anchor": "created_at", "seconds": 60}},
        )
        assert got.client_secret.value.startswith("ek_") and got.client_secret.expires_at > 0
        assert got.instructions == "Answer in one sentence." and got.voice == "alloy" and got.modalities == ["text"]
        extra = got.to_dict()  # fields the SDK's type does not list
        assert extra["model"] == "gpt-4o-realtime-preview" and str(extra["id"]).startswith("sess_")
        with pytest.raises(openai.BadRequestError) as bad:
            await sdk.beta.realtime.sessions.create(voice="nobody")
        assert isinstance(bad.value.body, dict) and "voice" in bad.value.body["param"] and "nobody" in str(bad.value)
        with pytest.raises(openai.BadRequestError) as bad:
            await sdk.beta.realtime.sessions.create(client_secret={"expires_after": {"anchor": "created_at", "seconds": 1}})
        assert isinstance(bad.value.body, dict) and bad.value.body["param"] == "expires_after.seconds"
    finally:
        await sdk.close()
    ws = await connect(hk, "/v1/realtime", {"authorization": f"Bearer {got.client_secret.value}", "openai-beta": "realtime=v1"})
    s = (await ws.until("session.created"))["session"]
    assert s["instructions"] == "Answer in one sentence." and s["modalities"] == ["text"] and s["model"] == "gpt-4o-realtime-preview"
    r = await hk.client.post("/v1/realtime/sessions", json={"voice": "alloy"})
    assert r.status == 401  # minting one needs a real key
    r = await hk.client.post("/v1/realtime/sessions", json={"client_secret": 5}, headers=AUTH)
    assert r.status == 400 and (await r.json())["error"]["param"] == "client_secret"


async def test_with_keys_off_a_client_secret_is_a_usable_value(h):
    got = await secret(h, session={"instructions": "Hi."})
    ws = await connect(h, "/v1/realtime", {"authorization": f"Bearer {got['value']}"})
    assert (await ws.until("session.created"))["session"]["instructions"] == "Hi."


@pytest.mark.parametrize("beta", [False, True])
async def test_input_transcription_events_follow_the_commit_and_history_keeps_the_transcript(h, beta):
    from testkit.wire import b64, tone

    ws = await session(h, beta)
    tr = {"model": "whisper-1", "language": "en"}  # on commit (gpt-4o-*-transcribe stream while spoken: test_stt.py)
    body = {"turn_detection": None, "input_audio_transcription": tr} if beta else \
        {"type": "realtime", "audio": {"input": {"turn_detection": None, "transcription": tr}}}
    await ws.send("session.update", session=body)
    s = (await ws.until("session.updated"))["session"]
    assert (s["input_audio_transcription"] if beta else s["audio"]["input"]["transcription"])["model"] == "whisper-1"
    await ws.send("input_audio_buffer.append", audio=b64(tone(2.0)))
    await ws.send("input_audio_buffer.commit")
    done = await ws.until("conversation.item.input_audio_transcription.completed")
    types = ws.types()
    item_id = next(e for e in ws.seen if e["type"] == "input_audio_buffer.committed")["item_id"]
    deltas = [e for e in ws.seen if e["type"] == "conversation.item.input_audio_transcription.delta"]
    assert types.index("input_audio_buffer.committed") < types.index("conversation.item.input_audio_transcription.delta")
    assert done["item_id"] == item_id and done["content_index"] == 0 and done["transcript"].startswith("w")
    assert done["transcript"] == "".join(d["delta"] for d in deltas).strip() and done["usage"]["seconds"] == 2.0
    assert h.processor("asr").seen[-1]["params"]["language"] == "en"
    await ws.send("conversation.item.retrieve", item_id=item_id)
    assert (await ws.until("conversation.item.retrieved"))["item"]["content"][0]["transcript"] == done["transcript"]
    # off again: no transcription of the next utterance
    off = {"input_audio_transcription": None} if beta else {"audio": {"input": {"transcription": None}}}
    await ws.send("session.update", session=off)
    await ws.until("session.updated")
    n = len(h.processor("asr").seen)
    await ws.send("input_audio_buffer.append", audio=b64(tone(1.0)))
    await ws.send("input_audio_buffer.commit")
    await ws.until("input_audio_buffer.committed")
    await ws.send("response.create", response={"output_modalities" if not beta else "modalities": ["text"], "max_output_tokens": 2})
    await ws.until("response.done")
    assert len(h.processor("asr").seen) == n


async def test_a_transcription_that_fails_says_so_and_bad_settings_name_their_field(h):
    from testkit.wire import b64, tone

    ws = await session(h)
    await ws.send("session.update", session={"audio": {"input": {"transcription": {"language": 5}}}})
    err = (await ws.until("error"))["error"]
    assert err["param"] == "session.audio.input.transcription.language"
    await ws.send("session.update", session={"audio": {"input": {"turn_detection": None, "transcription": {"model": "whisper-1"}}}})
    await ws.until("session.updated")
    h.engine("asr").mark_dead("gone")
    await ws.send("input_audio_buffer.append", audio=b64(tone(1.0)))
    await ws.send("input_audio_buffer.commit")
    failed = await ws.until("conversation.item.input_audio_transcription.failed")
    assert failed["error"]["code"] == "engine_unavailable" and failed["content_index"] == 0
    # the conversation goes on: the answer still comes
    await ws.send("response.create", response={"output_modalities": ["text"], "max_output_tokens": 2})
    assert (await ws.until("response.done"))["response"]["status"] == "completed"


@pytest.mark.parametrize("beta", [False, True])
async def test_a_transcription_session_transcribes_turns_and_never_answers(h, beta):
    from testkit.wire import b64, quiet, tone

    if beta:
        ws = await connect(h, "/v1/realtime?intent=transcription", {"openai-beta": "realtime=v1"})
        created = await ws.until("transcription_session.created")
        assert created["session"]["object"] == "realtime.transcription_session"
        await ws.send("transcription_session.update", session={"input_audio_transcription": {"model": "whisper-1", "language": "de"}})
        s = (await ws.until("transcription_session.updated"))["session"]
        assert s["input_audio_transcription"]["language"] == "de"
    else:
        ws = await session(h)
        await ws.send("session.update", session={"type": "transcription", "audio": {"input": {"transcription": {"model": "gpt-4o-transcribe"}}}})
        s = (await ws.until("session.updated"))["session"]
        assert s["type"] == "transcription" and s["audio"]["input"]["transcription"]["model"] == "gpt-4o-transcribe"
    # server VAD (the default) commits each turn; each is transcribed, none answered
    for _ in range(2):
        await ws.send("input_audio_buffer.append", audio=b64(quiet(0.6) + tone(0.8) + quiet(0.8)))
        await ws.until("conversation.item.input_audio_transcription.completed")
    await ws.send("response.create")
    assert (await ws.until("error"))["error"]["code"] == "invalid_request"
    assert "response.created" not in ws.types()
    assert len([t for t in ws.types() if t == "input_audio_buffer.committed"]) == 2
    assert h.processor("thinker").seen == []
