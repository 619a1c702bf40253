"""`/v1/duplex?model=moshi` in-process: the real wire, sessions, frame clock, buffering
and admission of the moshi pipeline over the fake step (`testkit.stages.FakeMoshi`:
each frame's voice is the user's frame at half amplitude)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest
from aiohttp import WSMsgType, WSServerHandshakeError

from testkit import serve

FRAME = 1920
CHUNK = 480  # 20 ms at 24 kHz


def pcm(value: float, samples: int = CHUNK) -> bytes:
    return b"\x01" + (np.full(samples, value, np.float32) * 32767).astype("<i2").tobytes()


async def created(ws: Any) -> dict[str, Any]:
    msg = await ws.receive(timeout=5)
    ev = json.loads(msg.data)
    assert ev["type"] == "session.created", ev
    return ev


async def talk(ws: Any, value: float, seconds: float, got: list[np.ndarray], events: list[dict[str, Any]]) -> None:
    """Send `seconds` of a constant signal in real time (20 ms chunks) while reading
    what comes back; `got` collects the audio frames received while still sending."""

    async def read() -> None:
        while True:
            msg = await ws.receive()
            if msg.type == WSMsgType.BINARY:
                assert msg.data[0] == 1
                got.append(np.frombuffer(msg.data[1:], "<i2").astype(np.float32) / 32767)
            elif msg.type == WSMsgType.TEXT:
                events.append(json.loads(msg.data))
            else:
                return

    reader = asyncio.get_running_loop().create_task(read())
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    for i in range(int(seconds / 0.02)):
        await ws.send_bytes(pcm(value))
        await asyncio.sleep(max(0.0, t0 + (i + 1) * 0.02 - loop.time()))
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)


async def test_two_conversations_hear_their_own_voice_while_they_send() -> None:
    async with serve(["moshi"]) as h:
        a = await h.client.ws_connect("/v1/duplex?model=moshi")
        b = await h.client.ws_connect("/v1/duplex?model=moshi")
        ca, cb = await created(a), await created(b)
        caps = ca["session"]["capabilities"]
        assert caps["full_duplex"] and caps["frame_ms"] == 80
        assert ca["session"]["audio"]["output"]["transport"] == "binary" and cb["resume_token"]
        got_a: list[np.ndarray] = []
        got_b: list[np.ndarray] = []
        ev_a: list[dict[str, Any]] = []
        ev_b: list[dict[str, Any]] = []
        await asyncio.gather(talk(a, 0.2, 1.2, got_a, ev_a), talk(b, -0.4, 1.2, got_b, ev_b))
        # audio came back while each was still sending: one 80 ms frame per tick
        assert len(got_a) >= 8 and len(got_b) >= 8
        assert all(len(f) == FRAME for f in got_a + got_b)
        # each hears the model answering its own input (the fake echoes it), never the other's
        heard_a = np.concatenate(got_a)
        heard_b = np.concatenate(got_b)
        assert np.isclose(heard_a, 0.1, atol=2e-3).sum() > 4 * FRAME and not np.isclose(heard_a, -0.2, atol=2e-3).any()
        assert np.isclose(heard_b, -0.2, atol=2e-3).sum() > 4 * FRAME and not np.isclose(heard_b, 0.1, atol=2e-3).any()
        texts = [e for e in ev_a if e["type"] == "duplex.text.delta"]
        assert texts and all(e["delta"].startswith("w") for e in texts)
        seqs = [e["server_event_seq"] for e in ev_a]
        assert seqs == sorted(seqs)
        # both ran in the same steps: the clock stepped them together
        proc = h.processor("moshi")
        assert 2 in proc.clock.times.by_size
        await a.close()
        await b.close()


async def test_a_conversation_that_would_not_fit_the_frame_is_refused_with_capacity() -> None:
    async with serve(["moshi"]) as h:
        proc = h.processor("moshi")
        a = await h.client.ws_connect("/v1/duplex?model=moshi")
        await created(a)
        # measured: one conversation's step takes 70 ms; two would take 140 ms > 60 ms
        await asyncio.sleep(0.2)
        proc.clock.times.by_size = {1: 0.07}
        b = await h.client.ws_connect("/v1/duplex?model=moshi")
        msg = await b.receive(timeout=5)
        ev = json.loads(msg.data)
        assert ev["type"] == "error" and ev["error"]["code"] == "capacity", ev
        assert "80 ms frame" in ev["error"]["message"] and "retry in" in ev["error"]["message"]
        closing = await b.receive(timeout=5)
        assert closing.type == WSMsgType.CLOSE and b.close_code == 1013
        # the admitted one keeps being served
        got: list[np.ndarray] = []
        await talk(a, 0.2, 0.5, got, [])
        assert got
        refused = [d for d in h.sessions.decisions if d.get("reason") == "capacity"]
        assert refused and "frame" in refused[-1]["message"] and "load" not in refused[-1]
        # a plain HTTP GET is told the endpoint is a WebSocket
        r = await h.client.get("/v1/duplex?model=moshi")
        assert r.status == 400 and (await r.json())["error"]["code"] == "websocket_required"
        await a.close()


async def test_bad_input_gets_errors_and_the_conversation_goes_on() -> None:
    async with serve(["moshi"]) as h:
        a = await h.client.ws_connect("/v1/duplex?model=moshi")
        other = await h.client.ws_connect("/v1/duplex?model=moshi")
        await created(a)
        await created(other)

        async def error_after(data: Any) -> dict[str, Any]:
            if isinstance(data, bytes):
                await a.send_bytes(data)
            else:
                await a.send_str(data)
            while True:
                msg = await a.receive(timeout=5)
                if msg.type == WSMsgType.TEXT:
                    ev = json.loads(msg.data)
                    if ev["type"] == "error":
                        return ev["error"]

        assert (await error_after(b"\x02abcd"))["code"] == "invalid_frame"
        assert (await error_after(b"\x01abc"))["code"] == "invalid_frame"  # odd PCM16 bytes
        bad_rate = {"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 12345}}}}}
        assert (await error_after(json.dumps(bad_rate)))["param"] == "session.audio.input.format.rate"
        assert (await error_after(json.dumps({"type": "response.create"})))["code"] == "invalid_event"
        assert (await error_after("{not json"))["type"] == "invalid_request_error"
        too_fast = await error_after(pcm(0.1, 24000 * 3))  # 3 s at once
        assert too_fast["code"] == "input_too_fast" and "not played in" in too_fast["message"]
        # the same session still takes audio at the declared rate, and so does the other
        await a.send_str(json.dumps({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}}))
        got: list[np.ndarray] = []
        await asyncio.gather(talk(other, 0.3, 0.6, got, []), asyncio.sleep(0))
        assert got and np.isclose(np.concatenate(got), 0.15, atol=2e-3).any()
        await a.close()
        await other.close()


async def test_a_dropped_connection_resumes_and_the_model_kept_listening() -> None:
    async with serve(["moshi"]) as h:
        a = await h.client.ws_connect("/v1/duplex?model=moshi")
        ev = await created(a)
        sid, token = ev["session"]["id"], ev["resume_token"]
        await talk(a, 0.2, 0.4, [], [])
        await a.close(code=1001)  # the network went away, not a session.close
        await asyncio.sleep(0.3)
        proc = h.processor("moshi")
        assert len(proc.clock.live) == 1  # still stepping (on silence)
        b = await h.client.ws_connect(f"/v1/duplex?model=moshi&session_id={sid}&resume_token={token}")
        first = json.loads((await b.receive(timeout=5)).data)
        assert first["type"] == "session.resumed" and first["replayed_events"] > 0
        got: list[np.ndarray] = []
        await talk(b, -0.2, 0.6, got, [])
        assert np.isclose(np.concatenate(got), -0.1, atol=2e-3).any()
        await b.send_str(json.dumps({"type": "session.close"}))
        closing = await b.receive(timeout=5)
        while closing.type != WSMsgType.CLOSE:
            closing = await b.receive(timeout=5)
        assert b.close_code == 1000
        await asyncio.sleep(0.2)
        assert not proc.clock.live  # the conversation left the clock and its slot is free
        assert sorted(proc._free) == list(range(proc.max_sessions))


@pytest.mark.parametrize("query", ["", "?model=omni-rt-voice"])
async def test_the_voice_duplex_still_answers_where_no_moshi_model_is_named(query: str) -> None:
    async with serve(["voice", "moshi"]) as h:
        ws = await h.client.ws_connect(f"/v1/duplex{query}")
        ev = json.loads((await ws.receive(timeout=5)).data)
        assert ev["type"] == "session.created" and "full_duplex" not in ev["session"]["capabilities"]
        await ws.close()
        ws = await h.client.ws_connect("/v1/duplex?model=moshi")
        ev = json.loads((await ws.receive(timeout=5)).data)
        assert ev["session"]["capabilities"]["full_duplex"] is True
        await ws.close()


async def test_webrtc_calls_with_the_model_are_refused_cleanly() -> None:
    async with serve(["moshi"]) as h:
        proc = h.processor("moshi")
        # not an SDP offer: the HTTP error shape, nothing opened
        r = await h.client.post("/v1/realtime/calls?model=moshi", data="hello", headers={"Content-Type": "application/sdp"})
        assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
        r = await h.client.post("/offer?model=moshi", json={"type": "answer", "sdp": "v=0"})
        assert r.status == 400
        assert not [s for s in h.sessions.sessions() if s.is_open]
        # a duplex conversation holds the frame; a call that would not fit is 429 capacity with retry-after
        a = await h.client.ws_connect("/v1/duplex?model=moshi")
        await created(a)
        await asyncio.sleep(0.2)
        proc.clock.times.by_size = {1: 0.07}
        from aiortc import RTCPeerConnection

        pc = RTCPeerConnection()
        pc.addTransceiver("audio")
        pc.createDataChannel("oai-events")
        await pc.setLocalDescription(await pc.createOffer())
        r = await h.client.post("/v1/realtime/calls?model=moshi", data=pc.localDescription.sdp, headers={"Content-Type": "application/sdp"})
        await pc.close()
        body = await r.json()
        assert r.status == 429 and body["error"]["code"] == "capacity" and "Retry-After" in r.headers, body
        assert [s.kind for s in h.sessions.sessions() if s.is_open] == ["duplex"]
        await a.close()


async def test_a_user_who_stops_sending_is_heard_as_silence_until_the_idle_ttl() -> None:
    async with serve(["moshi"]) as h:
        a = await h.client.ws_connect("/v1/duplex?model=moshi")
        other = await h.client.ws_connect("/v1/duplex?model=moshi")
        sid = (await created(a))["session"]["id"]
        await created(other)
        # oversized frames and other formats: the protocol's errors
        await a.send_bytes(b"\x01" + bytes((1 << 20) + 2))
        await a.send_str(json.dumps({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/opus", "rate": 48000}}}}}))
        errors: list[dict[str, Any]] = []
        while len(errors) < 2:
            msg = await a.receive(timeout=5)
            if msg.type == WSMsgType.TEXT and json.loads(msg.data)["type"] == "error":
                errors.append(json.loads(msg.data)["error"])
        assert errors[0]["code"] == "invalid_frame" and "at most 1048576 bytes" in errors[0]["message"], errors
        assert errors[1]["param"] == "session.audio.input.format", errors
        # a sends nothing: the model keeps stepping it on silence (its voice: the fake's echo of silence)
        frames: list[np.ndarray] = []
        while len(frames) < 5:
            msg = await a.receive(timeout=5)
            if msg.type == WSMsgType.BINARY:
                frames.append(np.frombuffer(msg.data[1:], "<i2"))
        assert all(int(np.abs(f).max()) == 0 for f in frames[1:])
        # past the idle TTL without a frame from the user, the lease ends it; the other goes on
        assert await h.expire(h.sessions.spec.idle_ttl_s - 1) == []
        await talk(other, 0.2, 0.2, [], [])  # other keeps talking; a still sends nothing
        assert await h.expire(2) == [sid]
        closed = None
        while closed is None:
            msg = await a.receive(timeout=5)
            if msg.type == WSMsgType.TEXT and json.loads(msg.data)["type"] in ("session.expired", "session.closed"):
                closed = json.loads(msg.data)
        assert closed["type"] == "session.expired" or closed.get("reason") == "idle_timeout", closed
        got: list[np.ndarray] = []
        await talk(other, 0.3, 0.4, got, [])
        assert got
        await other.close()


async def test_a_model_whose_one_step_overruns_the_frame_refuses_the_first_conversation() -> None:
    """A step of one conversation alone longer than the 80 ms frame (the hub's bfloat16
    Moshi computed as such on a CPU: 1.6 s) cannot be served in real time: the first
    caller is refused with capacity, naming the step, not admitted to hear nothing."""
    async with serve(["moshi"]) as h:
        proc = h.processor("moshi")
        proc.clock.times.by_size = {1: 1.6}
        proc.clock.times.dev = {1: 0.0}
        a = await h.client.ws_connect("/v1/duplex?model=moshi")
        ev = json.loads((await a.receive(timeout=5)).data)
        assert ev["type"] == "error" and ev["error"]["code"] == "capacity", ev
        assert "1600.0 ms, longer than the 80 ms frame" in ev["error"]["message"], ev
        closing = await a.receive(timeout=5)
        assert closing.type == WSMsgType.CLOSE and a.close_code == 1013
        # a step inside the frame (but over the headroom's 60 ms) still admits one
        proc.clock.times.by_size = {1: 0.07}
        b = await h.client.ws_connect("/v1/duplex?model=moshi")
        await created(b)
        await b.close()


async def test_room_is_reserved_on_the_replica_that_runs_the_conversation_and_given_back() -> None:
    """Two replicas of the model: each conversation's frame budget is reserved on the
    replica the pool picked, and its request runs there (it is pinned); when the
    conversations end, no replica holds a reservation or a live conversation."""
    overlay = {"pipelines": {"moshi": {"stages": {"moshi": {"replicas": 2}}}}}
    async with serve(["moshi"], overlay) as h:
        procs = [h.processor("moshi", i) for i in range(2)]
        socks = [await h.client.ws_connect("/v1/duplex?model=moshi") for _ in range(4)]
        for ws in socks:
            await created(ws)
        await asyncio.sleep(0.3)
        assert [len(p.clock.live) for p in procs] == [2, 2]  # the pool spread them; each runs where it reserved
        assert all(not p._reserved for p in procs)  # every request took its reservation over
        for s in h.sessions.sessions():  # (a dropped socket alone leaves them resumable)
            await h.sessions.end(s, "closed")
        for ws in socks:
            await ws.close()
        for _ in range(50):
            await asyncio.sleep(0.05)
            if not any(p.clock.live for p in procs):
                break
        assert [len(p.clock.live) for p in procs] == [0, 0] and all(not p._reserved for p in procs)


async def test_a_fault_in_the_models_check_is_a_server_error_not_a_capacity_refusal() -> None:
    async with serve(["moshi"]) as h:
        proc = h.processor("moshi")

        def broken(key: str) -> None:
            raise ZeroDivisionError("a bug")

        proc.admit = broken
        with pytest.raises(WSServerHandshakeError) as err:  # refused before the upgrade: a 500, not capacity's 429
            await h.client.ws_connect("/v1/duplex?model=moshi")
        assert err.value.status == 500
        assert not [d for d in h.sessions.decisions if d.get("reason") == "capacity"]
        del proc.admit  # the class's own again: the server goes on
        ok = await h.client.ws_connect("/v1/duplex?model=moshi")
        await created(ok)
        await ok.close()


def test_the_tail_of_the_users_audio_is_taken_once_the_input_ends() -> None:
    """A last stretch shorter than a frame plus the lead would wait for more forever;
    once the input has ended it goes out, padded with silence."""
    from pipelines.moshi import Conversation

    conv = Conversation(0, 0, lead=960, max_samples=24000 * 2)
    conv.feed(np.full(1000, 0.5, np.float32))
    assert not conv.take().any() and conv.buffered == 1000  # waiting for a frame and its lead
    conv.closing = True
    frame = conv.take()
    assert conv.buffered == 0 and np.isclose(frame[:1000], 0.5).all() and not frame[1000:].any()


def test_the_wires_are_named_for_the_contract_and_the_old_names_still_mount() -> None:
    """A deploy file written before the full-duplex model's wires were renamed still
    mounts them; an unknown wire is refused with the known ones listed."""
    from omni_rt.specs import SpecError
    from protocols.registry import WIRES, resolve

    assert resolve("moshi_duplex") == WIRES["duplex_model"] == "protocols.duplex.model:mount"
    assert resolve("moshi_webrtc") == WIRES["webrtc_duplex_model"] == "protocols.webrtc.model:mount"
    with pytest.raises(SpecError, match="unknown wire 'moshi_pager'; known: .*duplex_model"):
        resolve("moshi_pager", "pipelines.moshi")
