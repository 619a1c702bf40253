"""/v1/realtime with the official openai SDK (GA and beta clients) on the real server."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any

import httpx
import numpy as np
import pytest

from testkit.harness import ADMIN_HEADERS, ADMIN_KEY, http_client, silence, speech_pcm16

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

BETA_ONLY = {"response.audio.delta", "response.audio.done", "response.audio_transcript.delta",
             "response.audio_transcript.done", "response.text.delta", "response.text.done", "conversation.item.created"}
GA_ONLY = {"response.output_audio.delta", "response.output_audio.done", "response.output_audio_transcript.delta",
           "response.output_audio_transcript.done", "response.output_text.delta", "response.output_text.done",
           "conversation.item.added", "conversation.item.done"}


def client(server, key: str = ADMIN_KEY):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{server.url}/v1", websocket_base_url=f"ws://127.0.0.1:{server.port}/v1", api_key=key)


def connect(server, dialect: str, key: str = ADMIN_KEY):
    c = client(server, key)
    rt = c.realtime if dialect == "ga" else c.beta.realtime
    return rt.connect(model="gpt-realtime")


def names(dialect: str) -> dict[str, str]:
    ga = dialect == "ga"
    return {
        "audio": "response.output_audio.delta" if ga else "response.audio.delta",
        "transcript": "response.output_audio_transcript.delta" if ga else "response.audio_transcript.delta",
        "text": "response.output_text.delta" if ga else "response.text.delta",
        "text_done": "response.output_text.done" if ga else "response.text.done",
        "item": "conversation.item.added" if ga else "conversation.item.created",
    }


async def manual_mode(conn, dialect: str) -> None:
    if dialect == "ga":
        await conn.session.update(session={"type": "realtime", "instructions": "Answer briefly.", "audio": {"input": {"turn_detection": None}}})
    else:
        await conn.session.update(session={"instructions": "Answer briefly.", "turn_detection": None})
    ev = await conn.recv()
    assert ev.type == "session.updated"


async def until(conn, stop: str | set[str], seen: list) -> Any:
    stops = {stop} if isinstance(stop, str) else stop
    async for ev in conn:
        seen.append(ev)
        if ev.type in stops:
            return ev
    raise AssertionError(f"connection ended before {stop}")


def noise_pcm16(seconds: float, seed: int = 0) -> bytes:
    return (np.random.default_rng(seed).standard_normal(int(24000 * seconds)) * 3000).astype("<i2").tobytes()


async def append(conn, pcm: bytes, chunk: int = 9600) -> None:
    for i in range(0, len(pcm), chunk):
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i : i + chunk]).decode())


@pytest.mark.parametrize("dialect", ["ga", "beta"])
async def test_text_turn_event_sequence_and_ids(server, dialect):
    n = names(dialect)
    async with connect(server, dialect) as conn:
        created = await conn.recv()
        assert created.type == "session.created"
        s = created.session
        if dialect == "ga":
            assert s.type == "realtime" and s.audio.input.format.type == "audio/pcm" and s.audio.input.format.rate == 24000
            assert s.audio.input.turn_detection.type == "server_vad"
        else:
            assert s.input_audio_format == "pcm16" and s.output_audio_format == "pcm16" and s.turn_detection.type == "server_vad"
        await manual_mode(conn, dialect)
        await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello!"}]})
        mod = {"output_modalities": ["text"]} if dialect == "ga" else {"modalities": ["text"]}
        await conn.response.create(response=mod)
        seen: list = []
        done = await until(conn, "response.done", seen)
    types = [e.type for e in seen]
    head = [n["item"]] + (["conversation.item.done"] if dialect == "ga" else [])
    head += ["response.created", "response.output_item.added", n["item"], "response.content_part.added"]
    assert types[: len(head)] == head, types
    deltas = [e for e in seen if e.type == n["text"]]
    assert deltas and types[len(head) : len(head) + len(deltas)] == [n["text"]] * len(deltas)
    tail = [n["text_done"], "response.content_part.done", "response.output_item.done"]
    tail += ["conversation.item.done"] if dialect == "ga" else []
    assert types[len(head) + len(deltas) :] == tail + ["response.done"], types
    rid = next(e for e in seen if e.type == "response.created").response.id
    iid = next(e for e in seen if e.type == "response.output_item.added").item.id
    assert all(d.response_id == rid and d.item_id == iid for d in deltas)
    text_done = next(e for e in seen if e.type == n["text_done"])
    assert text_done.text == "".join(d.delta for d in deltas)
    assert done.response.id == rid and done.response.status == "completed"
    assert done.response.usage.input_tokens > 0 and done.response.usage.output_tokens > 0
    assert not set(types) & (BETA_ONLY if dialect == "ga" else GA_ONLY)


@pytest.mark.parametrize("dialect", ["ga", "beta"])
async def test_manual_audio_turns_keep_history(server, dialect):
    n = names(dialect)
    async with connect(server, dialect) as conn:
        await conn.recv()
        await manual_mode(conn, dialect)
        usages = []
        for turn in range(2):
            await append(conn, noise_pcm16(1.0, seed=turn))
            await conn.input_audio_buffer.commit()
            limit = {"max_output_tokens": 8} if dialect == "ga" else {"max_response_output_tokens": 8}
            await conn.response.create(response=limit)
            seen: list = []
            done = await until(conn, "response.done", seen)
            types = [e.type for e in seen]
            assert types[0] == "input_audio_buffer.committed" and types[1] == n["item"]
            assert done.response.status == "completed", done.response.status_details
            audio = b"".join(base64.b64decode(e.delta) for e in seen if e.type == n["audio"])
            assert len(audio) > 0 and len(audio) % 2 == 0
            assert any(e.type == n["transcript"] for e in seen)
            assert not set(types) & (BETA_ONLY if dialect == "ga" else GA_ONLY)
            usages.append(done.response.usage.input_tokens)
        assert usages[1] > usages[0]  # the second prompt carries the first turn


async def raw_ws(server, key: str = ADMIN_KEY):
    import websockets

    return await websockets.connect(
        f"ws://127.0.0.1:{server.port}/v1/realtime?model=gpt-realtime", additional_headers={"Authorization": f"Bearer {key}"}
    )


async def recv_json(ws, timeout: float = 30) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


def _busy(api: httpx.Client) -> tuple[int, int]:
    h = api.get("/health").json()
    load = sum(r["engine"]["load"] + r["engine"].get("unfinished", 0) for st in h["stages"].values() for r in st["replicas"])
    return h["running_requests"], load


async def test_disconnect_mid_response_frees_all_engine_work(server):
    api = http_client(server.url, ADMIN_HEADERS, timeout=30)
    ws = await raw_ws(server)
    await recv_json(ws)
    await ws.send(json.dumps({"type": "session.update", "session": {"turn_detection": None}}))
    # answers run to their token limit (testkit.harness.SERVER_OVERLAY)
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me a long story"}]}
    await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
    await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 120}}))
    seen: list[str] = []
    t0 = time.monotonic()
    while not seen or seen[-1] not in ("response.output_audio.delta", "response.done"):
        seen.append((await recv_json(ws))["type"])
    assert seen[-1] == "response.output_audio.delta", seen
    waited = time.monotonic() - t0
    assert _busy(api)[0] >= 1, (waited, seen, api.get("/health").json())
    await ws.close()
    deadline = time.monotonic() + 15

    def left() -> tuple[tuple[int, int], list]:
        sessions = api.get("/v1/sessions").json()["data"]
        return _busy(api), [(s["id"], s["state"]) for s in sessions if s["kind"] == "realtime"]

    state = left()
    while state != ((0, 0), []) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        state = left()
    assert state == ((0, 0), []), state
    api.close()


@pytest.mark.parametrize("dialect", ["ga", "beta"])
async def test_server_vad_turn_driven_by_real_speech(server, dialect):
    n = names(dialect)
    speech = speech_pcm16("Hello, can you tell me what the weather is like today?")
    async with connect(server, dialect) as conn:
        await conn.recv()
        limit = {"max_output_tokens": 8} if dialect == "ga" else {"max_response_output_tokens": 8}
        if dialect == "ga":
            await conn.session.update(session={"type": "realtime", **limit})
        else:
            await conn.session.update(session=limit)
        assert (await conn.recv()).type == "session.updated"
        await append(conn, silence(0.6) + speech + silence(1.0), chunk=4800)
        seen: list = []
        done = await until(conn, "response.done", seen)
    types = [e.type for e in seen]
    i_start, i_stop = types.index("input_audio_buffer.speech_started"), types.index("input_audio_buffer.speech_stopped")
    i_commit, i_created = types.index("input_audio_buffer.committed"), types.index("response.created")
    assert i_start < i_stop < i_commit < types.index(n["item"]) < i_created
    started, stopped, committed = seen[i_start], seen[i_stop], seen[i_commit]
    assert started.item_id == stopped.item_id == committed.item_id
    speech_ms = len(speech) * 1000 // 48000
    # speech begins at 600 ms; audio_start_ms includes the 300 ms prefix padding
    assert 150 <= started.audio_start_ms <= 600, started.audio_start_ms
    assert 600 + speech_ms * 0.5 <= stopped.audio_end_ms <= 600 + speech_ms + 600, (stopped.audio_end_ms, speech_ms)
    assert done.response.status == "completed"
    assert any(e.type == n["audio"] for e in seen)


async def test_barge_in_cancels_the_response_and_no_stale_audio_follows(server):
    n = names("ga")
    speech = speech_pcm16("Please tell me a long story about the sea.")
    async with connect(server, "ga") as conn:
        await conn.recv()
        # a long answer, so that generation is still running when the user cuts in
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 120})
        assert (await conn.recv()).type == "session.updated"
        await append(conn, silence(0.3) + speech + silence(1.0), chunk=4800)
        # answers run to their token limit (testkit.harness.SERVER_OVERLAY)
        seen: list = []
        assert (await until(conn, {n["audio"], "response.done"}, seen)).type == n["audio"], [e.type for e in seen]
        # the agent is speaking
        rid = next(e for e in seen if e.type == "response.created").response.id
        t0 = time.monotonic()
        await append(conn, speech[: 24000 * 2], chunk=4800)  # the user talks over it
        events: list = []
        done = await until(conn, "response.done", events)
        assert done.response.id == rid
        assert done.response.status == "cancelled", (time.monotonic() - t0, done.response.usage, [e.type for e in events if "delta" not in e.type])
        assert time.monotonic() - t0 < 10
        assert done.response.status_details.reason == "turn_detected"
        types = [e.type for e in events]
        assert "input_audio_buffer.speech_started" in types
        assert types.index("input_audio_buffer.speech_started") < types.index("response.done")
        # finish the second utterance: its response comes, and nothing of the old one
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 8})
        await append(conn, speech[24000 * 2 :] + silence(1.0), chunk=4800)
        after: list = []
        second = await until(conn, "response.done", after)
        assert second.response.id != rid and second.response.status == "completed"
        assert [e for e in after if getattr(e, "response_id", None) == rid] == []
        # history keeps the cancelled answer as an incomplete item
        assert done.response.output[0].status == "incomplete"


async def test_semantic_vad_keeps_a_hesitating_caller_in_one_turn_and_idle_timeout_nudges(server):
    """The real server's semantic_vad (silero + Smart Turn v3): a caller who hesitates
    mid-sentence ("…to, um," then a second of silence) is one turn, where server_vad's
    500 ms of silence cut it in two; then idle_timeout_ms answers the silence after the
    answer played."""
    first, rest = speech_pcm16("I would like to book a flight to, um,"), speech_pcm16("Paris next Tuesday morning.")
    utterance = silence(0.5) + first + silence(1.0) + rest + silence(4.5)  # medium waits at most 4 s
    counts = {}
    for td in ({"type": "semantic_vad", "eagerness": "medium"}, {"type": "server_vad"}):
        async with connect(server, "ga") as conn:
            await conn.recv()
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "max_output_tokens": 4,
                                               "audio": {"input": {"turn_detection": td}}})
            assert (await conn.recv()).type == "session.updated"
            await append(conn, utterance, chunk=4800)
            seen: list = []
            await until(conn, "response.done", seen)
            await asyncio.sleep(1.0)  # a second answer, if the turn was cut, would be under way
            await append(conn, silence(0.2), chunk=4800)
            more: list = []
            try:
                async with asyncio.timeout(5):
                    await until(conn, "input_audio_buffer.committed", more)
            except TimeoutError:
                pass
            counts[td["type"]] = sum(e.type == "input_audio_buffer.committed" for e in seen + more)
    assert counts == {"semantic_vad": 1, "server_vad": 2}, counts
    async with connect(server, "ga") as conn:
        await conn.recv()
        idle: dict[str, Any] = {"type": "server_vad", "idle_timeout_ms": 1500}
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "max_output_tokens": 4,
                                           "audio": {"input": {"turn_detection": idle}}})
        assert (await conn.recv()).type == "session.updated"
        await append(conn, silence(0.3) + rest + silence(1.0), chunk=4800)
        seen = []
        await until(conn, "response.done", seen)
        await append(conn, silence(2.5), chunk=4800)
        seen = []
        done = await until(conn, "response.done", seen)
        types = [e.type for e in seen]
        assert "input_audio_buffer.timeout_triggered" in types and "input_audio_buffer.speech_started" not in types
        trig = seen[types.index("input_audio_buffer.timeout_triggered")]
        assert trig.audio_end_ms - trig.audio_start_ms >= 1500
        assert done.response.status == "completed"


async def test_input_transcription_streams_while_the_caller_speaks(server):
    """gpt-4o-transcribe on the real server: the stt stage (Kyutai STT, the tiny random
    one) writes `…delta` events before the turn is committed, `…completed` after it."""
    speech = speech_pcm16("Hello, can you tell me what the weather is like today?")
    async with connect(server, "ga") as conn:
        await conn.recv()
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "max_output_tokens": 4,
                                           "audio": {"input": {"transcription": {"model": "gpt-4o-transcribe"}}}})
        assert (await conn.recv()).type == "session.updated"
        pcm = silence(0.3) + speech + silence(1.0)
        for i in range(0, len(pcm), 4800):  # in real time, as a caller speaks
            await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i : i + 4800]).decode())
            await asyncio.sleep(0.1)
        seen: list = []
        done = await until(conn, "conversation.item.input_audio_transcription.completed", seen)
    types = [e.type for e in seen]
    deltas = [e for e in seen if e.type == "conversation.item.input_audio_transcription.delta"]
    assert deltas and types.index("conversation.item.input_audio_transcription.delta") < types.index("input_audio_buffer.committed")
    assert done.transcript == "".join(d.delta for d in deltas).strip()
