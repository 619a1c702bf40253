"""World rollouts, video jobs and live video, OpenPI robots and WebRTC signalling
in-process over fakes (the real adapters, sessions and orchestrator)."""

from __future__ import annotations

import asyncio
import io
import json
import re
from typing import Any

import numpy as np
import openai
import pytest

from clients.openpi import OpenPIError, PolicyClient, droid_observation
from clients.world import WorldClient
from protocols.realtime import Conversation
from testkit import Speeds, serve
from testkit.wire import connect, drop

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")

A = [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]


@pytest.fixture
async def h():
    # a denoising step of the fake engine takes 1 ms: a 50-step frame is still running
    # when the test cancels or edits
    async with serve(["world", "video", "video_edit", "robot", "voice"], {"sessions": {"principal_caps": {"anonymous": 2}}},
                     speeds=Speeds(diffusion_step_s=0.001)) as harness:
        yield harness


async def gone(h, sid: str) -> bool:
    for _ in range(200):
        if all(s.id != sid for s in h.sessions.sessions()):
            return True
        await asyncio.sleep(0.005)
    return False


def buffer_bytes() -> float:
    from prometheus_client import generate_latest

    return float(re.search(rb"^omni_rt_world_buffer_bytes (\S+)", generate_latest(), re.M).group(1))


# ---- /v1/world ----------------------------------------------------------------------------


async def world(h, seed: int) -> WorldClient:
    w = await WorldClient.connect(h.url("/v1/world", ws=True))
    await w.update(prompt="a forest path", width=32, height=32, steps=2, seed=seed)
    return w


async def test_world_sessions_keep_their_own_rollout_and_resume_from_their_buffer(h):
    a, b = await world(h, 1), await world(h, 2)
    fa = [await a.step(x) for x in A[:2]]
    fb = [await b.step(x) for x in A[:1]]
    assert fa[0].shape == (32, 32, 3) and not np.array_equal(fa[0], fb[0])  # frame 0 of seed 1 vs seed 2
    sid, token = a.session_id, a.resume_token
    drop(a.ws)  # dropped (no close frame): detached, its buffer kept
    a2 = await WorldClient.connect(h.url("/v1/world", ws=True), session_id=sid, resume_token=token)
    assert a2.first["type"] == "session.resumed" and a2.session["frame_index"] == 2
    history = h.sessions.sessions()[0].data.get("world") or next(s.data["world"] for s in h.sessions.sessions() if s.id == sid)
    assert len(history["history"]) == 2
    await a2.step(A[2])
    assert a2.session["id"] == sid
    # a resume elsewhere takes the session over; the old socket leaving changes nothing
    a3 = await WorldClient.connect(h.url("/v1/world", ws=True), session_id=sid, resume_token=a2.resume_token)
    await a2.close()
    await asyncio.sleep(0.01)
    await a3.step(A[0])
    assert next(s for s in h.sessions.sessions() if s.id == sid).data["world"]["frame_index"] == 4
    await a3.close()
    await b.close()


async def test_world_cancel_and_supersede_are_fenced(h):
    w = await world(h, 3)
    await w.update(steps=50)
    await w.send("world.step", action=A[0])
    started = await w.until("world.step.started")
    await w.until("world.step.progress")
    await w.send("session.update", session={"width": 64})  # not while a step runs
    assert (await w.until("error"))["error"]["code"] == "step_active"
    await w.send("world.cancel")
    cancelled = await w.until("world.step.cancelled")
    assert cancelled["step_id"] == started["step_id"] and cancelled["reason"] == "cancelled"
    await w.send("world.step", action=A[1])
    s1 = await w.until("world.step.started")
    await w.until("world.step.progress")
    await w.update(steps=2)  # applies to the next step
    await w.send("world.step", action=A[2])
    after: list = []
    sup = await w.until("world.step.cancelled", after)
    assert sup["step_id"] == s1["step_id"] and sup["reason"] == "superseded"
    done = await w.until("world.step.done", after)
    later = after[after.index(sup) + 1 :]
    assert {e.get("step_id") for e in later if e["type"].startswith("world.")} <= {done["step_id"]}
    assert done["frame_index"] == 0  # the cancelled steps left no frame behind
    await w.close()


