"""`latency_bench duplex --ramp` against the in-process server (fakes): sessions offered
one after another, load-aware admission refusing past its (prior) capacity, every
refusal recorded with what the server said and every admitted session's stalls."""

from __future__ import annotations

from latency_bench.duplex import run_ramp
from testkit import serve
from testkit.wire import quiet, tone


async def test_a_ramp_records_admitted_and_refused_sessions_and_the_servers_rtf():
    overlay = {"sessions": {"realtime_admission": {"session_cost_rtf": 0.3}}}  # two fit under the default 0.65
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


async def test_a_level_counts_refused_sessions_apart_and_summarises_each_admitted_one():
    """`latency_bench duplex` at one level: a session over the cap is a refusal with
    what the server said (not a failure); each admitted session has its own summary;
    the server's own count of holes and its admission figures come with the level."""
    from latency_bench.duplex import run_level

    async with serve(["voice"], {"sessions": {"max_per_kind": {"duplex": 2}}}) as h:
        pcm = quiet(0.2) + tone(0.5)
        lvl = await run_level("ws", h.url().rstrip("/"), None, 3, 1, pcm, 6, None)
    assert lvl["admitted"] == 2 and lvl["refused"] == 1 and lvl["failed"] == 0 and not lvl["errors"], lvl
    assert lvl["refusals"][0]["code"] == "session_limit"
    assert [s["turns"] for s in lvl["per_session"]] == [1, 1]
    assert all(s["stalls_over_100ms"] == 0 and s["failed"] == 0 for s in lvl["per_session"])
    assert lvl["admitted_sessions_with_stalls_over_100ms"] == 0
    assert lvl["outside_load"]["polls"] >= 1 and isinstance(lvl["server_underruns"], dict)
    assert lvl["burner_processes"] == 0 and lvl["bench_loop_stalls"]["count"] >= 0


def test_the_servers_hole_count_is_read_by_cause_from_its_metrics():
    from latency_bench.machine import underruns_between

    def text(gen_count: int, gen_le: int, send_count: int) -> str:
        return "\n".join([
            f'omni_rt_playout_underrun_seconds_bucket{{api="duplex",cause="generation",le="0.1"}} {gen_le}.0',
            f'omni_rt_playout_underrun_seconds_count{{api="duplex",cause="generation"}} {gen_count}.0',
            f'omni_rt_playout_underrun_seconds_bucket{{api="duplex",cause="send",le="0.1"}} {send_count}.0',
            f'omni_rt_playout_underrun_seconds_count{{api="duplex",cause="send"}} {send_count}.0',
        ])

    got = underruns_between(text(3, 3, 1), text(7, 5, 2))
    assert got == {"generation": {"holes": 4.0, "over_100ms": 2.0}, "send": {"holes": 1.0, "over_100ms": 0.0}}


def test_a_burner_spins_a_core_until_stopped():
    import psutil

    from latency_bench.machine import Burner

    with Burner(1) as b:
        p = psutil.Process(b.procs[0].pid)
        p.cpu_percent(None)
        import time

        time.sleep(0.3)
        assert p.cpu_percent(None) > 50
    assert b.procs == [] and not p.is_running()
