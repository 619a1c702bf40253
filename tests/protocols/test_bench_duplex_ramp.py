"""`latency_bench duplex --ramp` against the in-process server (fakes): sessions offered
one after another, load-aware admission refusing past its (prior) capacity, every
refusal recorded with what the server said and every admitted session's stalls."""

from __future__ import annotations

from latency_bench.duplex import run_ramp
from testkit import serve
from tests.protocols.helpers import quiet, tone


async def test_a_ramp_records_admitted_and_refused_sessions_and_the_servers_rtf():
    overlay = {"sessions": {"realtime_admission": {"session_cost_rtf": 0.4}}}  # two fit under 0.8
    async with serve(["voice"], overlay) as h:
        pcm = quiet(0.2) + tone(0.6)
        r = await run_ramp("ws", h.url().rstrip("/"), None, 4, 0.05, 1, pcm, 8)
    assert r["offered"] == 4 and r["errored"] == 0, r["sessions"]
    assert r["admitted"] == 2 and r["refused"] == 2
    for s in r["sessions"]:
        if s["admitted"]:
            assert s["turns"] == 1 and s["failed"] == 0 and s["stalls_over_100ms"] == 0
        else:
            assert s["refusal"]["code"] == "capacity" and "retry in 5 s" in s["refusal"]["message"]
    assert r["peak_open_voice_sessions"] == 2 and all(p["open"] <= 2 for p in r["health"])