async def test_closing_or_an_operator_frees_the_latent_buffer(h):
    before = buffer_bytes()
    w = await world(h, 5)
    await w.step(A[0])
    await w.step(A[1])
    assert buffer_bytes() > before
    await w.send("session.close")
    assert (await w.until("session.closed"))["type"] == "session.closed"
    await w.close()
    assert await gone(h, w.session_id) and buffer_bytes() == before
    w = await world(h, 6)
    await w.step(A[0])
    r = await h.client.delete(f"/v1/sessions/{w.session_id}")
    assert r.status == 200 and await gone(h, w.session_id) and buffer_bytes() == before
    await w.close()


@pytest.mark.parametrize("event, code", [
    ({"type": "world.step"}, "invalid_value"),
    ({"type": "world.step", "action": [1, 2]}, "invalid_value"),
    ({"type": "world.step", "action": ["a", 1, 2, 3]}, "invalid_value"),
    ({"type": "world.step", "action": [10**400, 0, 0, 0]}, "invalid_value"),
    ({"type": "session.update", "session": {"width": 100}}, "invalid_value"),
    ({"type": "session.update", "session": {"steps": 0}}, "invalid_value"),
    ({"type": "session.update", "session": {"colour": "red"}}, "unknown_parameter"),
    ({"type": "world.cancel"}, "no_active_step"),
    ({"type": "world.teleport"}, "invalid_event"),
])
async def test_bad_world_events_get_error_events_and_the_session_goes_on(h, event, code):
    w = await world(h, 2)
    await w.send(**event)
    assert (await w.until("error"))["error"]["code"] == code
    await w.ws.send("{not json")
    assert (await w.until("error"))["error"]["code"] == "invalid_json"
    assert (await w.step(A[0])).shape == (32, 32, 3)
    await w.close()


# ---- /v1/videos and /v1/realtime/video ------------------------------------------------------


async def test_a_video_job_through_the_sdk(h):
    import av

    c: Any = openai.AsyncOpenAI(base_url=h.url("/v1"), api_key="x", max_retries=0)  # sizes the SDK's types do not list
    v = await c.videos.create(prompt="a paper boat", seconds="2", size="64x48", extra_body={"fps": 3, "seed": 3, "steps": 2})
    assert v.object == "video" and v.size == "64x48"
    progress = [v.progress]
    while v.status in ("queued", "in_progress"):
        await asyncio.sleep(0.005)
        v = await c.videos.retrieve(v.id)
        progress.append(v.progress)
    assert v.status == "completed" and v.progress == 100 and progress == sorted(progress)
    data = (await c.videos.download_content(v.id)).read()
    with av.open(io.BytesIO(data)) as movie:
        frames = [f.to_ndarray(format="rgb24") for f in movie.decode(video=0)]
    assert len(frames) == 6 and frames[0].shape == (48, 64, 3)
    assert v.id in [x.id for x in (await c.videos.list()).data]
    # a player seeks: a byte range of the clip, as a file is served
    r = await h.client.get(f"/v1/videos/{v.id}/content", headers={"Range": "bytes=100-199"})
    assert r.status == 206 and r.headers["Content-Range"] == f"bytes 100-199/{len(data)}" and await r.read() == data[100:200]
    assert r.headers["Content-Type"] == "video/mp4"
    r = await h.client.get(f"/v1/videos/{v.id}/content", headers={"Range": f"bytes={len(data)}-"})
    assert r.status == 416
    await c.videos.delete(v.id)
    r = await h.client.get(f"/v1/videos/{v.id}/content")
    assert r.status == 404 and (await r.json())["error"]["code"] == "video_not_found"
    await c.close()


