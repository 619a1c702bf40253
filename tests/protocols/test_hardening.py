"""Input that must never get a 500 or drop a socket, body limits, stalled clients,
large robot frames and closing a world session (in-process over fakes)."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

from clients.openpi import PolicyClient, droid_observation, packb
from clients.world import WorldClient
from testkit import Speeds, serve
from testkit.wire import Events, connect

DEEP = "[" * 1000 + "]" * 1000
BIG_INT = '{"n": ' + "9" * 5000 + "}"
NAN = '{"n": NaN}'
NOT_UTF8 = b'{"input": "\xed\xa0\x80"}'  # a surrogate encoded as UTF-8: not UTF-8

HTTP_JSON = ["/v1/audio/speech", "/v1/chat/completions", "/v1/images/generations", "/v1/videos", "/offer", "/v1/realtime/client_secrets"]


@pytest.fixture
async def h():
    overlay = {"server": {"max_body_bytes": 64 << 10, "max_upload_bytes": 1 << 20, "header_timeout_s": 0.5}}
    async with serve(["voice", "tts", "image", "world", "video", "video_edit", "robot"], overlay, speeds=Speeds(diffusion_step_s=0.001)) as harness:
        yield harness


@pytest.mark.parametrize("path", HTTP_JSON)
@pytest.mark.parametrize("body", [DEEP, BIG_INT, NAN, NOT_UTF8], ids=["deep", "big_int", "nan", "not_utf8"])
async def test_json_no_parser_accepts_is_a_400_on_every_http_route(h, path, body):
    r = await h.client.post(path, data=body, headers={"content-type": "application/json"})
    got = await r.json()
    assert r.status == 400 and got["error"]["code"] == "invalid_json", (path, got)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/audio/speech", {"model": "tts-1", "voice": "alloy", "input": "hi \ud800"}, "input"),
    ("/v1/chat/completions", {"model": "gpt-4o-audio-preview", "messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ("/v1/images/generations", {"prompt": "a", "size": "\udfff"}, "size"),
    ("/v1/videos", {"prompt": "a", "model": "\ud800"}, "model"),
])
async def test_lone_surrogates_are_refused_naming_their_field(h, path, body, param):
    r = await h.client.post(path, data=json.dumps(body), headers={"content-type": "application/json"})  # json.dumps escapes them
    got = await r.json()
    assert r.status == 400 and got["error"]["code"] == "invalid_value" and got["error"]["param"] == param, got


async def test_a_bad_multipart_session_on_a_call_is_a_400_naming_the_field(h):
    import aiohttp

    for session, code, param in [(DEEP, "invalid_json", None), (json.dumps({"audio": {"output": {"voice": "nobody"}}}), "invalid_value",
                                                                 "session.audio.output.voice")]:
        form = aiohttp.FormData(default_to_multipart=True)
        form.add_field("sdp", "v=0\r\nm=audio 9 RTP 0\r\n")
        form.add_field("session", session)
        r = await h.client.post("/v1/realtime/calls", data=form)
        got = await r.json()
        assert r.status == 400 and (got["error"]["code"], got["error"]["param"]) == (code, param), got
    assert h.sessions.sessions() == []


async def test_an_offer_that_parses_but_cannot_be_answered_is_invalid_sdp(h):
    from aiortc import RTCConfiguration, RTCPeerConnection

    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio")
    pc.createDataChannel("oai-events")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = pc.localDescription.sdp
    await pc.close()
    # a media section with an empty mid: aiortc parses it but cannot answer it
    r = await h.client.post("/v1/realtime/calls", data=sdp.replace("a=mid:0", "a=mid:"), headers={"content-type": "application/sdp"})
    got = await r.json()
    assert r.status == 400 and got["error"]["code"] == "invalid_sdp", got
    assert h.sessions.sessions() == []


# ---- event sockets ---------------------------------------------------------------------------


async def probe(ws: Events, after: str) -> None:
    """The socket is still serving: an unknown event gets its error event."""
    await ws.send("no.such.event", event_id="probe")
    ev = await ws.until("error")
    assert ev["error"]["event_id"] in ("probe", None), (after, ev)


@pytest.mark.parametrize("path, first", [
    ("/v1/realtime", "session.created"), ("/v1/duplex", "session.created"), ("/v1/world", "session.created"),
    ("/v1/realtime/video", "session.created"),
])
async def test_unparseable_events_get_error_events_and_the_socket_stays(h, path, first):
    ws = await connect(h, path)
    await ws.until(first)
    bad = [DEEP, BIG_INT, NAN]
    if path in ("/v1/world", "/v1/realtime/video"):
        bad += ['{"type": "session.update", "session": {"prompt": "\\ud800"}}',
                '{"type": "session.update", "session": {"image_format": {"a": 1}}}', '{"type": "session.update", "session": {"image_format": ["png"]}}']
    else:
        bad += ['{"type": "session.update", "session": {"instructions": "\\ud800"}}',
                '{"type": "session.update", "session": {"audio": {"input": "x"}}}', '{"type": "session.update", "session": {"audio": {"output": 5}}}']
    for raw in bad:
        await ws.ws.send_str(raw)
        err = (await ws.until("error"))["error"]
        assert err["code"] != "internal_error" and err["type"] == "invalid_request_error", (raw[:40], err)
        await probe(ws, raw[:40])
    assert ws.closed is None
    (s,) = h.sessions.sessions()
    assert s.state.value == "active"  # not detached: nothing happened to the connection
    await ws.ws.close()


async def test_a_bad_first_duplex_message_is_an_error_not_a_detach(h):
    for raw in (DEEP, BIG_INT):
        ws = await connect(h, "/v1/duplex")
        sid = (await ws.until("session.created"))["session"]["id"]
        await ws.ws.send_str(raw)
        assert (await ws.until("error"))["error"]["code"] == "invalid_json"
        await probe(ws, raw[:20])
        assert next(s for s in h.sessions.sessions() if s.id == sid).state.value == "active"
        await ws.ws.close()


async def test_a_world_session_closed_normally_after_a_burst_frees_its_slot_at_once(h):
    w = await WorldClient.connect(h.url("/v1/world", ws=True))
    await w.update(prompt="a path", width=32, height=32, steps=20, seed=1)
    for i in range(20):  # a burst: each step supersedes the one before
        await w.send("world.step", action=[0.1 * i, 0, 0, 0])
    await w.close()  # a close frame with 1000
    for _ in range(400):
        if not h.sessions.sessions():
            break
        await asyncio.sleep(0.005)
    assert h.sessions.sessions() == []  # no disconnect grace: the slot is free


# ---- body limits and stalled clients ------------------------------------------------------------


async def test_bodies_over_the_limit_are_refused_before_they_are_read(h):
    host, port = h.client.server.host, h.client.server.port
    reader, writer = await asyncio.open_connection(host, port)
    # a declared 100 MB body: the answer comes without one byte of it sent
    writer.write(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000000\r\n\r\n")
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 413")
    writer.close()
    big = json.dumps({"model": "tts-1", "voice": "alloy", "input": "x" * (100 << 10)})
    r = await h.client.post("/v1/audio/speech", data=big, headers={"content-type": "application/json"})
    assert r.status == 413 and (await r.json())["error"]["code"] == "request_too_large"

    async def chunked():  # no Content-Length: refused as soon as the streamed size passes the limit
        for _ in range(40):
            yield b" " * 4096

    r = await h.client.post("/v1/images/generations", data=chunked(), headers={"content-type": "application/json"})
    assert r.status == 413
    # requests that carry media have the larger limit
    audio = json.dumps({"model": "gpt-4o-audio-preview", "messages": [{"role": "user", "content": "x" * (200 << 10)}]})
    r = await h.client.post("/v1/chat/completions", data=audio, headers={"content-type": "application/json"})
    assert r.status != 413


async def test_a_connection_that_never_finishes_its_headers_is_closed(h):
    reader, writer = await asyncio.open_connection(h.client.server.host, h.client.server.port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    await writer.drain()
    t0 = time.monotonic()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
    assert time.monotonic() - t0 < 3
    writer.close()


async def test_a_streamed_reply_nobody_reads_is_cut_off_and_frees_what_it_held():
    from aiohttp.test_utils import make_mocked_request

    from protocols.http import LIMITS, Limits, Streamed, send_streamed

    class Blocked:  # a client that stopped reading: every write waits forever
        buffer_size = 0
        output_size = 0

        async def write(self, data, *a, **kw):
            await asyncio.Event().wait()

        async def write_headers(self, *a, **kw):
            pass

        def send_headers(self, *a, **kw):
            pass

        async def write_eof(self, *a, **kw):
            pass

        def enable_chunking(self):
            pass

        def enable_compression(self, *a, **kw):
            pass

    from aiohttp import web

    app = web.Application()
    app[LIMITS] = Limits(send_timeout_s=0.2)
    req = make_mocked_request("POST", "/v1/audio/speech", writer=Blocked(), app=app)
    closed = asyncio.Event()

    async def body():
        while True:
            yield b"\0" * 4800

    async def close():
        closed.set()

    t0 = time.monotonic()
    await asyncio.wait_for(send_streamed(req, Streamed(body(), "audio/pcm", close)), 5)
    assert closed.is_set() and time.monotonic() - t0 < 2
    assert req.transport.abort.called


# ---- OpenPI ----------------------------------------------------------------------------------------


async def test_a_large_robot_frame_is_decoded_off_the_loop(h, monkeypatch):
    """While one robot's 8 MB frame decodes (made slow here: 1 s, blocking), another
    robot's replies keep coming."""
    import protocols.openpi.server as server

    real = server.unpackb

    def slow(data: bytes):
        if len(data) > server.DECODE_OFF_LOOP_BYTES:
            time.sleep(1.0)  # blocks whatever thread runs it
        return real(data)

    monkeypatch.setattr(server, "unpackb", slow)
    async with await PolicyClient.connect(h.url("/", ws=True)) as control, await PolicyClient.connect(h.url("/", ws=True)) as big:
        await control.infer(droid_observation(0))
        obs = droid_observation(1)
        obs["observation/padding"] = np.zeros(8 << 20, np.uint8)
        await big.ws.send(packb(obs))
        t0 = time.monotonic()
        times = []
        for i in range(5):
            await control.infer(droid_observation(i))
            times.append(time.monotonic() - t0)
        assert times[-1] < 0.9, times  # all five answered while the big frame was still decoding
        await big.ws.recv()


async def test_websockets_are_served_without_per_message_compression():
    """Audio frames are not deflated (it barely shrinks them and costs the pacing loop):
    a client offering permessage-deflate gets plain frames."""
    import websockets

    from testkit import serve

    async with serve(["voice"]) as h:
        async with websockets.connect(h.url("/v1/duplex", ws=True)) as ws:  # offers permessage-deflate by default
            assert ws.response is not None and "sec-websocket-extensions" not in {k.lower() for k in ws.response.headers}
            assert ws.protocol.extensions == []
            first = await ws.recv()
            assert "session.created" in str(first)
