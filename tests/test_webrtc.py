"""WebRTC calls on the shared server with the aiortc client: ICE on loopback only (no
STUN, host candidates limited to 127.0.0.1 on both sides)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from clients.webrtc import CallClient, use_host_addresses
from testkit.harness import ADMIN_HEADERS, ADMIN_KEY, http_client, silence, speech_pcm16

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

use_host_addresses(["127.0.0.1"])


def calls(api) -> set[str]:
    return {s["id"] for s in api.get("/v1/sessions").json()["data"] if s["kind"] == "webrtc"}


async def test_a_call_end_to_end(server):
    api = http_client(server.url, ADMIN_HEADERS)
    call = await CallClient.connect(server.url, ADMIN_KEY, session={"type": "realtime", "max_output_tokens": 8})
    try:
        created = await call.until("session.created")
        assert created["session"]["id"] == call.call_id and call.call_id in calls(api)
        assert created["session"]["max_output_tokens"] == 8  # the offer's session config applies
        call.mic.say(silence(0.3) + speech_pcm16("Hello, can you tell me what the weather is like today?") + silence(1.0))
        seen: list = []
        stopped = await call.until("input_audio_buffer.speech_stopped", seen)
        done = await call.until("response.done", seen)
        assert done["response"]["status"] == "completed"
        await call.until("output_audio_buffer.stopped", seen)
        types = [e["type"] for e in seen]
        assert "input_audio_buffer.speech_started" in types and "output_audio_buffer.started" in types
        assert "response.output_audio.delta" not in types  # audio goes over RTP
        assert any(t == "response.output_audio_transcript.delta" for t in types)
        heard = call.heard(stopped["_t"])
        assert len(heard) > 0 and int(np.abs(heard.astype(np.int32)).max()) > 64, "no audible reply arrived over RTP"
        assert call.first_sound(stopped["_t"]) is not None
        # frames keep coming (silence) at the real-time pace between answers
        n0 = len(call.frames)
        await asyncio.sleep(1.0)
        assert 10 <= len(call.frames) - n0 <= 100  # ~50 a second, give or take jitter buffering
    finally:
        status = await call.hangup()
    assert status == 204
    assert call.call_id not in calls(api)
    api.close()


async def test_barge_in_clears_the_servers_output_buffer(server):
    from testkit.harness import admitting

    await admitting(server.url)  # (the earlier tests' answers may still weigh on admission)
    call = await CallClient.connect(
        server.url,
        ADMIN_KEY,
        session={"type": "realtime", "audio": {"input": {"turn_detection": {"type": "server_vad", "create_response": False}}}},
    )
    api = http_client(server.url, ADMIN_HEADERS)

    def metrics_text() -> str:
        return api.get("/metrics").text

    before = barge_ins_within_100ms(metrics_text())
    try:
        assert (await call.until("session.created"))["session"]["audio"]["input"]["turn_detection"]["create_response"] is False
        call.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me a long story"}]})
        # long enough that the answer is still being made when the caller's words are
        # heard (at 120 tokens a fast machine finished it first, and no response.done
        # followed the barge-in)
        call.send("response.create", response={"max_output_tokens": 400})
        seen: list = []
        created = await call.until("response.created", seen)
        rid = created["response"]["id"]
        await call.until("output_audio_buffer.started", seen)
        await speaking_steadily(call, seen)
        assert call.first_sound(time.monotonic() - 0.5) is not None
        call.mic.say(speech_pcm16("Stop, please listen to me."))
        after: list = []
        cleared = await call.until("output_audio_buffer.cleared", after)
        done = await call.until("response.done", after)
        assert done["response"]["id"] == rid and done["response"]["status"] == "cancelled"
        assert done["response"]["status_details"]["reason"] == "turn_detected"
        assert cleared["response_id"] == rid
        # history keeps what was played: the answer's item is cut to the audio sent
        cut = await call.until("conversation.item.truncated", after)
        assert cut["item_id"] == done["response"]["output"][0]["id"] and cut["audio_end_ms"] > 0
        # The server's next outbound frame after the speech start was silent (its own
        # measurement, the barge-in histogram)...
        # (observed when the track produces that frame: within a frame or two of now)
        for _ in range(40):
            if barge_ins_within_100ms(metrics_text()) > before:
                break
            await asyncio.sleep(0.05)
        assert barge_ins_within_100ms(metrics_text()) == before + 1
        # ...and the client hears silence once its receive jitter buffer (aiortc: up to
        # 16 frames, 320 ms) has played out what had already arrived
        await asyncio.sleep(1.2)
        tail = call.heard(cleared["_t"] + 0.4)
        assert len(tail) >= 0.5 * call.frame_rate and int(np.abs(tail.astype(np.int32)).max()) <= 64
    finally:
        await call.hangup()
        api.close()


async def speaking_steadily(call: CallClient, seen: list, hold_s: float = 0.5) -> None:
    """Wait until the agent's audio has played for `hold_s` without a pause. (The
    random tiny talker may give a phrase only a few frames of audio: the buffer then
    runs dry until the next phrase, and a barge-in there has nothing to clear.)"""
    playing = True  # called right after output_audio_buffer.started
    for _ in range(60):
        await asyncio.sleep(hold_s)
        changed = False
        while not call.events.empty():
            ev = call.events.get_nowait()
            seen.append(ev)
            assert ev["type"] != "response.done", "the answer ended before the barge-in"
            if ev["type"] in ("output_audio_buffer.started", "output_audio_buffer.stopped"):
                playing, changed = ev["type"] == "output_audio_buffer.started", True
        if playing and not changed:
            return
    raise AssertionError("the agent never spoke steadily for half a second")


def barge_ins_within_100ms(metrics: str) -> float:
    """WebRTC barge-ins whose outbound audio went silent within 100 ms (server side)."""
    for line in metrics.splitlines():
        if line.startswith('omni_rt_webrtc_barge_in_silent_seconds_bucket{le="0.1"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