async def test_deleting_a_running_job_stops_it_and_frees_its_slot(h):
    c: Any = openai.AsyncOpenAI(base_url=h.url("/v1"), api_key="x", max_retries=0)  # sizes the SDK's types do not list
    jobs = [await c.videos.create(prompt="long", seconds="12", size="512x512", extra_body={"steps": 50}) for _ in range(2)]
    with pytest.raises(openai.RateLimitError):  # the principal holds two sessions
        await c.videos.create(prompt="third", seconds="1", size="64x64")
    r = await h.client.get(f"/v1/videos/{jobs[0].id}/content")
    assert r.status == 409 and (await r.json())["error"]["code"] == "video_not_ready"
    for j in jobs:
        assert (await c.videos.delete(j.id)).deleted
    assert h.runtime.pools["t2v"].load() == 0
    with pytest.raises(openai.NotFoundError):
        await c.videos.retrieve(jobs[0].id)
    ok = await c.videos.create(prompt="the slot came back", seconds="1", size="64x64", extra_body={"fps": 2, "steps": 1})
    await c.videos.delete(ok.id)
    for body, param in (({"prompt": "x", "size": "100x100"}, "size"), ({"prompt": "x", "seconds": "40"}, "seconds"),
                        ({"prompt": "x", "fps": 0}, "fps"), ({"prompt": "x", "model": "nope"}, "model"),
                        ({"prompt": "x", "colour": "red"}, "colour"), ({"seconds": "1"}, "prompt"),
                        ({"prompt": "x", "seconds": "12", "fps": 30}, "seconds")):  # 360 frames: over the model's 97
        r = await h.client.post("/v1/videos", json=body)
        assert r.status == 400 and (await r.json())["error"]["param"] == param
        if body.get("fps") == 30:
            assert "at most 97 frames" in (await r.json())["error"]["message"]
    await c.close()


def _form(fields: list[tuple[str, bytes]], boundary: str = "B") -> bytes:
    body = b"".join(f"--{boundary}\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n".encode() + v + b"\r\n" for k, v in fields)
    return body + f"--{boundary}--\r\n".encode()


MULTIPART = "multipart/form-data; boundary=B"
URLENCODED = "application/x-www-form-urlencoded"


@pytest.mark.parametrize(
    "body, ctype, param, code",
    [
        (_form([("prompt", b"a"), ("prompt", b"b")]), MULTIPART, "prompt", "invalid_value"),  # which one?
        (b"prompt=a&seconds=1&seconds=2", URLENCODED, "seconds", "invalid_value"),
        (_form([("seconds", b"1")]), MULTIPART, "prompt", "missing_required_parameter"),
        (_form([("prompt", b"a"), ("seconds", b"1e309")]), MULTIPART, "seconds", "invalid_value"),
        (_form([("prompt", b"a"), ("fps", str(10**30).encode())]), MULTIPART, "fps", "invalid_value"),
        (b"prompt=a&seed=true", URLENCODED, "seed", "invalid_value"),
        (_form([("prompt", b"a"), ("top", b"1e309")]), MULTIPART, "top", "unknown_parameter"),
        (_form([("prompt", b"\xff\xfe a")]), MULTIPART, None, "invalid_form"),  # not UTF-8
        (b"prompt=\xff\xfe", URLENCODED, None, "invalid_form"),
        (_form([("prompt", b"a")]), "multipart/form-data", None, "invalid_form"),  # no boundary
        (_form([("prompt", b"a")]), "multipart/form-data; boundary=nope", None, "invalid_form"),
        (b"prompt=a", URLENCODED + "; charset=bogus", None, "invalid_form"),
        (b"prompt=%20%20", URLENCODED, "prompt", "invalid_value"),  # blank
        (b'{"prompt": "a", "steps": 51}', "application/json", "steps", "invalid_value"),  # over the model's 50
        (b'{"prompt": "a", "fps": 2.5}', "application/json", "fps", "invalid_value"),
        (b'{"prompt": ["a"]}', "application/json", "prompt", "invalid_value"),
    ],
)
async def test_bad_video_job_bodies_are_400s_that_name_the_field(h, body, ctype, param, code):
    r = await h.client.post("/v1/videos", data=body, headers={"content-type": ctype})
    err = (await r.json())["error"]
    assert r.status == 400 and (err["param"], err["code"]) == (param, code), err
    assert h.sessions.sessions() == []


