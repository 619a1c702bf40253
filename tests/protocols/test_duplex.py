"""/v1/duplex semantics in-process (the real app over fakes, driven by the project's
DuplexClient): capabilities, rates, pacing, barge-in with playback acks, detach and
resume with replay, grace expiry on the lease clock, bad input, slow consumers,
faults."""

from __future__ import annotations

import asyncio
import time

import pytest

from clients.duplex import DuplexClient, audio_of
from clients.realtime import RealtimeError
from omni_rt.errors import ConnectorError
from protocols.duplex import Duplex, DuplexTiming
from testkit import serve
from testkit.wire import quiet, tone

GRACE_S = 30


@pytest.fixture
async def h():
    async with serve(["voice"], {"sessions": {"disconnect_grace_s": GRACE_S, "max_pending_events": 16}},
                     duplex_timing=DuplexTiming(heartbeat_s=0.2, send_timeout_s=0.3)) as harness:
        yield harness


async def connect(h, **kw) -> DuplexClient:
    return await DuplexClient.connect(h.url("/v1/duplex", ws=True), **kw)


async def ask(c: DuplexClient, text: str, tokens: int) -> None:
    await c.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
    await c.send("response.create", response={"max_output_tokens": tokens})


def state(h, sid: str) -> str | None:
    s = next((s for s in h.sessions.sessions() if s.id == sid), None)
    return s.state.value if s is not None else None


