"""`latency_bench openpi` against the in-process server (fakes): a level counts every
call and what the replies report; the targets come out of the levels of one run."""

from __future__ import annotations

import pytest

from latency_bench.openpi import run_level, step_batching, targets
from omni_rt.testing import serve


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
