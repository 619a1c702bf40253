"""`/v1/telephony/twilio` in process (testkit: the real app over fake engines,
EnergyVad), driven by a peer that speaks Twilio Media Streams as Twilio documents it
(`clients.twilio`): μ-law both ways, marks as what the caller heard, barge-in → clear,
DTMF, stop, and bad input."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from clients.twilio import TwilioStream
from protocols.realtime import Conversation
from testkit import serve
from testkit.wire import from_g711, g711, quiet, tone

PATH = "/v1/telephony/twilio"


async def call(h, params=None, play_speed: float = 8.0, dialect: str = "twilio", **kw) -> TwilioStream:
    t = TwilioStream(await h.client.ws_connect(f"/v1/telephony/{dialect}"), play_speed=play_speed, dialect=dialect)
    await t.start(params, **kw)
    return t


def conversation(h) -> Conversation:
    convs = [c for s in h.sessions.sessions() if (c := s.kept(Conversation)) is not None]
    assert len(convs) == 1, convs
    return convs[0]


async def test_a_call_hears_the_caller_and_speaks_mulaw_with_marks():
    async with serve(["voice"]) as h:
        t = await call(h, {"voice": "alloy", "max_output_tokens": "6"})
        await t.say(g711(quiet(0.4) + tone(0.8) + quiet(0.8)))
        await t.wait_for(lambda: t.played_marks and not any(k == "media" for k, _ in t._queue) and len(t.audio) > 800)
        await asyncio.sleep(0.3)
        media = [m for m in t.received if m["event"] == "media"]
        marks = [m["mark"]["name"] for m in t.received if m["event"] == "mark"]
        assert media and marks and set(m["streamSid"] for m in t.received) == {t.stream_sid}
        # every media message is plain base64 μ-law (no header); marks follow the audio they end
        heard = from_g711(bytes(t.audio))
        assert len(heard) == len(t.audio) and np.abs(heard).max() > 0
        assert t.received[-1]["event"] == "mark" and not t.errors
        rid, _, ms = marks[-1].rpartition(":")
        assert rid.startswith("resp_") and int(ms) == len(t.audio) * 1000 // 8000
        # the conversation heard the caller's speech and knows the call
        conv = conversation(h)
        assert conv.session.params["call_sid"] == t.call_sid and conv.cfg.voice == "alloy"
        assert h.processor("thinker").seen[0]["audio_rows"] >= 25
        # stop ends the call: the session closes and so does the socket
        await t.stop()
        await t.wait_for(lambda: t.closed is not None)
        assert t.closed[0] == 1000 and not h.sessions.sessions()
        await t.close()


async def test_barge_in_sends_clear_and_history_keeps_only_what_played():
    async with serve(["voice"]) as h:
        t = await call(h, {"max_output_tokens": "400"}, play_speed=1.0)  # the caller hears in real time
        await t.say(g711(quiet(0.2) + tone(0.6) + quiet(0.7)))
        await t.wait_for(lambda: len(t.played_marks) >= 3, timeout=20)
        conv = conversation(h)
        # the caller talks over the agent: the server clears Twilio's buffer
        await t.say(g711(tone(0.6)), real_time=True)
        await t.wait_for(lambda: t.clears >= 1)
        await asyncio.sleep(0.3)  # the marks of the dropped audio come back meanwhile
        assert t.cleared_marks, "the clear dropped audio whose marks Twilio sent back"
        answer = next(i for i in conv.items.values() if i.role == "assistant")
        rid = t.played_at_clear[-1].rpartition(":")[0]
        played = max(int(n.rpartition(":")[2]) for n in t.played_at_clear if n.startswith(rid + ":"))
        assert answer.audio_ms > played and answer.transcript
        # history keeps the answer up to the last mark played before the clear; the marks
        # sent back for the cleared audio do not count as heard
        kept = answer.content[0]["transcript"]
        assert 0 < len(kept) <= round(len(answer.transcript) * played / answer.audio_ms) < len(answer.transcript)
        await t.close()


async def test_dtmf_reaches_the_conversation_and_the_call_goes_on_past_bad_frames():
    async with serve(["voice"]) as h:
        t = await call(h, {"dtmf": "message", "max_output_tokens": "4"})
        await t.ws.send_str("this is not json")
        await t.ws.send_str(json.dumps({"event": "media", "streamSid": t.stream_sid, "media": {"payload": "%%%not base64"}}))
        await t.ws.send_str(json.dumps({"event": "something_new", "streamSid": t.stream_sid}))
        await t.dtmf("5")
        await t.say(g711(quiet(0.4) + tone(0.8) + quiet(0.8)))
        await t.wait_for(lambda: t.played_marks)
        prompt = h.processor("thinker").seen[0]["messages"]
        assert any("DTMF 5" in str(m.get("content")) for m in prompt), prompt
        assert t.closed is None
        await t.close()


async def test_a_stream_that_breaks_the_protocol_is_closed_before_a_session_opens():
    async with serve(["voice"]) as h:
        ws = await h.client.ws_connect(PATH)
        await ws.send_str(json.dumps({"event": "media", "media": {"payload": ""}}))
        msg = await ws.receive(timeout=5)
        assert ws.close_code == 1008 and "before 'start'" in str(msg.extra)
        t = await call(h, media_format={"encoding": "audio/x-l16", "sampleRate": 16000, "channels": 1})
        await t.wait_for(lambda: t.closed is not None)
        assert t.closed[0] == 1008 and "mediaFormat" in t.closed[1]
        await t.close()
        t = await call(h, {"model": "no-such-model"})
        await t.wait_for(lambda: t.closed is not None)
        assert "no-such-model" in t.closed[1]
        await t.close()
        assert not h.sessions.sessions()


@pytest.mark.parametrize("dialect", ["twilio", "telnyx"])
async def test_with_api_keys_the_call_authenticates_in_its_parameters(dialect):
    overlay = {"server": {"api_keys": [{"key": "sk-phone", "principal": "phones"}]}}
    async with serve(["voice"], overlay) as h:
        for params in ({}, {"authorization": "Bearer sk-wrong-key"}):
            refused = await call(h, params, dialect=dialect)
            await refused.wait_for(lambda r=refused: r.closed is not None)
            assert refused.closed[0] == 1008 and "authorization" in refused.closed[1]
            await refused.close()
        assert not h.sessions.sessions()
        t = await call(h, {"api_key": "sk-phone", "max_output_tokens": "4"}, dialect=dialect)
        await t.say(g711(quiet(0.4) + tone(0.8) + quiet(0.8)))
        await t.wait_for(lambda: t.played_marks)
        assert conversation(h).session.principal == "phones"
        await t.close()


async def test_the_telephony_bench_measures_reply_and_barge_in_on_concurrent_calls():
    """`latency_bench telephony`'s level against the in-process server: every call
    completes with both figures measured (what they are on a real server is the bench's
    business; here they must exist and be plausible)."""
    from latency_bench.telephony import _level, _ulaw

    async with serve(["voice"]) as h:
        url = str(h.client.make_url("/v1/telephony/twilio")).replace("http://", "ws://")
        level = await _level(url, None, 2, _ulaw(tone(0.8)), 400, 20.0)
        assert level["completed"] == 2, level
        reply, barge = level["reply_s"], level["barge_in_to_clear_s"]
        assert reply["n"] == 2 and 0 < reply["p50"] < 5  # (server VAD waits out its silence first)
        assert barge["n"] == 2 and 0 < barge["p50"] < 2


async def test_a_drain_waits_for_a_call_to_end_rather_than_cutting_it():
    async with serve(["voice"]) as h:
        t = await call(h)
        await t.wait_for(lambda: bool(h.sessions.sessions()))
        drain = asyncio.get_running_loop().create_task(h.sessions.drain(10.0))
        await asyncio.sleep(0.5)
        assert not drain.done() and t.closed is None  # the call goes on while the node drains
        await t.stop()
        report = await asyncio.wait_for(drain, 5)
        assert [e["session_id"] for e in report["ended"]] and not report.get("failed"), report
        await t.close()


def test_marks_dropped_by_a_clear_do_not_count_for_the_next_answer():
    """Twilio sends back the marks a clear dropped, possibly after the next answer's
    marks went out: they neither count as heard nor stand for the next answer's audio."""
    from omni_rt.payloads import Fence
    from protocols.realtime import Item, Response
    from protocols.telephony.twilio import CLEAR, MARK, MarkedOutput

    out: list[tuple[str, dict]] = []
    output = MarkedOutput(lambda *a, **k: None, lambda type, data, fence=None: out.append((type, data)))
    fence = Fence("s")
    a, b = Response("resp_a", Item("item_a", "assistant", []), True), Response("resp_b", Item("item_b", "assistant", []), True)
    for _ in range(6):
        output.push(a, fence, tone(0.2))
    sent_a = [d["name"] for t_, d in out if t_ == MARK]
    assert sent_a
    output.echoed(sent_a[0])  # the first piece played
    heard = int(sent_a[0].rpartition(":")[2])
    cut = output.clear()
    assert cut == {"item_a": heard} and out[-1][0] == CLEAR
    for _ in range(6):
        output.push(b, fence, tone(0.2))
    for name in sent_a[1:]:  # the dropped marks come back late
        output.echoed(name)
    assert output.answers["resp_a"].heard_ms == heard
    assert output.outstanding and all(n.startswith("resp_b:") for n in output.outstanding)
    output.clear()
    assert out[-1][0] == CLEAR  # the next barge-in still clears what plays