async def wait_for(cond, timeout: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


async def test_session_created_declares_capabilities_a_resume_token_and_sequence_numbers(h):
    c = await connect(h)
    assert c.first["type"] == "session.created" and c.first["server_event_seq"] == 1
    caps = c.session["capabilities"]
    assert caps["supports_barge_in"] and caps["supports_session_resume"] and caps["chunk_period_ms"] == 20
    assert 16000 in caps["input_formats"][0]["rates"] and caps["disconnect_grace_s"] == GRACE_S
    assert c.session["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert isinstance(c.resume_token, str) and len(c.resume_token) >= 16
    await c.update(turn_detection=None)
    await ask(c, "Hello there", 4)
    seen: list = []
    await c.until("response.done", seen)
    seqs = [e["server_event_seq"] for e in seen]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs) and seqs[0] > 1
    assert all(e["epoch"] == 0 for e in seen if e["type"].startswith("response."))
    beat = await c.until("heartbeat", timeout=1)  # every heartbeat_s while attached
    assert beat["interval_s"] == 0.2
    await c.close()


async def test_a_plain_http_request_is_told_the_wire_is_a_websocket_and_takes_no_session(h):
    r = await h.client.get("/v1/duplex")
    assert r.status == 400 and (await r.json())["error"]["code"] == "websocket_required"
    assert not h.sessions.sessions()


async def test_a_fault_setting_up_the_conversation_ends_the_session_it_opened(h, monkeypatch):
    """The session is admitted, then its conversation cannot be set up (a VAD that does
    not load, say): the client gets the HTTP error and the session does not stay open,
    holding a slot until its idle lease runs out."""
    import aiohttp

    def broken(*args, **kwargs):
        raise RuntimeError("the VAD did not load")

    monkeypatch.setattr(Duplex, "create", broken)
    with pytest.raises(aiohttp.WSServerHandshakeError) as exc:
        await h.client.ws_connect("/v1/duplex")
    assert exc.value.status == 500
    assert not [s for s in h.sessions.sessions() if s.is_open]
    monkeypatch.undo()
    c = await connect(h)  # and the server goes on
    assert c.first["type"] == "session.created"
    await c.close()


async def test_binary_audio_both_ways_at_declared_rates_with_server_vad(h):
    c = await connect(h)
    u = await c.update(max_output_tokens=4, audio={"input": {"format": {"type": "audio/pcm", "rate": 16000}},
                                                     "output": {"format": {"type": "audio/pcm", "rate": 16000}, "transport": "binary"}})
    assert u["session"]["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 16000}
    assert u["session"]["audio"]["output"]["transport"] == "binary"
    await c.stream_audio(quiet(0.4, 16000) + tone(0.5, 16000) + quiet(0.7, 16000), rate=16000, realtime=False)
    seen: list = []
    done = await c.until("response.done", seen)
    t = [e["type"] for e in seen]
    assert t.index("input_audio_buffer.speech_started") < t.index("input_audio_buffer.speech_stopped") < t.index("response.created")
    stopped = next(e for e in seen if e["type"] == "input_audio_buffer.speech_stopped")
    assert 900 <= stopped["audio_end_ms"] <= 920  # on the 24 kHz model timeline
    assert done["response"]["status"] == "completed" and "response.output_audio.delta" not in t
    pcm = audio_of(seen)
    # 4 frames of 2048 samples at 24 kHz, resampled to 16 kHz
    assert abs(len(pcm) // 2 - 4 * 2048 * 2 // 3) <= 64
    await c.close()


async def test_realtime_pacing_sends_20ms_frames_no_faster_than_real_time(h):
    c = await connect(h)
    u = await c.update(turn_detection=None, audio={"output": {"transport": "binary", "pacing": "realtime"}})
    assert u["session"]["audio"]["output"]["pacing"] == "realtime"
    await ask(c, "Say something", 3)  # 3 frames: 256 ms of audio
    seen: list = []
    done = await c.until("response.done", seen)
    frames = [e for e in seen if e["type"] == "audio.binary"]
    assert done["response"]["status"] == "completed" and len(frames) >= 12
    assert all(len(f["audio"]) <= 960 for f in frames)  # 20 ms at 24 kHz
    audio_s = sum(len(f["audio"]) for f in frames) / 48000
    # paced: the frames take about as long to arrive as they last (sent 100 ms ahead)
    assert frames[-1]["_t"] - frames[0]["_t"] >= audio_s - 0.1 - 0.03
    assert seen.index(frames[-1]) < seen.index(done)  # response.done after the answer's last frame
    await c.close()


async def test_barge_in_stops_the_answer_and_keeps_only_what_was_heard(h):
    c = await connect(h)
    await c.update(max_output_tokens=400)
    await ask(c, "Tell me a long story", 400)
    first = await c.until("response.output_audio.delta")
    rid = first["response_id"]
    await c.send("playback.ack", response_id=rid, played_ms=40)
    await c.stream_audio(tone(0.3), realtime=False)  # the user talks over the agent
    after: list = []
    done = await c.until("response.done", after)
    assert done["response"]["id"] == rid and done["response"]["status"] == "cancelled"
    assert done["response"]["status_details"]["reason"] == "turn_detected"
    cut = await c.until("conversation.item.truncated", after)
    assert cut["audio_end_ms"] == 40 and cut["item_id"] == done["response"]["output"][0]["id"]
    await c.update(max_output_tokens=2)
    await c.stream_audio(quiet(0.6), realtime=False)
    rest: list = []
    second = await c.until("response.done", rest)
    assert second["response"]["id"] != rid and second["response"]["status"] == "completed"
    assert [e for e in rest if e.get("response_id") == rid] == []
    assert second["epoch"] > done["epoch"] >= 0
    # the next prompt holds the part of the answer that was heard, and no more
    heard = h.processor("thinker").seen[-1]["messages"][1]
    assert heard["role"] == "assistant" and 0 < len(heard["content"].split()) < 20
    await c.close()


async def test_a_cancelled_answer_is_kept_as_far_as_it_was_heard(h):
    c = await connect(h)
    await c.update(turn_detection=None)
    await ask(c, "Talk", 400)
    first = await c.until("response.output_audio.delta")
    await c.send("playback.ack", response_id=first["response_id"], played_ms=10)
    await c.send("response.cancel")
    seen: list = []
    cut = await c.until("conversation.item.truncated", seen)
    assert cut["audio_end_ms"] == 10
    await c.close()


async def test_a_dropped_connection_resumes_the_same_session_and_replays_what_it_missed(h):
    c = await connect(h)
    sid, token = c.session_id, c.resume_token
    await c.update(turn_detection=None)
    await ask(c, "My name is Ada. Tell me a story.", 40)
    await c.until("response.output_audio.delta")
    last_seq = c.last_seq
    await c.drop()  # the network goes away mid-answer
    await wait_for(lambda: state(h, sid) == "detached")
    c2 = await connect(h)  # a new socket: a fresh session, then session.resume as its first event
    fresh = c2.session_id
    await c2.send("session.resume", session_id=sid, resume_token=token)
    resumed = await c2.until("session.resumed")
    assert resumed["session"]["id"] == sid and resumed["resume_token"] not in (None, token)
    replay: list = []
    done = await c2.until("response.done", replay)
    assert done["response"]["status"] == "completed"
    seqs = [e["server_event_seq"] for e in [resumed, *replay]]
    assert seqs == sorted(seqs) and seqs[0] > last_seq
    await ask(c2, "What is my name?", 2)
    turn2 = await c2.until("response.done")
    assert turn2["response"]["usage"]["input_tokens"] > done["response"]["usage"]["input_tokens"]
    await wait_for(lambda: state(h, fresh) is None)  # the fresh session gave its slot back
    assert state(h, sid) == "active"
    with pytest.raises(RealtimeError, match="invalid_resume_token"):
        await connect(h, session_id=sid, resume_token=token)  # the old token is spent
    c3 = await connect(h, session_id=sid, resume_token=resumed["resume_token"])  # query form, takes over
    assert c3.first["type"] == "session.resumed" and c3.session_id == sid
    assert (await c2.until("connection.closed"))["code"] == 1000
    await c3.send("session.close")
    assert (await c3.until("session.closed"))["reason"] == "client_closed"
    assert (await c3.until("connection.closed"))["code"] == 1000
    await wait_for(lambda: state(h, sid) is None)


async def test_wrong_tokens_are_refused_and_change_nothing(h):
    c = await connect(h)
    sid, token = c.session_id, c.resume_token
    await c.drop()
    await wait_for(lambda: state(h, sid) == "detached")
    for i in range(5):
        with pytest.raises(RealtimeError, match="invalid_resume_token"):
            await connect(h, session_id=sid, resume_token=f"wrong-{i}")
    c2 = await connect(h)
    await c2.send("session.resume", session_id=sid, resume_token="wrong")
    assert (await c2.until("error"))["error"]["code"] == "invalid_resume_token"
    await c2.send("session.resume", session_id="sess_nope", resume_token="x")
    assert (await c2.until("error"))["error"]["code"] == "session_not_found"
    assert state(h, sid) == "detached"
    c3 = await connect(h, session_id=sid, resume_token=token)
    assert c3.session_id == sid
    await c3.close()
    await c2.close()


async def test_grace_expiry_frees_the_session_and_its_work(h):
    c = await connect(h)
    sid, token = c.session_id, c.resume_token
    await c.update(turn_detection=None)
    await ask(c, "Tell me a long story", 400)
    await c.until("response.output_audio.delta")
    await c.drop()
    await wait_for(lambda: state(h, sid) == "detached")
    assert await h.expire(GRACE_S - 1) == []  # still within its grace
    assert h.runtime.orchestrator.running()  # the answer kept running while away
    assert await h.expire(1) == [sid]
    assert h.runtime.orchestrator.running() == [] and state(h, sid) is None
    c2 = await connect(h)
    await c2.send("session.resume", session_id=sid, resume_token=token)
    expired = await c2.until("session.expired")
    assert expired["session_id"] == sid and expired["reason"] == "disconnect_grace_expired"
    await c2.update(turn_detection=None)
    await ask(c2, "Hello", 2)
    assert (await c2.until("response.done"))["response"]["status"] == "completed"
    await c2.close()


async def test_bad_input_gets_error_events_and_the_session_continues(h):
    c = await connect(h)
    await c.update(turn_detection=None)
    for frame in (b"\x02" + bytes(640), b"\x01" + bytes(3), b"\x01", b"\x01" + bytes((1 << 20) + 2)):
        await c.ws.send(frame)
        assert (await c.until("error"))["error"]["code"] == "invalid_frame"
    for body, param in (
        ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 12345}}}}, "session.audio.input.format"),
        ({"audio": {"output": {"format": {"type": "audio/pcm", "rate": True}}}}, "session.audio.output.format"),
        ({"audio": {"output": {"transport": "carrier-pigeon"}}}, "session.audio.output.transport"),
        ({"input_audio_format": "g711_ulaw"}, "session.input_audio_format"),
    ):
        await c.send("session.update", session=body)
        err = (await c.until("error"))["error"]
        assert (err["code"], err["param"]) == ("invalid_value", param), err
    await c.send("no.such.event")
    assert (await c.until("error"))["error"]["code"] == "invalid_value"
    await c.send("playback.ack", response_id="resp_nope", played_ms=10)
    assert (await c.until("error"))["error"]["code"] == "response_not_found"
    await c.send("playback.ack", response_id="resp_nope", played_ms=-1)
    assert (await c.until("error"))["error"]["code"] == "invalid_value"
    await c.send("session.resume", session_id="x", resume_token="y")  # not the first event
    assert (await c.until("error"))["error"]["code"] == "invalid_value"
    await c.ws.send("{not json")
    assert (await c.until("error"))["error"]["code"] == "invalid_json"
    await ask(c, "Hi", 2)
    assert (await c.until("response.done"))["response"]["status"] == "completed"
    await c.close()


