"""`latency_bench openpi` against the in-process server (fakes): a level counts every
call and what the replies report; the targets come out of the levels of one run."""

from __future__ import annotations

import asyncio

import pytest

from latency_bench.openpi import run_level, step_batching, targets
from testkit import serve


async def test_a_level_counts_calls_and_the_targets_follow_from_the_levels():
    async with serve(["robot"]) as h:
        url = h.url().replace("http://", "ws://")
        one = await run_level(url, None, 1, 0.3, 1)
        two = await run_level(url, None, 2, 0.3, 1)
    for lvl, r in ((one, 1), (two, 2)):
        assert lvl["robots"] == r and lvl["failed_robots"] == 0 and lvl["calls"] >= r, lvl
        assert lvl["policy_infer_ms"]["p50"] > 0 and lvl["actions_per_s"] > 0
        assert lvl["round_trip_ms"]["p50"] >= lvl["server_infer_ms"]["p50"] >= lvl["policy_infer_ms"]["p50"]
    base = {"ok": True, "round_trip_ms": {"p50": one["overhead_ms"]["p50"] * 2}}
    got = targets(base, [one, two])
    assert got["overhead_p50_vs_noop_round_trip"]["value"] == 0.5 and got["overhead_p50_vs_noop_round_trip"]["met"]
    sb = step_batching([one, two])
    assert sb is not None and step_batching([one]) is None
    assert sb["robots"] == 2 and sb["one_after_another_ms"] == round(2 * one["policy_infer_ms"]["p50"], 3)
    assert sb["saving"] == pytest.approx(2 * one["policy_infer_ms"]["p50"] / two["policy_infer_ms"]["p50"])
    assert "actions_per_s_16_over_1" not in got  # no 16-robot level in this run


def test_the_delay_matched_floor_is_a_target_of_its_own():
    lvl = {"robots": 1, "overhead_ms": {"p50": 0.9}, "outside_policy_ms": {"p50": 1.2}, "actions_per_s": 10.0}
    base = {"ok": True, "round_trip_ms": {"p50": 0.4}}
    matched = {"ok": True, "overhead_ms": {"p50": 1.0}, "wait_ms": {"p50": 17.0}}
    got = targets(base, [lvl], matched)
    assert not got["overhead_p50_vs_noop_round_trip"]["met"]  # 0.9 / 0.4: still reported as is
    m = got["overhead_p50_vs_delay_matched_noop_overhead"]
    assert m["value"] == pytest.approx(0.9) and m["met"] and m["noop_wait_ms"] == 17.0
    assert not targets(base, [lvl], {**matched, "overhead_ms": {"p50": 0.5}})["overhead_p50_vs_delay_matched_noop_overhead"]["met"]
    assert "overhead_p50_vs_delay_matched_noop_overhead" not in targets(base, [lvl])


async def test_the_noop_server_holds_its_replies_for_the_asked_delay(unused_tcp_port):
    import multiprocessing

    from latency_bench.openpi import _wait_port, noop_baseline, serve_noop

    proc = multiprocessing.get_context("spawn").Process(target=serve_noop, args=(unused_tcp_port,), daemon=True)
    proc.start()
    try:
        await asyncio.to_thread(_wait_port, unused_tcp_port)
        url = f"ws://127.0.0.1:{unused_tcp_port}"
        instant = await noop_baseline(url, 0.2, 1)
        held = await noop_baseline(f"{url}?delay_ms=25", 0.3, 1)
    finally:
        proc.terminate()
        proc.join(10)
    assert instant["ok"] and held["ok"], (instant, held)
    assert instant["wait_ms"]["p50"] < 5 <= 25 <= held["wait_ms"]["p50"] < 40
    assert held["round_trip_ms"]["min"] >= 25 and held["overhead_ms"]["p50"] == pytest.approx(
        held["round_trip_ms"]["p50"] - held["wait_ms"]["p50"], abs=5)
