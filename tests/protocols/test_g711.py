"""G.711 (μ-law / A-law at 8 kHz, the telephone network's audio) on every voice wire, in
process (testkit: the real app over fake engines, EnergyVad). The client side encodes
and decodes with FFmpeg (PyAV), a codec apart from the server's."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest

from media.wire_audio import PCMA, PCMU, InputDecoder, OutputEncoder, WireFormat, WireFormatError
from testkit import serve
from testkit.wire import b64, connect, from_g711, g711, quiet, tone

BETA = {"openai-beta": "realtime=v1"}


@pytest.fixture
async def h():
    async with serve(["voice"]) as harness:
        yield harness


def test_formats_in_both_realtime_shapes_and_what_is_refused():
    assert WireFormat.parse_realtime("g711_ulaw") == PCMU and WireFormat.parse_realtime({"type": "audio/pcma"}) == PCMA
    assert WireFormat.parse_realtime({"type": "audio/pcmu", "rate": 8000}).ga() == {"type": "audio/pcmu"}
    assert PCMA.beta() == "g711_alaw" and WireFormat.parse_realtime("pcm16").ga() == {"type": "audio/pcm", "rate": 24000}
    for bad in ({"type": "audio/pcmu", "rate": 16000}, "opus", {"type": "audio/pcm", "rate": 8000}, 7):
        with pytest.raises(WireFormatError):
            WireFormat.parse_realtime(bad)


@pytest.mark.parametrize("law", ["ulaw", "alaw"])
def test_the_codec_round_trips_a_tone_through_8_khz(law):
    fmt = PCMU if law == "ulaw" else PCMA
    pcm = tone(1.0, amp=0.3, freq=440.0)  # 24 kHz
    enc = OutputEncoder(fmt, 24000)
    wire = b"".join(enc.encode("a", pcm[i : i + 960]) for i in range(0, len(pcm), 960)) + enc.finish("a")
    assert abs(len(wire) - 8000) <= 8  # one byte a sample at 8 kHz, the resampler's tail included
    heard = from_g711(wire, law).astype(np.float64) / 32768
    # the same tone at 8 kHz (up to the resampler's delay): its spectrum peaks at 440 Hz
    spectrum = np.abs(np.fft.rfft(heard[400:]))
    assert abs(np.argmax(spectrum) * 8000 / len(heard[400:]) - 440) < 5
    assert 0.25 < np.sqrt(np.mean(heard[400:] ** 2)) * np.sqrt(2) < 0.35
    back = InputDecoder(fmt, 24000).decode(g711(pcm, law))
    # the input stream never ends: its resampler holds ~20 ms (heard with the next frame)
    assert 24000 - 600 <= len(back) <= 24000 and 0.25 < np.abs(back).max() < 0.35


@pytest.mark.parametrize("law", ["ulaw", "alaw"])
async def test_a_ga_realtime_call_in_and_out_at_8_khz(h, law):
    ws = await connect(h, "/v1/realtime?model=gpt-realtime")
    await ws.until("session.created")
    fmt = {"type": f"audio/pcm{law[0]}"}
    await ws.send("session.update", session={"type": "realtime", "max_output_tokens": 6,
                                             "audio": {"input": {"format": fmt}, "output": {"format": fmt}}})
    updated = (await ws.until("session.updated"))["session"]["audio"]
    assert updated["input"]["format"] == fmt and updated["output"]["format"] == fmt
    # server VAD hears μ-law/A-law speech as it hears PCM: 0.6 s quiet, 0.8 s tone, 0.8 s quiet
    audio = g711(quiet(0.6) + tone(0.8) + quiet(0.8), law)
    for i in range(0, len(audio), 160):  # 20 ms frames, as a phone leg sends them
        await ws.send("input_audio_buffer.append", audio=base64.b64encode(audio[i : i + 160]).decode())
    done = await ws.until("response.done")
    t = ws.types()
    started = ws.seen[t.index("input_audio_buffer.speech_started")]
    stopped = ws.seen[t.index("input_audio_buffer.speech_stopped")]
    assert started["audio_start_ms"] == 600 - 300 and 1400 <= stopped["audio_end_ms"] <= 1420
    assert done["response"]["status"] == "completed"
    # the utterance reached the thinker at the model rate: ~1.6 s in 40 ms rows, as with
    # PCM (the decoder's resampler holds ~20 ms, heard with the next frame)
    assert 37 <= done["response"]["usage"]["input_token_details"]["audio_tokens"] <= 42
    out = b"".join(base64.b64decode(e["delta"]) for e in ws.seen if e["type"] == "response.output_audio.delta")
    # what went out is the same answer as on a PCM session, at 8 kHz, one byte a
    # sample, the resampler's tail included
    assert out and len(from_g711(out, law)) == len(out)
    pcm_out = await _pcm_answer_bytes(h)
    assert abs(len(out) - pcm_out // 2 // 3) <= 16, (len(out), pcm_out)


async def _pcm_answer_bytes(h) -> int:
    """The bytes of the same answer on a PCM16 session (24 kHz), for comparison."""
    ws = await connect(h, "/v1/realtime?model=gpt-realtime")
    await ws.until("session.created")
    await ws.send("session.update", session={"type": "realtime", "max_output_tokens": 6, "audio": {"input": {"turn_detection": None}}})
    await ws.until("session.updated")
    await ws.send("input_audio_buffer.append", audio=b64(tone(1.0)))
    await ws.send("input_audio_buffer.commit")
    await ws.send("response.create")
    await ws.until("response.done")
    return sum(len(base64.b64decode(e["delta"])) for e in ws.seen if e["type"] == "response.output_audio.delta")


async def test_beta_names_and_truncation_in_milliseconds(h):
    ws = await connect(h, "/v1/realtime?model=gpt-4o-realtime-preview", BETA)
    await ws.until("session.created")
    await ws.send("session.update", session={"turn_detection": None, "input_audio_format": "g711_alaw", "output_audio_format": "g711_ulaw"})
    s = (await ws.until("session.updated"))["session"]
    assert (s["input_audio_format"], s["output_audio_format"]) == ("g711_alaw", "g711_ulaw")
    await ws.send("input_audio_buffer.append", audio=base64.b64encode(g711(tone(1.0), "alaw")).decode())
    await ws.send("input_audio_buffer.commit")
    committed = await ws.until("input_audio_buffer.committed")
    await ws.send("response.create", response={"max_output_tokens": 6})
    done = await ws.until("response.done")
    assert done["response"]["usage"]["input_token_details"]["audio_tokens"] == 25  # 1 s at 8 kHz -> 1 s at the model rate
    out = b"".join(base64.b64decode(e["delta"]) for e in ws.seen if e["type"] == "response.audio.delta")
    assert out and committed["item_id"]
    # what was heard is said in milliseconds, whatever the format: 100 ms of μ-law is 800 bytes
    item_id = done["response"]["output"][0]["id"]
    await ws.send("conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=100)
    assert (await ws.until("conversation.item.truncated"))["audio_end_ms"] == 100
    # a bad G.711 append is the protocol's error; the session goes on
    await ws.send("input_audio_buffer.append", audio="not base64!")
    assert (await ws.until("error"))["error"]["param"] == "audio"
    await ws.send("session.update", session={"input_audio_format": {"type": "audio/pcmu", "rate": 16000}})
    err = (await ws.until("error"))["error"]
    assert err["code"] == "invalid_value" and err["param"] == "session.input_audio_format"


async def test_duplex_binary_mulaw_both_ways_paced_in_20_ms_frames(h):
    ws = await connect(h, "/v1/duplex")
    created = (await ws.until("session.created"))["session"]
    assert {"type": "audio/pcmu", "rates": [8000], "binary_frame_type": 1} in created["capabilities"]["input_formats"]
    await ws.send("session.update", session={"max_output_tokens": 6, "audio": {
        "input": {"format": {"type": "audio/pcmu"}, "turn_detection": None},
        "output": {"format": {"type": "audio/pcmu"}, "transport": "binary", "pacing": "realtime"}}})
    s = (await ws.until("session.updated"))["session"]["audio"]
    assert s["input"]["format"] == {"type": "audio/pcmu"} and s["output"]["format"] == {"type": "audio/pcmu"}
    speech = g711(tone(1.0))
    for i in range(0, len(speech), 160):
        await ws.ws.send_bytes(b"\x01" + speech[i : i + 160])
    await ws.send("input_audio_buffer.commit")
    await ws.send("response.create")
    done = await ws.until("response.done", timeout=20)
    assert done["response"]["status"] == "completed"
    assert done["response"]["usage"]["input_token_details"]["audio_tokens"] == 25
    frames = [e["audio"] for e in ws.seen if e["type"] == "audio.binary"]
    # paced: 20 ms frames of 160 bytes (an audio event's last frame may be shorter)
    assert frames and all(len(f) <= 160 for f in frames) and sum(len(f) == 160 for f in frames) >= len(frames) // 2
    # acks are in milliseconds of what was played: 8 bytes a millisecond here
    rid = done["response"]["id"]
    await ws.send("playback.ack", response_id=rid, played_ms=sum(len(f) for f in frames) // 8)
    await ws.send("session.close")
    await ws.until("session.closed")


async def test_the_full_duplex_model_hears_and_speaks_alaw():
    """`/v1/duplex?model=moshi` (the fake step echoes each frame at half amplitude): A-law
    in at 8 kHz, A-law out, one 80 ms frame (640 bytes) at a time."""
    import asyncio
    import json

    from aiohttp import WSMsgType

    async with serve(["moshi"]) as h:
        ws = await h.client.ws_connect("/v1/duplex?model=moshi")
        assert json.loads((await ws.receive(timeout=5)).data)["type"] == "session.created"
        await ws.send_str(json.dumps({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcma"}},
                                                                                       "output": {"format": {"type": "audio/pcma"}}}}}))
        level = (np.full(8000, 0.4, np.float32) * 32767).astype("<i2").tobytes()  # 1 s of a constant level at 8 kHz
        speech = g711(level, "alaw", 8000)
        got: list[bytes] = []
        updated = None

        async def read() -> None:
            nonlocal updated
            while True:
                msg = await ws.receive()
                if msg.type == WSMsgType.BINARY:
                    got.append(msg.data[1:])
                elif msg.type == WSMsgType.TEXT and json.loads(msg.data)["type"] == "session.updated":
                    updated = json.loads(msg.data)["session"]
                elif msg.type != WSMsgType.TEXT:
                    return

        reader = asyncio.get_running_loop().create_task(read())
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for i in range(0, len(speech), 160):
            await ws.send_bytes(b"\x01" + speech[i : i + 160])
            await asyncio.sleep(max(0.0, t0 + (i // 160 + 1) * 0.02 - loop.time()))
        await asyncio.sleep(0.2)
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        assert updated is not None and updated["audio"]["output"]["format"] == {"type": "audio/pcma"}
        assert len(got) >= 8
        heard = from_g711(b"".join(got), "alaw").astype(np.float32) / 32768
        # the model heard the level and answered at half of it, in A-law at 8 kHz
        assert (np.abs(heard - 0.2) < 0.02).sum() > 4 * 640
        await ws.close()


async def test_openai_agents_twilio_example_realtime_leg_in_g711_ulaw(h):
    """The realtime leg of openai-agents' Twilio example, unchanged: a RealtimeRunner
    whose initial model settings ask for g711_ulaw both ways and server VAD, fed the
    caller's μ-law with `session.send_audio`; the answer's audio comes back in μ-law."""
    from agents.realtime import RealtimeAgent, RealtimeRunner

    agent = RealtimeAgent(name="Phone", instructions="Answer briefly.")
    runner = RealtimeRunner(agent)
    url = str(h.client.make_url("/v1/realtime")).replace("http://", "ws://")
    session = await runner.run(model_config={"url": f"{url}?model=gpt-realtime", "api_key": "sk-unused", "initial_model_settings": {
        "input_audio_format": "g711_ulaw", "output_audio_format": "g711_ulaw",
        "turn_detection": {"type": "server_vad", "interrupt_response": True, "create_response": True}}})
    audio = bytearray()
    formats: list[object] = []
    async with session:
        speech = g711(quiet(0.4) + tone(0.8) + quiet(0.8))
        for i in range(0, len(speech), 160):  # the example forwards Twilio's 20 ms media payloads
            await session.send_audio(speech[i : i + 160])

        async def until_answered() -> None:
            async for ev in session:
                if ev.type == "raw_model_event" and ev.data.type == "raw_server_event":
                    d = ev.data.data
                    assert d.get("type") != "error", d
                    if d.get("type") == "session.updated":
                        formats.append(d["session"]["audio"]["output"]["format"])
                elif ev.type == "audio":
                    audio.extend(ev.audio.data)
                elif ev.type == "agent_end":
                    return

        await asyncio.wait_for(until_answered(), 20)
    assert {"type": "audio/pcmu"} in formats and audio
    # the caller's μ-law was heard as speech: server VAD cut the turn and the thinker got ~1.6 s of it
    assert 37 <= h.processor("thinker").seen[0]["audio_rows"] <= 42
