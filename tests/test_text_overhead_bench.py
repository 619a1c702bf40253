"""latency_bench text-overhead: the A/B machinery, with fake sides (no engines)."""

from __future__ import annotations

import asyncio

import pytest

from latency_bench.text_overhead import NoText, chat_body, closed_loop, compare, first_content, loop_size, open_loop


def test_first_content_reads_sse_chunks():
    assert first_content(b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n')
    assert first_content('data: {"choices":[{"delta":{"content":"x"}}]}')
    assert not first_content(b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n')
    assert not first_content(b"data: [DONE]\n\n")
    assert not first_content('data: {"choices":[],"usage":{"total_tokens":3}}')


def test_chat_body_is_seeded_and_streams():
    b = chat_body(7, 16)
    assert b["seed"] == 7 and b["stream"] is True and b["max_tokens"] == 16 and b["min_tokens"] == 1


async def test_closed_loop_skips_the_opening_burst_and_counts_no_text_apart():
    n, skip = loop_size(4, 3)
    assert (n, skip) == (16, 4)
    seen: list[int] = []
    in_flight = peak = 0

    async def one(i: int) -> float:
        nonlocal in_flight, peak
        seen.append(i)
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.001)
        in_flight -= 1
        if i == 105:
            raise NoText
        if i == 110:
            raise RuntimeError("boom")
        return float(i)

    res = await closed_loop(4, n, one, first_id=100, skip=skip)
    assert sorted(seen) == list(range(100, 116)) and peak == 4
    # ids 100..103 are the first wave (not counted); 105 showed no text; 110 failed
    assert sorted(res["ttfts"]) == [float(i) for i in range(104, 116) if i not in (105, 110)]
    assert res["no_text"] == 1 and res["errors"] == ["RuntimeError: boom"]


async def test_compare_runs_both_sides_on_the_same_seeds_in_alternating_order():
    calls: list[tuple[str, int]] = []

    def side(name: str, ttft: float):
        async def one(i: int) -> float:
            calls.append((name, i))
            await asyncio.sleep(0)
            return ttft

        return one

    loops = 0

    async def between() -> None:
        nonlocal loops
        loops += 1

    rows = await compare({"a": side("a", 0.02), "b": side("b", 0.01)}, [1, 2], warmup=1, rounds=3, per_worker=2, between=between)
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        for part in (r, r["open_loop"]):
            assert part["ttft_p50_ratio"] == pytest.approx(2.0) and part["ttft_p50_ratio_per_round"] == [2.0, 2.0, 2.0]
            assert part["a"]["errors"] == [] and part["b"]["no_text"] == 0 and part["a"]["requests_per_s"] > 0
        # the open loops are offered half the slower side's closed-loop throughput (the default)
        assert r["open_loop"]["offered_per_s"] == pytest.approx(0.5 * min(r["a"]["requests_per_s"], r["b"]["requests_per_s"]), abs=0.01)
    assert loops == 2 * 2 * 3 * 2  # levels x (closed, open) x rounds x sides
    ids = {name: [i for n, i in calls if n == name] for name in "ab"}
    assert ids["a"] == ids["b"]  # same request ids (seeds) on both sides
    # level 1 after the warmup: loops of 3 requests; a first, then b first, then a first
    names = "".join(name for name, _ in calls[2:20])
    assert names == "aaabbb" "bbbaaa" "aaabbb"


async def test_open_loop_arrivals_do_not_wait_for_answers():
    started: list[float] = []

    async def one(i: int) -> float:
        started.append(asyncio.get_running_loop().time())
        await asyncio.sleep(0.05)  # slower than the arrivals
        return 0.05

    res = await open_loop(400.0, 20, one, first_id=0, seed=1)
    assert len(res["ttfts"]) == 20 and res["errors"] == []
    # 20 arrivals at 400/s take ~50 ms: they overlap instead of queueing behind each other
    assert started[-1] - started[0] < 0.5 and res["wall_s"] < 1.0
