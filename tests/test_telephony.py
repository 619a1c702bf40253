"""Phone calls on the real default server (tiny checkpoints, vLLM): a Twilio-faithful
peer (`clients.twilio`) holds a whole call — espeak-ng speech in μ-law, the agent's μ-law
answer out with marks, barge-in → clear, DTMF, hang-up through the Calls API."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from clients.twilio import TwilioStream
from latency_bench.realtime import utterance
from latency_bench.telephony import _call, _ulaw
from testkit.harness import ALICE_KEY

pytestmark = pytest.mark.integration

AUTH = {"authorization": f"Bearer {ALICE_KEY}"}


def speech() -> bytes:
    pcm, source = utterance(None, "Hello, I would like to book a table for two tomorrow evening.")
    assert source == "espeak-ng", "the telephony tests speak to the server's VAD: espeak-ng is required"
    return _ulaw(pcm)


async def test_a_phone_call_speaks_both_ways_and_the_caller_cuts_in(server):
    """One call as latency_bench telephony places it: the answer's first μ-law frame
    after the caller's speech, then the caller talks over it and the server clears."""
    url = f"ws://127.0.0.1:{server.port}/v1/telephony/twilio"
    result = await _call(url, ALICE_KEY, speech(), 64, 90.0)
    assert result["ok"], result
    assert 0 < result["reply_s"] < 30 and 0 < result["barge_in_s"] < 5, result


async def test_dtmf_and_hang_up_through_the_calls_api(server):
    base = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as http:
        async def mine() -> set[str]:
            async with http.get(f"{base}/v1/sessions", headers=AUTH) as r:
                return {s["id"] for s in (await r.json())["data"] if s["kind"] == "realtime"}

        before = await mine()
        t = TwilioStream(await http.ws_connect(f"ws://127.0.0.1:{server.port}/v1/telephony/twilio"), play_speed=4.0)
        await t.start({**AUTH, "dtmf": "message", "max_output_tokens": "8"})
        for _ in range(50):
            new = await mine() - before
            if new:
                break
            await asyncio.sleep(0.1)
        assert len(new) == 1
        call_id = new.pop()
        await t.dtmf("7")
        await t.say(speech(), real_time=True)
        await t.say(b"\xff" * 8000, real_time=True)  # a second of silence: server VAD ends the turn
        await t.wait_for(lambda: t.played_marks, timeout=60)
        assert not t.errors
        async with http.post(f"{base}/v1/realtime/calls/{call_id}/hangup", headers=AUTH) as r:
            assert r.status == 204
        await t.wait_for(lambda: t.closed is not None, timeout=10)
        assert call_id not in await mine()
        await t.close()
