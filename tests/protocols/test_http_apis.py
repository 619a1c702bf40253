"""The HTTP APIs in-process over fakes, driven by the official openai SDK (async) and
aiohttp: speech, chat, images, models, health and metrics, the sessions API, auth,
caps, errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import wave
from typing import Any

import openai
import pytest

from testkit import serve

ADMIN, ALICE, LIMITED = "k-admin-000001", "k-alice-000001", "k-limited-0001"
KEYS = {"api_keys": [{"key": ADMIN, "principal": "ops", "admin": True}, {"key": ALICE, "principal": "alice"},
                     {"key": LIMITED, "principal": "limited"}]}
SPEECH = {"model": "tts", "voice": "tara", "input": "Hello there, world.", "response_format": "pcm"}


def auth(key: str = ADMIN, scheme: str = "Bearer") -> dict[str, str]:
    return {"authorization": f"{scheme} {key}"}


@pytest.fixture
async def h():
    async with serve(["voice", "tts", "image"], {"server": KEYS, "sessions": {"principal_caps": {"limited": 1}}}) as harness:
        harness.sdks = []  # type: ignore[attr-defined]
        yield harness
        for c in harness.sdks:  # type: ignore[attr-defined]
            await c.close()


def sdk(h, key: str = ADMIN) -> Any:  # the wire takes values the SDK's types do not list
    client = openai.AsyncOpenAI(base_url=h.url("/v1"), api_key=key, max_retries=0, timeout=10)
    h.sdks.append(client)
    return client


async def idle(h) -> bool:
    for _ in range(200):
        if not h.runtime.orchestrator.running() and not h.sessions.sessions():
            return True
        await asyncio.sleep(0.005)
    return False


# ---- speech -------------------------------------------------------------------------------


async def test_speech_streams_each_format_through_the_sdk(h):
    client = sdk(h)
    wav = await client.audio.speech.create(model="tts-1", voice="alloy", input="Hello there, world.", response_format="wav")
    data = wav.content
    assert data[:4] == b"RIFF" and data[4:8] == b"\xff\xff\xff\xff"  # streamed WAV: sizes unknown
    w = wave.open(io.BytesIO(data))
    assert (w.getframerate(), w.getnchannels()) == (24000, 1)
    # the fake talker speaks one codec frame (2048 samples) per word of its text
    assert len(w.readframes(10**9)) == 3 * 2048 * 2
    async with client.audio.speech.with_streaming_response.create(model="tts", voice="tara", input="a b c d e f g h",
                                                                  response_format="pcm") as resp:
        assert resp.headers["content-type"].startswith("audio/pcm") and resp.headers["x-session-id"].startswith("sess_")
        chunks = [c async for c in resp.iter_bytes()]
    assert sum(map(len, chunks)) == 8 * 2048 * 2
    import av

    for fmt in ("mp3", "flac", "opus", "aac"):
        r = await client.audio.speech.create(model="tts", voice="tara", input="Short test.", response_format=fmt)
        with av.open(io.BytesIO(r.content)) as c:
            assert sum(f.samples for f in c.decode(audio=0)) > 0
    assert await idle(h)


async def test_speech_sse_events_in_order_with_usage(h):
    r = await h.client.post("/v1/audio/speech", json={**SPEECH, "stream_format": "sse"}, headers=auth())
    assert r.status == 200 and r.content_type == "text/event-stream"
    events = [json.loads(line[6:]) for line in (await r.text()).splitlines() if line.startswith("data: ")]
    types = [e["type"] for e in events]
    assert types[-1] == "speech.audio.done" and set(types[:-1]) == {"speech.audio.delta"}
    assert sum(len(base64.b64decode(e["audio"])) for e in events[:-1]) == 3 * 2048 * 2
    usage = events[-1]["usage"]
    assert usage == {"input_tokens": 3, "output_tokens": 3, "total_tokens": 6}


async def test_speech_speed_and_seed(h):
    async def run(**kw) -> bytes:
        r = await h.client.post("/v1/audio/speech", json={**SPEECH, **kw}, headers=auth())
        assert r.status == 200
        return await r.read()

    a, b = await run(seed=11), await run(seed=11)
    assert a == b
    fast = await run(seed=11, speed=2.0)
    assert abs(len(fast) / len(a) - 0.5) < 0.06


BAD_SPEECH = [
    ("not json", None, "invalid_json"),
    ([1, 2], None, "invalid_json"),
    ({"model": "tts", "voice": "tara"}, "input", "missing_required_parameter"),
    ({"model": "tts", "voice": "tara", "input": "   "}, "input", "invalid_value"),
    ({"model": "tts", "voice": "tara", "input": "x" * 4097}, "input", "string_above_max_length"),
    ({"model": "nope", "voice": "tara", "input": "hi"}, "model", "model_not_found"),
    ({"model": "tts", "voice": "nobody", "input": "hi"}, "voice", "invalid_value"),
    ({"model": "tts", "voice": "tara", "input": "hi", "response_format": "ogg"}, "response_format", "invalid_value"),
    ({"model": "tts", "voice": "tara", "input": "hi", "speed": 5}, "speed", "invalid_value"),
    ({"model": "tts", "voice": "tara", "input": "hi", "speed": "fast"}, "speed", "invalid_value"),
    ({"model": "tts", "voice": "tara", "input": 42}, "input", "invalid_value"),
    ({"model": "tts", "voice": "tara", "input": "hi", "stream_format": "ws"}, "stream_format", "invalid_value"),
    ({"model": "tts", "voice": "tara", "input": "hi", "colour": "red"}, "colour", "unknown_parameter"),
]


async def test_bad_speech_requests_are_400s_naming_the_field_and_the_server_goes_on(h):
    for body, param, code in BAD_SPEECH:
        data = body if isinstance(body, str) else json.dumps(body)
        r = await h.client.post("/v1/audio/speech", data=data, headers={**auth(), "content-type": "application/json"})
        assert r.status == 400, (body, await r.text())
        err = (await r.json())["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        assert (err["param"], err["code"]) == (param, code), (body, err)
    with pytest.raises(openai.BadRequestError) as exc:
        await sdk(h).audio.speech.create(model="tts", voice="tara", input="", response_format="wav")
    assert exc.value.body["param"] == "input"
    r = await h.client.post("/v1/audio/speech", json=SPEECH, headers=auth())
    assert r.status == 200 and len(await r.read()) > 0


async def test_a_client_that_leaves_mid_stream_frees_every_engine(h):
    body = {**SPEECH, "input": " ".join(["word"] * 800)}
    async with h.client.post("/v1/audio/speech", json=body, headers=auth()) as r:
        assert r.status == 200
        await r.content.read(1000)
        assert h.runtime.orchestrator.running()
    # the connection closed with the response unread
    assert await idle(h)
    assert sum(pool.load() for pool in h.runtime.pools.values()) == 0


# ---- chat ---------------------------------------------------------------------------------

MSG = [{"role": "user", "content": "Say hello"}]


async def test_chat_text_streaming_and_audio(h):
    client = sdk(h)
    c = await client.chat.completions.create(model="gpt-realtime", messages=MSG, max_tokens=4)
    assert c.choices[0].message.content.count("w") == 4 and c.usage.completion_tokens == 4
    chunks = [x async for x in await client.chat.completions.create(model="gpt-realtime", messages=MSG, max_tokens=3, stream=True,
                                                                    stream_options={"include_usage": True})]
    text = "".join(x.choices[0].delta.content or "" for x in chunks if x.choices)
    assert text.count("w") == 3 and chunks[-1].usage.completion_tokens == 3
    audio = await client.chat.completions.create(model="gpt-4o-audio-preview", messages=MSG, max_tokens=3,
                                                 modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"})
    wav = base64.b64decode(audio.choices[0].message.audio.data)
    assert wav[:4] == b"RIFF" and audio.choices[0].message.audio.transcript.count("w") == 3
    # a text-only request enters at the thinker: the audio encoder never starts
    assert h.processor("thinker").seen[0]["audio_rows"] == 0


async def test_chat_audio_in_reaches_the_thinker(h):
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes(bytes(48000))  # 1 s
    messages = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(),
                                                                                    "format": "wav"}}]}]
    c = await sdk(h).chat.completions.create(model="gpt-realtime", messages=messages, max_tokens=2)
    assert c.usage.prompt_tokens_details.audio_tokens == 25
    assert h.processor("thinker").seen[-1]["messages"][0]["content"] == "<|audio|>"


def _png(seed: int = 0) -> str:
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(seed).random((24, 32, 3)) * 255).astype(np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def test_chat_images_reach_the_thinker(h):
    """image_url parts (data URLs) through the SDK: each becomes a placeholder in its
    message, the images go beside the prompt in order; an idle server keeps no session."""
    urls = [_png(1), _png(2)]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": urls[0]}},
                                             {"type": "text", "text": "and"}, {"type": "image_url", "image_url": {"url": urls[1], "detail": "low"}}]}]
    c = await sdk(h).chat.completions.create(model="gpt-realtime", messages=messages, max_tokens=2)
    assert c.choices[0].finish_reason == "length"
    seen = h.processor("thinker").seen[-1]
    assert seen["params"]["images"] == urls and seen["messages"][0]["content"] == "Compare <|image|> and <|image|>"
    assert await idle(h)


BAD_CHAT = [
    ({"model": "nope", "messages": MSG}, "model", "model_not_found"),
    ({"model": "gpt-realtime", "messages": []}, "messages", "invalid_value"),
    ({"model": "gpt-realtime", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"model": "gpt-realtime", "messages": MSG, "modalities": ["text", "audio"]}, "audio", "missing_required_parameter"),
    ({"model": "gpt-realtime", "messages": MSG, "modalities": ["text", "audio"], "audio": {"voice": "x", "format": "wav"}}, "audio.voice",
     "invalid_value"),
    ({"model": "gpt-realtime", "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "***", "format": "wav"}}]}]},
     "messages[0].content[0].input_audio.data", "invalid_value"),
    ({"model": "gpt-realtime", "messages": MSG, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"model": "gpt-realtime", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/cat.png"}}]}]},
     "messages[0].content[0].image_url.url", "invalid_value"),
    ({"model": "gpt-realtime", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].image_url.url", "missing_required_parameter"),
    ({"model": "gpt-realtime", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
                                              * 5}]}, "messages[0].content[4].image_url.url", "invalid_value"),  # past the thinker's 4
    ({"model": "gpt-realtime", "messages": [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     "messages[0].content", "invalid_value"),
    ({"model": "gpt-realtime", "messages": MSG, "temperature": 3}, "temperature", "invalid_value"),
]


async def test_bad_chat_requests_are_400s_naming_the_field(h):
    for body, param, code in BAD_CHAT:
        r = await h.client.post("/v1/chat/completions", json=body, headers=auth())
        assert r.status == 400, await r.text()
        err = (await r.json())["error"]
        assert (err["param"], err["code"]) == (param, code), err


# ---- images -------------------------------------------------------------------------------


async def test_images_through_the_sdk_and_steps_shared(h):
    res = await sdk(h).images.generate(model="dall-e-3", prompt="a red square", size="64x32", n=2,
                                       extra_body={"seed": 3, "num_inference_steps": 2})
    from PIL import Image

    imgs = [Image.open(io.BytesIO(base64.b64decode(d.b64_json))) for d in res.data]
    assert [i.size for i in imgs] == [(64, 32), (64, 32)]
    assert imgs[0].getpixel((0, 0)) != imgs[1].getpixel((0, 0))  # image i uses seed + i
    for body, param in (({"prompt": ""}, "prompt"), ({"prompt": "x", "size": "17x17"}, "size"), ({"prompt": "x", "n": 11}, "n"),
                        ({"prompt": "x", "response_format": "url"}, "response_format")):
        r = await h.client.post("/v1/images/generations", json=body, headers=auth())
        assert r.status == 400 and (await r.json())["error"]["param"] == param


# ---- models, health, metrics, errors --------------------------------------------------------


async def test_models_health_metrics_and_unknown_routes(h):
    models = await (await h.client.get("/v1/models", headers=auth())).json()
    assert {"tts", "tts-1", "gpt-realtime", "dall-e-3"} <= {m["id"] for m in models["data"]}
    r = await h.client.get("/v1/models/tts-1", headers=auth())
    assert (await r.json())["owned_by"] == "omni-rt:tts"
    r = await h.client.get("/v1/models/nope", headers=auth())
    assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
    health = await (await h.client.get("/health")).json()
    assert health["status"] == "ok" and set(health["pipelines"]) == {"voice", "tts", "image"}
    await h.client.post("/v1/audio/speech", json=SPEECH, headers=auth())
    m = await (await h.client.get("/metrics", headers=auth())).text()
    assert 'omni_rt_requests_total{pipeline="tts",status="completed"}' in m
    r = await h.client.get("/v1/nothing", headers=auth())
    assert r.status == 404 and (await r.json())["error"] == {"message": "Unknown path /v1/nothing", "type": "invalid_request_error",
                                                            "param": None, "code": "not_found"}
    r = await h.client.delete("/v1/models", headers=auth())
    assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"
    r = await h.client.post("/v1/chat/completions", data=b"x" * (64 * 1024 * 1024 + 1), headers=auth())
    assert r.status == 413 and (await r.json())["error"]["code"] == "request_too_large"


async def test_index_page_lists_what_is_served_and_needs_no_key(h):
    r = await h.client.get("/")
    page = await r.text()
    assert r.status == 200 and "/v1/realtime/calls" in page and "/v1/images/generations" in page and 'href="/demo"' in page
    assert (await h.client.get("/demo")).status == 200


# ---- auth, caps, the sessions API -----------------------------------------------------------


async def test_every_route_needs_a_valid_key(h):
    for auth_header in (None, "Bearer wrong-key-123", "Basic dGVzdA==", f"Bearer{ADMIN}", "Api-Key"):
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/v1/sessions"), ("POST", "/v1/audio/speech"),
                             ("GET", "/v1/nothing")):
            r = await h.client.request(method, path, headers={"authorization": auth_header} if auth_header else {})
            assert r.status == 401, (auth_header, path)
            assert (await r.json())["error"]["code"] == "invalid_api_key"
    for path in ("/health", "/healthz"):
        assert (await h.client.get(path)).status == 200
    assert (await h.client.get("/v1/models", headers=auth(ALICE, "Api-Key"))).status == 200
    with pytest.raises(openai.AuthenticationError):
        await sdk(h, "not-a-key").audio.speech.create(model="tts", voice="tara", input="hi")


async def test_over_the_cap_429_with_retry_after_and_the_slot_comes_back(h):
    long = {**SPEECH, "input": " ".join(["word"] * 800)}
    async with h.client.post("/v1/audio/speech", json=long, headers=auth(LIMITED)) as held:
        assert held.status == 200
        await held.content.read(100)
        sid = held.headers["x-session-id"]
        r = await h.client.post("/v1/audio/speech", json=SPEECH, headers=auth(LIMITED))
        assert r.status == 429 and r.headers["retry-after"] == "1"
        err = (await r.json())["error"]
        assert err["code"] == "session_limit" and err["type"] == "requests" and "principal" in err["message"]
        with pytest.raises(openai.RateLimitError):
            await sdk(h, LIMITED).audio.speech.create(model="tts", voice="tara", input="hi")
        mine = (await (await h.client.get("/v1/sessions", headers=auth(LIMITED))).json())["data"]
        assert [(s["id"], s["kind"], s["principal"]) for s in mine] == [(sid, "oneshot", "limited")]
        others = (await (await h.client.get("/v1/sessions", headers=auth(ALICE))).json())["data"]
        assert sid not in [s["id"] for s in others]
        # the owner needs the session's token; another principal does not see it; an admin closes it
        assert (await h.client.delete(f"/v1/sessions/{sid}", headers=auth(ALICE))).status == 404
        assert (await h.client.delete(f"/v1/sessions/{sid}", headers=auth(LIMITED))).status == 403
        r = await h.client.delete(f"/v1/sessions/{sid}", headers=auth())
        assert await r.json() == {"id": sid, "object": "session.deleted", "deleted": True}
    r = await h.client.delete(f"/v1/sessions/{sid}", headers=auth())
    assert r.status == 410 and "operator" in (await r.json())["error"]["message"]
    assert await idle(h)
    r = await h.client.post("/v1/audio/speech", json=SPEECH, headers=auth(LIMITED))
    assert r.status == 200


async def test_concurrent_calls_all_complete_and_metrics_count_them(h):
    async def one(i: int) -> tuple[int, int]:
        r = await h.client.post("/v1/audio/speech", json={**SPEECH, "input": f"Request number {i}.", "seed": i}, headers=auth())
        return r.status, len(await r.read())

    results = await asyncio.gather(*(one(i) for i in range(8)))
    assert all(status == 200 and n == 3 * 2048 * 2 for status, n in results), results
    m = await (await h.client.get("/metrics", headers=auth())).text()
    for name in (
        'omni_rt_sessions_active{kind="oneshot"} 0.0',
        'omni_rt_sessions_ended_total{kind="oneshot",reason="completed"}',
        'omni_rt_stage_inflight_requests{stage="talker"}',
        'omni_rt_stage_queue_depth{stage="code2wav"}',
        "omni_rt_session_admission_seconds_count",
        'omni_rt_request_e2e_seconds_count{api="speech"}',
        'omni_rt_time_to_first_packet_seconds_count{api="speech"}',
    ):
        assert name in m, name


async def test_a_dead_engine_is_a_503_with_retry_after_and_health_says_so(h):
    h.engine("talker").mark_dead("test: the engine process died")
    r = await h.client.post("/v1/audio/speech", json=SPEECH, headers=auth())
    assert r.status == 503 and r.headers["retry-after"] == "5"
    assert (await r.json())["error"]["code"] == "engine_unavailable"
    health = await h.client.get("/health")
    assert health.status == 503 and (await health.json())["unhealthy_stages"] == ["talker"]
    # the engine died in this process: not ready, and not live (only a restart brings it back)
    ready, live = await h.client.get("/readyz"), await h.client.get("/livez")
    assert ready.status == 503 and (await ready.json())["unhealthy_stages"] == ["talker"]
    assert live.status == 503 and (await live.json())["dead_stages"] == ["talker"]
    assert await idle(h)  # the refused call's one-shot session gave its slot back


async def test_probes_a_draining_node_stays_live_and_is_not_ready(h):
    """Kubernetes' probes: /livez and /healthz (liveness) and /readyz and /health
    (readiness) need no key; while the node drains it is live (its sessions are moving:
    a liveness failure would kill them mid-move) and not ready (no new sessions)."""
    for path, body in (("/livez", {"status": "live"}), ("/healthz", {"status": "live"}), ("/readyz", {"status": "ready"})):
        r = await h.client.get(path)
        assert r.status == 200 and await r.json() == body, path
    r = await h.client.post("/admin/drain", json={"timeout_s": 1}, headers=auth())
    assert r.status in (200, 202), await r.text()
    for _ in range(50):
        if h.sessions.draining:
            break
        await asyncio.sleep(0.02)
    assert (await h.client.get("/livez")).status == 200 and (await (await h.client.get("/livez")).json())["status"] == "draining"
    assert (await h.client.get("/healthz")).status == 200
    ready = await h.client.get("/readyz")
    assert ready.status == 503 and (await ready.json())["status"] == "draining"
    assert (await h.client.get("/health")).status == 503


def _gauges(text: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


async def test_autoscaler_signals_requests_running_waiting_and_admission_headroom():
    """The gauges an autoscaler or a router reads: requests running and waiting per
    pipeline, sessions by kind, and the admission headroom by kind (within the caps)."""
    from testkit.wire import connect

    async with serve(["voice", "tts"], {"sessions": {"max_per_kind": {"realtime": 3}}}) as h:
        g = _gauges(await (await h.client.get("/metrics")).text())
        assert g[("omni_rt_requests_running", (("pipeline", "voice"),))] == 0
        assert ("omni_rt_requests_waiting", (("pipeline", "tts"),)) in g
        assert g[("omni_rt_admission_headroom_sessions", (("kind", "realtime"),))] == 3  # the kind's cap, nothing open
        ws = await connect(h, "/v1/realtime?model=gpt-realtime")
        await ws.until("session.created")
        await ws.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]})
        await ws.send("response.create", response={"max_output_tokens": 400})
        await ws.until("response.created")
        g = _gauges(await (await h.client.get("/metrics")).text())
        assert g[("omni_rt_requests_running", (("pipeline", "voice"),))] == 1
        assert g[("omni_rt_admission_headroom_sessions", (("kind", "realtime"),))] == 2
        assert g[("omni_rt_sessions_active", (("kind", "realtime"),))] >= 1
        await ws.ws.close()