async def test_a_video_job_from_form_fields_as_curl_sends_them(h):
    r = await h.client.post("/v1/videos", data=b"prompt=a%20kite&seconds=1&size=64x64&fps=2&steps=1&seed=4", headers={"content-type": URLENCODED})
    job = await r.json()
    assert r.status == 200 and (job["prompt"], job["size"], job["seconds"]) == ("a kite", "64x64", "1")
    await h.client.delete(f"/v1/videos/{job['id']}")


async def test_a_live_prompt_edit_takes_effect_at_the_next_frame_with_none_stale_or_lost(h):
    ws = await connect(h, "/v1/realtime/video")
    await ws.until("session.created")
    await ws.send("session.update", session={"prompt": "a cat", "width": 32, "height": 32, "steps": 10, "chunk_frames": 4, "seed": 1})
    await ws.send("generation.start", frames=16)
    while (await ws.until("video.frame"))["frame_index"] != 5:
        pass
    await ws.send("prompt_update", prompt="a dog")
    mark = len(ws.seen)
    ack = await ws.until("prompt_update.applied")
    done = await ws.until("generation.done")
    after = ws.seen[mark:]
    later = [e for e in after[after.index(ack) + 1 :] if e["type"] == "video.frame"]
    assert ack["prompt_version"] == 1 and later and all(e["prompt_version"] == 1 for e in later)
    assert [e["frame_index"] for e in ws.seen if e["type"] == "video.frame"] == list(range(16)) and done["frames"] == 16
    assert later[0]["frame_index"] == ack["from_frame"]
    await ws.send("generation.start", frames=240)
    await ws.until("video.frame")
    await ws.send("generation.cancel")
    cancelled = await ws.until("generation.cancelled")
    await ws.send("session.update", session={"steps": 1})
    await ws.until("session.updated")
    tail = ws.seen[ws.seen.index(cancelled) + 1 :]
    assert not [e for e in tail if e["type"].startswith(("video.", "generation."))]
    for event, code in (({"type": "generation.start", "frames": 0}, "invalid_value"), ({"type": "session.update", "session": {"fps": 3}},
                        "unknown_parameter"), ({"type": "generation.cancel"}, "no_active_generation"), ({"type": "x"}, "invalid_event")):
        await ws.ws.send_str(json.dumps(event))
        assert (await ws.until("error"))["error"]["code"] == code
    await ws.ws.close()


# ---- OpenPI -----------------------------------------------------------------------------------


async def test_robots_get_metadata_then_actions_and_episodes_are_their_own(h):
    url = h.url("/", ws=True)
    async with await PolicyClient.connect(url, seed=1) as a, await PolicyClient.connect(h.url("/v1/openpi", ws=True), seed=2) as b:
        assert a.metadata["action_horizon"] == 10 and a.metadata["session_id"] != b.metadata["session_id"]
        ra = [(await a.infer(droid_observation(i)))["actions"] for i in range(3)]
        rb = [(await b.infer(droid_observation(i)))["actions"] for i in range(3)]
        assert ra[0].shape == (10, 8) and not np.array_equal(ra[0], rb[0])
        reply = await a.infer(droid_observation(0))
        assert set(reply) == {"actions", "policy_timing", "server_timing"} and "prev_total_ms" in reply["server_timing"]
        assert (await a.reset(seed=1))["reset"] is True
        assert np.array_equal((await a.infer(droid_observation(0)))["actions"], ra[0])  # the episode starts over
        with pytest.raises(OpenPIError) as refused:  # over the principal's cap of two
            await PolicyClient.connect(url)
        assert "session_limit" in str(refused.value) and refused.value.code == 1013
        r = await h.client.delete(f"/v1/sessions/{b.metadata['session_id']}")
        assert r.status == 200
        with pytest.raises(OpenPIError) as ended:
            await b.infer(droid_observation(1))
        assert "operator" in str(ended.value) and ended.value.code == 1001
    page = await h.client.get("/")  # a plain GET of the root still serves the index
    assert page.status == 200 and "OpenPI" in await page.text()


