"""Every wire fuzzed in-process (latency_bench.fuzz over the harness's fake engines):
≥ 1000 mutated messages per protocol (wrong types, 5000-digit integers, NaN / Infinity,
lone surrogates, 1000-level nesting, invalid JSON and UTF-8, binary where text is
expected, unknown events, duplicate keys, byte flips), each outcome classified:

- HTTP: no 5xx; every 4xx in OpenAI's `{"error": {...}}` shape; no cut bodies;
- JSON WebSockets: every mutated message is followed by a probe that must get its
  `error` event (the socket never closes where the protocol promises an error event,
  and no `internal_error` events);
- OpenPI: bad frames get openpi's text frame then close 1011/1013, never a bare close
  or a generic internal error;
- no session outlives its clients (past the disconnect grace).

The run prints what failed: the mutation, the payload (truncated), what the server did
and the exception it logged."""

from __future__ import annotations

import time

import pytest

from latency_bench.fuzz import ALL, failure_report, run_fuzz, summary_lines
from testkit import Speeds, serve

# 11,000 messages through the whole in-process server (some 15 s): the integration
# tier's; each defect it found is pinned by tests/protocols/test_hardening.py.
pytestmark = pytest.mark.integration

PER_PROTOCOL = 1000
SEED = 20240601
PIPELINES = ["voice", "tts", "image", "world", "video", "video_edit", "robot"]


@pytest.fixture(scope="module")
def fuzz_result():
    import asyncio

    async def run():
        async with serve(PIPELINES, speeds=Speeds(token_s=0.0)) as h:
            return await run_fuzz(h.url(""), per_protocol=PER_PROTOCOL, seed=SEED, harness=h, timeout=10.0,
                                  leak_wait_s=2.0, grace_s=float(h.sessions.spec.disconnect_grace_s))

    t0 = time.perf_counter()
    result = asyncio.run(run())
    print(f"\nfuzz run: {time.perf_counter() - t0:.1f}s")
    for line in summary_lines(result):
        print(line)
    report = failure_report(result)
    if report:
        print("\nfailures (first examples per cause):\n" + report)
    return result


def test_every_wire_gets_at_least_1000_mutated_messages(fuzz_result):
    sent = {name: p["sent"] for name, p in fuzz_result["protocols"].items()}
    assert set(sent) == set(ALL), f"protocols not fuzzed: {set(ALL) - set(sent)}"
    assert all(n >= PER_PROTOCOL for n in sent.values()), sent
    # the unmutated seeds reach the server's handlers (the fuzzer is not stuck at a 400)
    for name, p in fuzz_result["protocols"].items():
        assert p["seeds"], name
        accepted = [s for s in p["seeds"] if s.endswith(("-> 200", "-> 201", "-> accepted", "-> reply"))]
        assert accepted, f"{name}: no seed was accepted: {p['seeds']}"


@pytest.mark.parametrize("kind", ["http_5xx", "bad_error_shape", "cut_stream", "timeout", "no_response"])
def test_http_no_failures(fuzz_result, kind):
    got = {name: p["failures"][kind] for name, p in fuzz_result["protocols"].items() if p["failures"].get(kind)}
    assert not got, f"{kind}: {got}\n{failure_report(fuzz_result)}"


@pytest.mark.parametrize("kind", ["ws_close", "server_error_event", "probe_timeout", "connect_failed"])
def test_json_websockets_no_failures(fuzz_result, kind):
    got = {name: p["failures"][kind] for name, p in fuzz_result["protocols"].items() if p["failures"].get(kind)}
    assert not got, f"{kind}: {got}\n{failure_report(fuzz_result)}"


@pytest.mark.parametrize("kind", ["ws_close_without_text", "server_fault", "bad_close_code", "bad_metadata"])
def test_openpi_no_failures(fuzz_result, kind):
    got = fuzz_result["protocols"]["openpi"]["failures"].get(kind, 0)
    assert got == 0, f"{kind}: {got}\n{failure_report(fuzz_result)}"


def test_no_failures_of_any_kind(fuzz_result):
    got = {name: p["failures"] for name, p in fuzz_result["protocols"].items() if p["failures"]}
    assert not got, f"{got}\n{failure_report(fuzz_result)}"


def test_no_leaked_sessions(fuzz_result):
    s = fuzz_result["sessions"]
    assert s["leaked_count"] == 0, f"leaked: {s['leaked_by_kind']}: {s['leaked']}"
