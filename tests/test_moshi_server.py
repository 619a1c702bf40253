"""/v1/duplex?model=moshi on the shared real server (tiny random Moshi + Mimi through
transformers, the torch engine, the frame clock): two conversations at once each hear
the model while they are still talking, at the declared rates."""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import pytest

from clients.duplex import DuplexClient
from clients.webrtc import CallClient, use_host_addresses
from testkit.harness import ADMIN_HEADERS, ADMIN_KEY, silence, speech_pcm16

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


def url(server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/duplex?model=moshi"


async def converse(c: DuplexClient, pcm16: bytes, rate: int) -> tuple[float, list[dict]]:
    """Speak `pcm16` in real time; return when sending ended and what arrived by then."""
    await c.stream_audio(pcm16, rate=rate)
    end = time.monotonic()
    await asyncio.sleep(0.3)
    return end, c.drain()


async def test_two_conversations_hear_the_model_while_they_still_speak(server):
    a = await DuplexClient.connect(url(server), ADMIN_KEY)
    b = await DuplexClient.connect(url(server), ADMIN_KEY)
    assert a.session["capabilities"]["full_duplex"] and a.session["model"] == "moshi"
    # b speaks at 16 kHz and hears 48 kHz: both resampled with soxr on the server
    await b.send("session.update", session={"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}},
                                                      "output": {"format": {"type": "audio/pcm", "rate": 48000}}}})
    await b.until("session.updated")
    t0 = time.monotonic()
    (end_a, ev_a), (end_b, ev_b) = await asyncio.gather(
        converse(a, speech_pcm16("Hello there, how are you doing today?", 24000), 24000),
        converse(b, speech_pcm16("Tell me something about the weather outside.", 16000), 16000),
    )
    for ev, end, rate in ((ev_a, end_a, 24000), (ev_b, end_b, 48000)):
        frames = [e for e in ev if e["type"] == "audio.binary"]
        during = [e for e in frames if e["_t"] < end]
        spoke_s = end - t0
        # one 80 ms frame of the model's voice per tick, arriving while the user still talks
        assert len(during) >= 0.6 * spoke_s / 0.08, (len(during), spoke_s)
        # 80 ms a frame at the output rate (soxr's stream hands its output on in blocks of its own)
        total = sum(len(e["audio"]) for e in frames) / 2
        assert abs(total - len(frames) * rate * 0.08) <= rate * 0.16, (total, len(frames))
        pcm = np.frombuffer(b"".join(e["audio"] for e in frames), "<i2")
        assert np.abs(pcm).max() > 0  # the (random) model's voice, not silence
        errors = [e for e in ev if e["type"] == "error"]
        assert not errors, errors
    with httpx.Client(base_url=server.url, headers=ADMIN_HEADERS) as api:
        metrics = api.get("/metrics").text
        assert 'omni_rt_duplex_step_seconds_count{stage="moshi"}' in metrics
        assert any(m["id"] == "moshi" for m in api.get("/v1/models").json()["data"])
    # both end their conversations (a socket closed without session.close detaches its
    # session, whose conversation keeps its batch slot for the resume grace)
    for c in (a, b):
        await c.send("session.close")
        await c.until("session.closed")
        await c.close()


async def test_a_webrtc_call_with_the_full_duplex_model(server):
    use_host_addresses(["127.0.0.1"])
    call = await CallClient.connect(server.url, ADMIN_KEY, model="moshi")
    try:
        created = await call.until("session.created")
        assert created["session"]["model"] == "moshi" and created["session"]["capabilities"]["full_duplex"]
        t0 = time.monotonic()
        call.mic.say(silence(0.2) + speech_pcm16("Hello, who am I talking to?") + silence(0.5))
        await asyncio.sleep(2.5)
        heard = call.heard(t0)
        # the model's voice came back over RTP while the caller was talking
        assert len(heard) > 48000 and int(np.abs(heard.astype(np.int32)).max()) > 64
        events = []
        while not call.events.empty():
            events.append(call.events.get_nowait()["type"])
        assert "error" not in events and "output_audio_buffer.started" in events
    finally:
        status = await call.hangup()
    assert status == 204


async def test_the_duplex_cli_talks_with_the_model(server, tmp_path, capsys):
    from clients.duplex import _main
    from clients.realtime import read_wav_pcm16, write_wav_pcm16

    write_wav_pcm16(str(tmp_path / "q.wav"), speech_pcm16("Hello, can you hear me?"))
    rc = await _main(["--url", url(server), "--api-key", ADMIN_KEY, "--in", str(tmp_path / "q.wav"), "--out", str(tmp_path / "a.wav")])
    err = capsys.readouterr().err
    assert rc == 0 and "full duplex:" in err and "late frames" in err, err
    heard = np.frombuffer(read_wav_pcm16(str(tmp_path / "a.wav")), "<i2")
    assert len(heard) > 24000 and np.abs(heard).max() > 0  # the model's voice, for as long as the user spoke