async def test_bad_robot_input_is_a_text_error_and_1011_for_that_robot_only(h):
    async with await PolicyClient.connect(h.url("/", ws=True)) as good:
        for frame in (b"\xc1", b"\x93\x01\x02\x03", json.dumps({"x": 1}).encode()):
            bad = await connect(h, "/")
            assert (await bad.ws.receive()).type.name == "BINARY"  # the metadata frame first
            await bad.ws.send_bytes(frame)
            msg = await bad.ws.receive()
            assert msg.type.name == "TEXT" and msg.data
            closing = await bad.ws.receive()
            assert closing.type.name in ("CLOSE", "CLOSED") and bad.ws.close_code == 1011
        missing = await connect(h, "/")
        await missing.ws.receive()
        from clients.openpi import packb

        await missing.ws.send_bytes(packb({"prompt": "no images"}))
        msg = await missing.ws.receive()
        assert msg.type.name == "TEXT" and "missing" in msg.data
        assert (await good.infer(droid_observation(0)))["actions"].shape == (10, 8)
    for query in ("?layout=nope", "?seed=-1"):
        refused = await connect(h, "/" + query)
        msg = await refused.ws.receive()
        assert msg.type.name == "TEXT"


async def test_a_dead_policy_engine_is_try_again_later_for_the_robot(h):
    async with await PolicyClient.connect(h.url("/", ws=True)) as robot:
        h.engine("policy").mark_dead("test: the engine process died")
        with pytest.raises(OpenPIError) as refused:
            await robot.infer(droid_observation(0))
        assert refused.value.code == 1013 and "engine" in str(refused.value)
    h.engine("policy").dead = None  # the replica is back
    async with await PolicyClient.connect(h.url("/", ws=True)) as robot:
        assert (await robot.infer(droid_observation(0)))["actions"].shape == (10, 8)


@pytest.mark.parametrize("path", ["/v1/realtime", "/v1/world", "/v1/realtime/video"])
async def test_a_session_ended_as_a_slow_consumer_closes_1008_on_every_json_socket(h, path):
    sock = await connect(h, path)
    first = await sock.ws.receive_json()
    assert first["type"] == "session.created"
    (session,) = h.sessions.sessions()
    await h.sessions.end(session, "slow_consumer")
    while not sock.ws.closed:
        if (await sock.ws.receive()).type.name in ("CLOSE", "CLOSED", "CLOSING"):
            break
    assert sock.ws.close_code == 1008


# ---- WebRTC signalling -------------------------------------------------------------------------


async def test_bad_offers_get_clear_errors_and_leave_nothing_behind(h):
    from aiortc import RTCConfiguration, RTCPeerConnection

    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.createDataChannel("oai-events")  # no audio
    await pc.setLocalDescription(await pc.createOffer())
    no_audio = pc.localDescription.sdp
    await pc.close()
    for body in ("hello", "", no_audio, "v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\nnonsense\r\n", "v=0\r\n" + "a=x\r\n" * 20000 + "m=audio 9 RTP 0\r\n"):
        r = await h.client.post("/v1/realtime/calls", data=body, headers={"content-type": "application/sdp"})
        assert r.status == (413 if len(body) > 65536 else 400) and (await r.json())["error"]["code"] == "invalid_sdp", body[:30]
    r = await h.client.post("/v1/realtime/calls", json={"sdp": "v=0"})
    assert r.status == 415
    for ctype in ("multipart/form-data", "multipart/form-data; boundary=", "multipart/form-data; boundary=nope"):
        r = await h.client.post("/v1/realtime/calls", data=_form([("sdp", b"v=0")]), headers={"content-type": ctype})
        assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_form", ctype
    r = await h.client.post("/v1/realtime/calls", data=_form([("sdp", b"v=0"), ("sdp", b"v=0")]), headers={"content-type": MULTIPART})
    assert r.status == 400 and (await r.json())["error"]["param"] == "sdp"
    r = await h.client.post("/offer", data=b"{nope", headers={"content-type": "application/json"})
    assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
    r = await h.client.post("/offer", json={"sdp": "v=0", "type": "answer"})
    assert r.status == 400
    r = await h.client.delete("/v1/realtime/calls/sess_nope")
    assert r.status == 404 and (await r.json())["error"]["code"] == "call_not_found"
    assert h.sessions.sessions() == []