def stall_writes(monkeypatch) -> None:
    """Sockets opened with `?stall=N` stop taking data after N messages, as a client
    that no longer reads backs up the server's socket buffers (a lossy fake transport:
    the kernel's loopback buffers would take seconds of audio to fill)."""
    from protocols.ws import Socket

    send = Socket.send
    sent: dict[int, int] = {}

    async def stalled(self, data):
        limit = self.request.query.get("stall")
        if limit is not None:
            sent[id(self)] = sent.get(id(self), 0) + 1
            if sent[id(self)] > int(limit):
                await asyncio.Event().wait()  # never returns: the write never drains
        await send(self, data)

    monkeypatch.setattr(Socket, "send", stalled)


@pytest.mark.parametrize("paced", [False, True])
async def test_a_client_that_stops_reading_is_dropped_and_others_are_unaffected(h, monkeypatch, paced):
    slow = await connect(h)
    sid, token = slow.session_id, slow.resume_token
    output = {"pacing": "realtime"} if paced else {}
    await slow.update(turn_detection=None, audio={"output": output})
    await slow.drop()
    stall_writes(monkeypatch)
    slow = await DuplexClient.connect(h.url("/v1/duplex?stall=1", ws=True), session_id=sid, resume_token=token)
    await ask(slow, "Talk", 400)
    other = await connect(h)
    await other.update(turn_detection=None)
    await ask(other, "Hello", 2)
    assert (await other.until("response.done"))["response"]["status"] == "completed"
    # unpaced: the session's queue reaches max_pending_events; paced: a send stays
    # blocked for send_timeout_s
    await wait_for(lambda: state(h, sid) is None, timeout=2)
    assert h.sessions.stats["closed"] >= 1
    assert ("duplex", "slow_consumer") in {(k, r) for k, r in _ended(h)}
    # the end scheduled from inside was held until it finished (its task leaves the set
    # in its done callback, which runs on the loop's next turn)
    await wait_for(lambda: h.sessions.background == set(), timeout=2)
    await ask(other, "Still there?", 2)
    assert (await other.until("response.done"))["response"]["status"] == "completed"
    await other.close()
    await slow.drop()


