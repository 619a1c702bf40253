"""/v1/duplex on the shared server: capabilities, binary audio both ways at declared
rates, barge-in with playback acks, detach/resume, grace expiry, bad input, slow
consumers. Answers run to their token limit (testkit.harness.SERVER_OVERLAY)."""

from __future__ import annotations

import numpy as np
import pytest

from clients.duplex import DuplexClient
from testkit.harness import ADMIN_KEY, silence, speech_pcm16

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


