"""/v1/duplex on the shared server: capabilities, binary audio both ways at declared
rates, barge-in with playback acks, detach/resume, grace expiry, bad input, slow
consumers. Answers run to their token limit (tests.harness.SERVER_OVERLAY)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import numpy as np
import pytest

from clients.duplex import DuplexClient, audio_of
from clients.realtime import RealtimeError
from tests.harness import ADMIN_HEADERS, ADMIN_KEY, http_client, silence, speech_pcm16

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

GRACE_S = 4  # SERVER_OVERLAY sessions.disconnect_grace_s


def url(server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/duplex"


async def connect(server, **kw) -> DuplexClient:
    return await DuplexClient.connect(url(server), ADMIN_KEY, **kw)


async def manual(c: DuplexClient, **extra) -> None:
    await c.update(turn_detection=None, **extra)


async def ask(c: DuplexClient, text: str, tokens: int) -> None:
    await c.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
    await c.send("response.create", response={"max_output_tokens": tokens})


def sessions_of(api, kind: str = "duplex") -> dict[str, str]:
    return {s["id"]: s["state"] for s in api.get("/v1/sessions").json()["data"] if s["kind"] == kind}


async def test_session_created_declares_capabilities_and_a_resume_token(server):
    c = await connect(server)
    try:
        assert c.first["type"] == "session.created" and c.first["server_event_seq"] == 1
        caps = c.session["capabilities"]
        assert caps["supports_barge_in"] is True and caps["supports_session_resume"] is True
        assert caps["chunk_period_ms"] == 20 and 16000 in caps["input_formats"][0]["rates"]
        assert c.session["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
        assert isinstance(c.resume_token, str) and len(c.resume_token) >= 16
        await manual(c)
        await ask(c, "Hello there", 8)
        seen: list = []
        await c.until("response.done", seen)
        seqs = [e["server_event_seq"] for e in seen]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs) and seqs[0] > 1
        response_events = [e for e in seen if e["type"].startswith("response.")]
        assert response_events and all(e["epoch"] == 0 for e in response_events)
    finally:
        await c.close()


async def test_binary_audio_both_ways_at_declared_rates(server):
    """16 kHz speech in as binary frames, server VAD, the answer out as binary 16 kHz."""
    c = await connect(server)
    try:
        u = await c.update(
            max_output_tokens=8,
            audio={"input": {"format": {"type": "audio/pcm", "rate": 16000}}, "output": {"format": {"type": "audio/pcm", "rate": 16000}, "transport": "binary"}},
        )
        assert u["session"]["audio"]["output"] == {**u["session"]["audio"]["output"], "transport": "binary", "format": {"type": "audio/pcm", "rate": 16000}}
        speech = speech_pcm16("What is the weather like today?", rate=16000)
        await c.stream_audio(silence(0.4, 16000) + speech + silence(1.0, 16000), rate=16000, realtime=False)
        seen: list = []
        done = await c.until("response.done", seen)
        types = [e["type"] for e in seen]
        assert types.index("input_audio_buffer.speech_started") < types.index("input_audio_buffer.speech_stopped") < types.index("response.created")
        stopped = next(e for e in seen if e["type"] == "input_audio_buffer.speech_stopped")
        speech_ms = len(speech) * 1000 // 32000
        assert 400 + speech_ms * 0.5 <= stopped["audio_end_ms"] <= 400 + speech_ms + 700  # ms of the 24 kHz model timeline
        assert done["response"]["status"] == "completed"
        frames = [e for e in seen if e["type"] == "audio.binary"]
        assert frames and "response.output_audio.delta" not in types
        pcm = b"".join(f["audio"] for f in frames)
        assert len(pcm) % 2 == 0 and np.abs(np.frombuffer(pcm, "<i2")).max() > 0
    finally:
        await c.close()


async def test_realtime_pacing_sends_20ms_frames_no_faster_than_real_time(server):
    c = await connect(server)
    try:
        u = await c.update(turn_detection=None, audio={"output": {"transport": "binary", "pacing": "realtime"}})
        assert u["session"]["audio"]["output"]["pacing"] == "realtime"
        await ask(c, "Say something", 16)
        seen: list = []
        done = await c.until("response.done", seen)
        frames = [e for e in seen if e["type"] == "audio.binary"]
        assert done["response"]["status"] == "completed" and len(frames) > 10
        assert all(len(f["audio"]) <= 960 for f in frames)  # 20 ms at 24 kHz
        audio_s = sum(len(f["audio"]) for f in frames) / 48000
        # paced: the frames take about as long to arrive as they last (sent 100 ms ahead)
        assert frames[-1]["_t"] - frames[0]["_t"] >= audio_s - 0.1 - 0.1
        # and response.done comes after the answer's last frame
        assert seen.index(frames[-1]) < seen.index(done)
    finally:
        await c.close()


async def test_barge_in_stops_the_answer_and_keeps_only_what_was_heard(server):
    speech = speech_pcm16("Wait, stop, I have another question.")
    c = await connect(server)
    try:
        await c.update(max_output_tokens=120)
        await ask(c, "Tell me a long story", 120)
        seen: list = []
        first = await c.until("response.output_audio.delta", seen)
        rid = first["response_id"]
        await c.until("response.output_audio.delta", seen)
        await c.send("playback.ack", response_id=rid, played_ms=120)
        # the user talks over the agent
        await c.stream_audio(speech[: 24000 * 2], realtime=False)
        after: list = []
        done = await c.until("response.done", after)
        assert done["response"]["id"] == rid
        assert done["response"]["status"] == "cancelled", [e["type"] for e in after if "delta" not in e["type"]]
        assert done["response"]["status_details"]["reason"] == "turn_detected"
        cut = await c.until("conversation.item.truncated", after)
        assert cut["audio_end_ms"] == 120 and cut["item_id"] == done["response"]["output"][0]["id"]
        # nothing of the old response after its response.done; the next answer runs under a newer epoch
        await c.update(max_output_tokens=8)
        await c.stream_audio(speech[24000 * 2 :] + silence(1.0), realtime=False)
        rest: list = []
        second = await c.until("response.done", rest)
        assert second["response"]["id"] != rid and second["response"]["status"] == "completed"
        assert [e for e in rest if e.get("response_id") == rid] == []
        assert second["epoch"] > done["epoch"] >= 0
    finally:
        await c.close()


async def test_dropped_connection_resumes_the_same_session(server):
    api = http_client(server.url, ADMIN_HEADERS)
    c = await connect(server)
    sid, token = c.session_id, c.resume_token
    await manual(c)
    await ask(c, "My name is Ada. Tell me a story.", 40)
    seen: list = []
    await c.until("response.output_audio.delta", seen)
    rid = seen[-1]["response_id"]
    last_seq = c.last_seq
    await c.drop()  # the network goes away mid-answer
    await asyncio.sleep(0.3)
    assert sessions_of(api).get(sid) == "detached"
    # a new socket: session.created for a fresh session, then session.resume as the first event
    c2 = await connect(server)
    fresh = c2.session_id
    await c2.send("session.resume", session_id=sid, resume_token=token)
    resumed = await c2.until("session.resumed")
    assert resumed["session"]["id"] == sid and resumed["resume_token"] not in (None, token)
    # what was produced while away is replayed, in order, ending with the answer's response.done
    replay: list = []
    done = await c2.until("response.done", replay)
    assert done["response"]["id"] == rid and done["response"]["status"] == "completed"
    seqs = [e["server_event_seq"] for e in [resumed, *replay]]
    assert seqs == sorted(seqs) and seqs[0] > last_seq
    assert len(audio_of(replay, rid)) > 0 or resumed["dropped_events"] > 0
    # the conversation continues on the same session (the prompt holds the first turn)
    await ask(c2, "What is my name?", 8)
    turn2 = await c2.until("response.done")
    assert turn2["response"]["usage"]["input_tokens"] > done["response"]["usage"]["input_tokens"]
    states = sessions_of(api)
    assert states.get(sid) == "active" and fresh not in states  # the fresh session gave its slot back
    # the old token no longer works; the new one does (query form), taking the session over
    with pytest.raises(RealtimeError, match="invalid_resume_token"):
        await connect(server, session_id=sid, resume_token=token)
    c3 = await connect(server, session_id=sid, resume_token=resumed["resume_token"])
    assert c3.first["type"] == "session.resumed" and c3.session_id == sid
    closed = await c2.until("connection.closed")  # the taken-over socket ends
    assert closed["code"] == 1000
    await c3.send("session.close")
    bye = await c3.until("session.closed")
    assert bye["reason"] == "client_closed"
    assert (await c3.until("connection.closed"))["code"] == 1000
    await asyncio.sleep(0.2)
    assert sid not in sessions_of(api)
    api.close()


async def test_wrong_tokens_are_refused_and_change_nothing(server):
    api = http_client(server.url, ADMIN_HEADERS)
    c = await connect(server)
    sid, token = c.session_id, c.resume_token
    await c.drop()
    for i in range(20):
        with pytest.raises(RealtimeError, match="invalid_resume_token"):
            await connect(server, session_id=sid, resume_token=f"wrong-{i}")
    # the event form answers with an error and keeps the socket (and its own session)
    c2 = await connect(server)
    await c2.send("session.resume", session_id=sid, resume_token="wrong")
    err = await c2.until("error")
    assert err["error"]["code"] == "invalid_resume_token"
    await c2.send("session.resume", session_id="sess_nope", resume_token="x")
    assert (await c2.until("error"))["error"]["code"] == "session_not_found"
    assert sessions_of(api).get(sid) == "detached"
    c3 = await connect(server, session_id=sid, resume_token=token)
    assert c3.session_id == sid
    await c3.close()
    await c2.close()
    api.close()


async def test_grace_expiry_frees_the_session_and_its_work(server):
    api = http_client(server.url, ADMIN_HEADERS)
    c = await connect(server)
    sid, token = c.session_id, c.resume_token
    await manual(c)
    await ask(c, "Tell me a long story", 120)
    await c.until("response.output_audio.delta")
    await c.drop()
    deadline = time.monotonic() + GRACE_S + 10
    while sid in sessions_of(api) and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
    assert sid not in sessions_of(api)
    health = api.get("/health").json()
    assert health["running_requests"] == 0
    c2 = await connect(server)
    await c2.send("session.resume", session_id=sid, resume_token=token)
    expired = await c2.until("session.expired")
    assert expired["session_id"] == sid and expired["reason"] == "disconnect_grace_expired"
    # the socket and its own fresh session go on
    await manual(c2)
    await ask(c2, "Hello", 8)
    assert (await c2.until("response.done"))["response"]["status"] == "completed"
    await c2.close()
    api.close()


async def test_bad_input_gets_error_events_and_the_session_continues(server):
    c = await connect(server)
    try:
        await manual(c)
        bad_frames = [b"\x02" + bytes(640), b"\x01" + bytes(3), b"\x01", b"", b"\x01" + bytes((1 << 20) + 2)]
        for frame in bad_frames:
            await c.ws.send(frame)
            err = await c.until("error")
            assert err["error"]["code"] == "invalid_frame", err
        for body in (
            {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 12345}}}},
            {"audio": {"output": {"format": {"type": "audio/pcm", "rate": True}}}},
            {"audio": {"output": {"transport": "carrier-pigeon"}}},
            {"input_audio_format": "g711_ulaw"},
        ):
            await c.send("session.update", session=body)
            err = await c.until("error")
            assert err["error"]["code"] == "invalid_value", err
        await c.send("no.such.event")
        assert (await c.until("error"))["error"]["code"] == "invalid_value"
        await c.send("playback.ack", response_id="resp_nope", played_ms=10)
        assert (await c.until("error"))["error"]["code"] == "response_not_found"
        await c.send("session.resume", session_id="x", resume_token="y")  # not the first event
        assert (await c.until("error"))["error"]["code"] == "invalid_value"
        await c.ws.send("{not json")
        assert (await c.until("error"))["error"]["code"] == "invalid_json"
        # still a working session
        await ask(c, "Hi", 8)
        done = await c.until("response.done")
        assert done["response"]["status"] == "completed"
    finally:
        await c.close()


async def test_a_client_that_never_reads_is_dropped_and_others_are_unaffected(server):
    import websockets

    api = http_client(server.url, ADMIN_HEADERS)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a tiny window: the server's writes back up
    host, port = server.url.split("//")[1].split(":")
    sock.connect((host, int(port)))
    # no keepalive pings: a client that never reads would time its own pings out and
    # leave (then the session ends by grace expiry instead of as a slow consumer)
    slow = await websockets.connect(url(server), sock=sock, additional_headers={"Authorization": f"Bearer {ADMIN_KEY}"}, max_size=None,
                                    max_queue=1, ping_interval=None)
    created = json.loads(await slow.recv())
    sid = created["session"]["id"]
    # 48 kHz JSON audio: the most bytes per event, so the kernel's socket buffers (MBs
    # on loopback) fill after a couple of answers and the server's queue starts to grow
    await slow.send(json.dumps({"type": "session.update", "session": {"turn_detection": None, "audio": {"output": {"format": {"type": "audio/pcm", "rate": 48000}}}}}))

    async def keep_asking() -> None:
        # until the session is dropped (cancelled below): on a loaded machine answers
        # come slower and it takes more of them to fill the buffers
        for i in range(40):
            await slow.send(json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"Talk {i}"}]}}))
            await slow.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 120}}))
            await asyncio.sleep(4)

    asker = asyncio.get_running_loop().create_task(keep_asking())
    # meanwhile another client is served normally
    other = await connect(server)
    await manual(other)
    await ask(other, "Hello", 8)
    assert (await other.until("response.done"))["response"]["status"] == "completed"
    deadline = time.monotonic() + 160
    while sid in sessions_of(api) and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
    assert sid not in sessions_of(api), "the session of a client that never reads was not ended"
    ended = [line for line in api.get("/metrics").text.splitlines() if line.startswith('omni_rt_sessions_ended_total{kind="duplex"')]
    assert any('reason="slow_consumer"' in line for line in ended), ended
    await ask(other, "Still there?", 8)
    assert (await other.until("response.done"))["response"]["status"] == "completed"
    await other.close()
    asker.cancel()
    await asyncio.gather(asker, return_exceptions=True)
    slow.transport.abort()
    api.close()