async def test_a_json_offer_gets_an_answer_and_hangs_up(h):
    from aiortc import RTCConfiguration, RTCPeerConnection

    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio")
    pc.createDataChannel("oai-events")
    await pc.setLocalDescription(await pc.createOffer())
    r = await h.client.post("/offer", json={"sdp": pc.localDescription.sdp, "type": "offer",
                                            "session": {"type": "realtime", "max_output_tokens": 8}})
    body = await r.json()
    assert r.status == 200 and body["type"] == "answer" and "m=audio" in body["sdp"]
    conv = next(s for s in h.sessions.sessions() if s.id == body["call_id"]).kept(Conversation)
    assert conv.cfg.max_output_tokens == 8  # the offer's session config applies
    assert (await h.client.post(f"/v1/realtime/calls/{body['call_id']}/hangup")).status == 204
    assert (await h.client.delete(f"/v1/realtime/calls/{body['call_id']}")).status == 404
    assert await gone(h, body["call_id"])
    await pc.close()


async def test_the_call_track_plays_in_order_drops_stale_audio_and_reports_what_was_heard():
    """WebRTC's audio output without RTP: frames are taken as the track would send them."""
    from omni_rt.payloads import Fence
    from omni_rt.specs import SessionsSpec
    from protocols.realtime import Item, Response
    from protocols.webrtc.track import FRAME, TrackOutput
    from sessions import SessionManager

    m = SessionManager(SessionsSpec())
    s = await m.open("webrtc")
    out = TrackOutput(s, m)
    resp = Response("resp_1", Item("item_1", "assistant", []), True)
    pcm = (np.arange(4800) % 100).astype("<i2").tobytes()  # 200 ms at 24 kHz
    out.push(resp, s.fence, pcm)
    out.end(resp, s.fence)  # the resampler's tail: the whole answer is queued
    played = [out.track._take() for _ in range(3)]  # 60 ms
    assert all(len(f) == FRAME for f in played) and out.track.playing == "resp_1"
    cut = out.clear()
    assert cut == {"item_1": 60} and out.track.buffered == 0
    assert not out.track._take().any()  # the next frame is silence
    events = [e.type for e in list(s._events)]
    assert events == ["output_audio_buffer.started", "output_audio_buffer.cleared"]
    # audio of an older epoch is dropped at the track, never played
    out.push(Response("resp_2", Item("item_2", "assistant", []), True), Fence(s.id, epoch=-1), pcm)
    assert not out.track._take().any()
    assert out.clear() == {}  # nothing was playing
    await m.stop()


async def test_prompts_longer_than_the_text_encoder_reads_are_refused_in_each_wires_shape(h):
    long = " ".join(["word"] * 40)  # the fake engines' text encoder reads 32 tokens, a word a token
    r = await h.client.post("/v1/videos", json={"prompt": long, "seconds": "1"})
    err = (await r.json())["error"]
    assert r.status == 400 and err["param"] == "prompt" and "40 text tokens" in err["message"] and "at most 32" in err["message"]
    ws = await connect(h, "/v1/realtime/video")
    await ws.until("session.created")
    await ws.send("session.update", session={"prompt": long})
    assert (await ws.until("error"))["error"]["param"] == "session.prompt"
    await ws.send("prompt_update", prompt=long)
    assert (await ws.until("error"))["error"]["param"] == "prompt"
    await ws.send("session.update", session={"prompt": "a short one"})  # the session goes on
    assert (await ws.until("session.updated"))["session"]["prompt"] == "a short one"
    await ws.ws.close()