def _ended(h) -> list[tuple[str, str]]:
    from omni_rt import metrics

    out = []
    for metric in metrics.SESSIONS_ENDED.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.value > 0:
                out.append((sample.labels["kind"], sample.labels["reason"]))
    return out


async def test_a_paced_answer_cut_off_by_a_dropped_socket_is_replayed_without_a_gap(h):
    c = await connect(h)
    await c.update(turn_detection=None, audio={"output": {"transport": "binary", "pacing": "realtime"}})
    await ask(c, "Talk", 3)
    got = [await c.until("audio.binary") for _ in range(2)]  # 40 ms into the first chunk (85 ms)
    sid, token = c.session_id, c.resume_token
    await c.close()
    got += [e for e in c.drain() if e["type"] == "audio.binary"]  # what arrived before the close
    await wait_for(lambda: state(h, sid) == "detached")
    c2 = await connect(h, session_id=sid, resume_token=token)
    rest: list = []
    done = await c2.until("response.done", rest)
    before = b"".join(e["audio"] for e in got)
    received = len(before) + len(audio_of(rest))
    rid = done["response"]["id"]
    produced = h.sessions.sessions()[0].kept(Duplex).transport.output.answers[rid].samples * 2
    assert received == produced, (received, produced)
    await c2.close()


async def test_a_fault_in_the_server_ends_the_session_with_1011_instead_of_detaching_it(h, monkeypatch):
    from protocols.realtime.conversation import Conversation

    def broken(self, ev):
        raise ConnectorError("handle lost")

    monkeypatch.setattr(Conversation, "item_delete", broken)
    c = await connect(h)
    sid = c.session_id
    await c.send("conversation.item.delete", item_id="x")
    seen: list = []
    err = await c.until("error", seen)
    assert err["error"]["type"] == "server_error" and err["error"]["message"] == "internal error"
    assert (await c.until("connection.closed"))["code"] == 1011
    await wait_for(lambda: state(h, sid) is None)  # ended, not left resumable
