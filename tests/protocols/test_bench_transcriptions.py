"""`latency_bench transcriptions` against the in-process server (fakes): its closed
loop counts what the API answered, and a refused request is counted, not dropped."""

from __future__ import annotations

from latency_bench.transcriptions import run_level, utterance
from testkit import serve


async def test_a_level_counts_requests_and_failures():
    wav, what = utterance()
    async with serve(["asr"]) as h:
        base = h.url().rstrip("/")
        lvl = await run_level(base, None, 2, 0.5, wav)
        assert lvl["requests"] >= 2 and lvl["failed"] == 0, lvl
        assert lvl["requests_per_s"] > 0 and lvl["latency_s"]["p50"] > 0
        bad = await run_level(base, None, 1, 0.2, b"not audio")
        assert bad["requests"] == 0 and bad["failed"] >= 1 and bad["errors"][0].startswith("400")
    assert what
