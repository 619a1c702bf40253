"""Per-principal rate limits (`sessions.rate_limits`) in-process over fakes: one-shot
requests per minute (429 + retry-after) under a burst from two principals, shared by
two nodes through Redis, thinker tokens per minute on a voice session and on chat,
caller audio seconds per minute (the protocol's error, once per spell)."""

from __future__ import annotations

import asyncio
import secrets

import pytest

from testkit import serve
from testkit.wire import b64, connect, tone

ALICE, BOB = "k-alice-rate-0001", "k-bob-rate-00001"
KEYS = {"api_keys": [{"key": ALICE, "principal": "alice"}, {"key": BOB, "principal": "bob"}]}
SPEECH = {"model": "tts", "voice": "tara", "input": "Hi.", "response_format": "pcm"}


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def _speech(h, key: str) -> tuple[int, str | None, str | None]:
    r = await h.client.post("/v1/audio/speech", json=SPEECH, headers=auth(key))
    body = await r.read()
    code = None
    if r.status != 200:
        import json

        code = json.loads(body)["error"]["code"]
    return r.status, r.headers.get("retry-after"), code


async def test_a_burst_from_two_principals_each_held_to_its_own_rate():
    limits = {"default": {"requests_per_minute": 100}, "principals": {"alice": {"requests_per_minute": 3}}}
    async with serve(["tts"], {"server": KEYS, "sessions": {"rate_limits": limits}}) as h:
        results = await asyncio.gather(*(_speech(h, ALICE) for _ in range(6)), *(_speech(h, BOB) for _ in range(6)))
        alice, bob = results[:6], results[6:]
        assert sorted(s for s, _, _ in alice) == [200, 200, 200, 429, 429, 429], alice
        refused = [r for r in alice if r[0] == 429]
        assert all(code == "rate_limit_exceeded" and retry is not None and int(retry) >= 1 for _, retry, code in refused), refused
        assert all(s == 200 for s, _, _ in bob), bob  # bob's rate is his own
        decisions = [d for d in h.sessions.decisions if d.get("reason") == "rate_limit"]
        assert len(decisions) == 3 and all(d["principal"] == "alice" for d in decisions)


async def test_two_nodes_share_a_principals_rate_through_redis():
    prefix = f"omni-rt-test-{secrets.token_hex(4)}"
    sessions = {"store": "redis", "redis_url": "redis://127.0.0.1:6379/0", "redis_prefix": prefix, "reaper_interval_s": 5,
                "rate_limits": {"principals": {"alice": {"requests_per_minute": 4}}}}
    async with serve(["tts"], {"server": KEYS, "sessions": sessions}) as a, serve(["tts"], {"server": KEYS, "sessions": sessions}) as b:
        first = [await _speech(a, ALICE), await _speech(b, ALICE), await _speech(a, ALICE), await _speech(b, ALICE)]
        assert [s for s, _, _ in first] == [200, 200, 200, 200]
        for node in (a, b):  # the fifth is refused wherever it lands
            status, retry, code = await _speech(node, ALICE)
            assert status == 429 and code == "rate_limit_exceeded" and int(retry or 0) >= 1
        assert (await _speech(b, BOB))[0] == 200


async def test_thinker_tokens_per_minute_on_a_voice_session_and_on_chat():
    limits = {"principals": {"alice": {"tokens_per_minute": 20}}}
    async with serve(["voice"], {"server": KEYS, "sessions": {"rate_limits": limits}}) as h:
        ws = await connect(h, "/v1/realtime?model=gpt-realtime", headers=auth(ALICE))
        await ws.until("session.created")
        await ws.send("session.update", session={"type": "realtime", "output_modalities": ["text"], "audio": {"input": {"turn_detection": None}}})
        await ws.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello there"}]})
        await ws.send("response.create", response={"max_output_tokens": 30})  # spends past the minute's 20
        done = await ws.until("response.done")
        assert done["response"]["status"] == "completed" and done["response"]["usage"]["total_tokens"] > 20
        await asyncio.sleep(0.05)  # (the charge is written as the answer ends)
        await ws.send("response.create", response={"max_output_tokens": 2})
        err = (await ws.until("error"))["error"]
        assert err["code"] == "rate_limit_exceeded" and "20 tokens per minute" in err["message"], err
        await ws.ws.close()
        r = await h.client.post("/v1/chat/completions", headers=auth(ALICE),
                                json={"model": "gpt-realtime", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status == 429 and (await r.json())["error"]["code"] == "rate_limit_exceeded" and r.headers["retry-after"]
        r = await h.client.post("/v1/chat/completions", headers=auth(BOB),
                                json={"model": "gpt-realtime", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status == 200


@pytest.mark.parametrize("seconds_per_minute", [1])
async def test_caller_audio_seconds_per_minute_refused_once_per_spell(seconds_per_minute):
    limits = {"principals": {"alice": {"audio_seconds_per_minute": seconds_per_minute}}}
    async with serve(["voice"], {"server": KEYS, "sessions": {"rate_limits": limits}}) as h:
        ws = await connect(h, "/v1/realtime?model=gpt-realtime", headers=auth(ALICE))
        await ws.until("session.created")
        await ws.send("session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        await ws.until("session.updated")
        pcm = tone(0.1)
        for _ in range(15):  # 1.5 s against a minute's 1 s
            await ws.send("input_audio_buffer.append", audio=b64(pcm))
        err = (await ws.until("error"))["error"]
        assert err["code"] == "rate_limit_exceeded" and "Audio is not taken" in err["message"]
        await ws.send("input_audio_buffer.commit")
        committed = await ws.until("input_audio_buffer.committed", "error")
        assert committed["type"] == "input_audio_buffer.committed"  # what was taken (1 s) is committed
        assert sum(1 for e in ws.seen if e["type"] == "error" and e["error"]["code"] == "rate_limit_exceeded") == 1
        await ws.ws.close()
        bob = await connect(h, "/v1/realtime?model=gpt-realtime", headers=auth(BOB))
        await bob.until("session.created")
        for _ in range(15):
            await bob.send("input_audio_buffer.append", audio=b64(pcm))
        await bob.send("input_audio_buffer.commit")
        assert (await bob.until("input_audio_buffer.committed", "error"))["type"] == "input_audio_buffer.committed"
        await bob.ws.close()