async def test_a_sideband_cannot_change_the_phone_legs_format():
    async with serve(["voice"]) as h:
        t = await call(h, {"max_output_tokens": "4"})
        await t.wait_for(lambda: bool(h.sessions.sessions()))
        call_id = h.sessions.sessions()[0].id
        async with h.client.ws_connect(f"/v1/realtime?call_id={call_id}") as ws:
            from testkit.wire import Events

            side = Events(ws)
            await side.until("session.created")
            await side.send("session.update", session={"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}}})
            s = (await side.until("session.updated"))["session"]
            assert s["audio"]["input"]["format"] == {"type": "audio/pcmu"}
            await t.say(g711(quiet(0.4) + tone(0.8) + quiet(0.8)))
            await t.wait_for(lambda: t.played_marks)
            assert h.processor("thinker").seen[0]["audio_rows"] >= 25  # the caller was still heard as μ-law
        await t.close()


async def test_a_telnyx_stream_in_alaw_is_the_same_call():
    """Telnyx's spelling of the protocol (stream_id, custom_parameters, media_format
    PCMA): the caller heard in A-law, the answer in A-law with marks, barge-in clears."""
    async with serve(["voice"]) as h:
        t = TwilioStream(await h.client.ws_connect("/v1/telephony/telnyx"), play_speed=1.0, dialect="telnyx", law="alaw")
        await t.start({"max_output_tokens": "400"})
        await t.say(g711(quiet(0.2) + tone(0.6) + quiet(0.7), "alaw"))
        await t.wait_for(lambda: len(t.played_marks) >= 2, timeout=20)
        conv = conversation(h)
        assert conv.cfg.input_format.encoding == "pcma" and conv.session.params["provider"] == "telnyx"
        assert conv.session.params["call_sid"] == t.call_sid and not t.errors
        heard = from_g711(bytes(t.audio), "alaw")
        assert np.abs(heard).max() > 0
        await t.say(g711(tone(0.6), "alaw"), real_time=True)
        await t.wait_for(lambda: t.clears >= 1)
        await t.stop()
        await t.wait_for(lambda: t.closed is not None)
        await t.close()
        # a Twilio media format on the Telnyx path is refused, naming what is served
        bad = TwilioStream(await h.client.ws_connect("/v1/telephony/telnyx"), dialect="telnyx")
        await bad.start(media_format={"encoding": "G722", "sample_rate": 16000, "channels": 1})
        await bad.wait_for(lambda: bad.closed is not None)
        assert bad.closed[0] == 1008 and "PCMU or PCMA" in bad.closed[1]
        await bad.close()


async def test_a_call_past_the_session_caps_is_closed_with_1013_and_the_first_goes_on():
    async with serve(["voice"], {"sessions": {"max_per_kind": {"realtime": 1}}}) as h:
        first = await call(h, {"max_output_tokens": "4"})
        await first.wait_for(lambda: bool(h.sessions.sessions()))
        second = await call(h)
        await second.wait_for(lambda: second.closed is not None)
        assert second.closed[0] == 1013, second.closed
        await second.close()
        await first.say(g711(quiet(0.4) + tone(0.8) + quiet(0.8)))
        await first.wait_for(lambda: first.played_marks)
        assert first.closed is None and len(h.sessions.sessions()) == 1
        await first.close()
