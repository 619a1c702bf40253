"""Orchestrator semantics with fake engines: routing, completion, abort, tombstones, skip."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from omni_rt.orchestrator import DoneEvent, OrchestratorError, OutputEvent
from omni_rt.payloads import Fence, Payload, PayloadKind
from omni_rt.request import RequestAborted
from omni_rt.specs import ProfileSpec
from omni_rt.stage import StageError
from testkit.harness import Double, EmitN, Fail, make_orchestrator, profile


def two_stage(mode: str = "chunk", finals: list[str] | None = None):
    return profile(
        [("a", "EmitN"), ("b", "Double")],
        [{"src": "a", "dst": "b", "mode": mode}],
        finals or ["b"],
    )


def text_input(fence: Fence, n: int) -> Payload:
    return Payload(PayloadKind.TEXT, fence, text="x", meta={"n": n})


async def collect(stream) -> tuple[list[tuple[str, np.ndarray]], DoneEvent]:
    out = []
    async for stage, payload, _ in stream.payloads():
        out.append((stage, payload.arrays["t"].copy()))
    assert stream.done is not None
    return out, stream.done


async def test_chunk_edge_routes_every_chunk_and_completes():
    orch, engines, conn = make_orchestrator(two_stage("chunk"), {"a": EmitN, "b": Double})
    fence = Fence("s1")
    stream = orch.submit("p", fence=fence)
    assert stream.send_input(text_input(fence, 5))
    stream.end_input()
    out, done = await collect(stream)
    await stream.close()
    assert done.status == "completed"
    assert [s for s, _ in out] == ["b"] * 5  # only the final stage reaches the client
    # b doubled exactly what a's fake engine produced for seed 5
    expected = np.random.default_rng(5).choice(np.arange(1000), size=5)
    assert np.concatenate([t for _, t in out]).tolist() == (expected * 2).tolist()
    assert conn.inner.live_keys() == 0


async def test_output_to_client_and_next_stage_both():
    orch, _, conn = make_orchestrator(two_stage("chunk", finals=["a", "b"]), {"a": EmitN, "b": Double})
    fence = Fence("s1")
    stream = orch.submit("p", fence=fence)
    stream.send_input(text_input(fence, 4))
    stream.end_input()
    out, done = await collect(stream)
    await stream.close()
    a = np.concatenate([t for s, t in out if s == "a"])
    b = np.concatenate([t for s, t in out if s == "b"])
    assert len(a) == 4 and b.tolist() == (a * 2).tolist()
    assert done.status == "completed"
    # a's chunks had two readers (client + b) and were freed after both read them
    assert conn.inner.live_keys() == 0


async def test_completion_waits_for_every_final_stage():
    Double.delay = 0.02
    try:
        orch, _, _ = make_orchestrator(two_stage("chunk", finals=["a", "b"]), {"a": EmitN, "b": Double})
        fence = Fence("s1")
        stream = orch.submit("p", fence=fence)
        stream.send_input(text_input(fence, 3))
        stream.end_input()
        events = [ev async for ev in stream.events()]
        await stream.close()
    finally:
        Double.delay = 0.0
    assert isinstance(events[-1], DoneEvent) and events[-1].status == "completed"
    outputs = [ev for ev in events if isinstance(ev, OutputEvent)]
    # a finished long before b; the request still completed only after b's last chunk
    assert [ev.stage for ev in outputs].count("b") == 3
    assert outputs[-1].stage == "b"


async def test_batch_edge_starts_destination_after_source_finished():
    Double.started_after = []
    orch, _, _ = make_orchestrator(two_stage("batch"), {"a": EmitN, "b": Double}, step_ms=1)
    fence = Fence("s1")
    stream = orch.submit("p", fence=fence)
    stream.send_input(text_input(fence, 4))
    stream.end_input()
    out, done = await collect(stream)
    await stream.close()
    assert done.status == "completed" and len(out) == 4
    assert Double.started_after == [{"a"}]


async def test_chunk_edge_starts_destination_at_admission():
    Double.started_after = []
    orch, _, _ = make_orchestrator(two_stage("chunk"), {"a": EmitN, "b": Double}, step_ms=1)
    fence = Fence("s1")
    stream = orch.submit("p", fence=fence)
    await asyncio.sleep(0)
    assert Double.started_after == [set()]  # placeholder running before a produced anything
    stream.send_input(text_input(fence, 2))
    stream.end_input()
    await collect(stream)
    await stream.close()


async def test_abort_reaches_every_stage_and_cleans_connector_keys():
    orch, engines, conn = make_orchestrator(two_stage("chunk", finals=["a", "b"]), {"a": EmitN, "b": Double}, step_ms=5)
    fence = Fence("s1")
    stream = orch.submit("p", fence=fence)
    stream.send_input(text_input(fence, 1000))
    stream.end_input()
    seen = 0
    async for ev in stream.events():
        if isinstance(ev, OutputEvent):
            seen += 1
            if seen == 3:
                break
    assert engines["a"].load() == 1
    await stream.abort("test")
    assert engines["a"].load() == 0
    assert engines["a"].aborted == [f"{stream.request_id}:a"]
    assert all(t.done() for t in stream._state.tasks.values())
    assert conn.inner.live_keys() == 0  # unread chunks were freed by cleanup
    with pytest.raises(RequestAborted):
        async for _ in stream.payloads():
            pass
    await stream.close()
    assert orch.running() == []


async def test_tombstones_drop_late_and_unknown_inputs():
    orch, engines, conn = make_orchestrator(two_stage("chunk"), {"a": EmitN, "b": Double}, step_ms=5)
    fence = Fence("s1")
    stream = orch.submit("p", fence=fence)
    stream.send_input(text_input(fence, 1000))
    await stream.abort("cancelled")
    # a late chunk for the cancelled id is dropped, not revived, and leaves nothing behind
    assert stream.send_input(text_input(fence, 3)) is False
    assert orch.is_tombstoned(stream.request_id)
    assert conn.inner.live_keys() == 0
    with pytest.raises(OrchestratorError):
        orch.submit("p", fence=fence, request_id=stream.request_id)
    # updates for an id that never existed are dropped too
    from omni_rt.payloads import Handle

    assert orch.push_input("no-such-request", Handle("inproc", "no-such-request", "k", PayloadKind.TEXT, fence, 0)) is False
    assert orch.stats["dropped_inputs"] == 2
    await stream.close()


async def test_streaming_input_updates_resumable_entry_request():
    orch, engines, _ = make_orchestrator(two_stage("chunk"), {"a": EmitN, "b": Double})
    fence = Fence("s1")
    stream = orch.submit("p", fence=fence)
    got = []

    async def reader():
        async for _stage, p, _ in stream.payloads():
            got.append(len(p.arrays["t"]))

    task = asyncio.create_task(reader())
    for n in (2, 3):
        assert stream.send_input(text_input(fence, n))
        await asyncio.sleep(0.01)
    # outputs for the first inputs flowed before end-of-input
    assert sum(got) == 5
    stream.end_input()
    await task
    await stream.close()
    assert stream.done.status == "completed"


async def test_text_only_skip_hook_never_starts_skipped_stages():
    Double.started_after = []
    orch, engines, _ = make_orchestrator(two_stage("chunk", finals=["a", "b"]), {"a": EmitN, "b": Double})
    fence = Fence("s1")
    stream = orch.submit("p", fence=fence, outputs={"a"})
    stream.send_input(text_input(fence, 3))
    stream.end_input()
    out, done = await collect(stream)
    await stream.close()
    assert done.status == "completed"
    assert {s for s, _ in out} == {"a"}
    assert Double.started_after == []
    with pytest.raises(OrchestratorError):
        orch.submit("p", fence=fence, outputs={"nope"})


async def test_request_may_enter_at_a_later_stage():
    Double.started_after = []
    orch, _, conn = make_orchestrator(two_stage("chunk", finals=["a", "b"]), {"a": EmitN, "b": Double})
    fence = Fence("s1")
    stream = orch.submit("p", fence=fence, outputs={"b"}, entry="b")
    # the client's input goes to b itself; a never starts
    assert stream.send_input(Payload(PayloadKind.TOKENS, fence, arrays={"t": np.array([1, 2, 3])}))
    stream.end_input()
    out, done = await collect(stream)
    assert set(stream._state.tasks) == {"b"}
    await stream.close()
    assert done.status == "completed"
    assert [(s, t.tolist()) for s, t in out] == [("b", [2, 4, 6])]
    assert Double.started_after == [set()]
    assert conn.inner.live_keys() == 0
    # an output the entry cannot reach, or an entry that is no stage, is refused
    with pytest.raises(OrchestratorError, match="cannot be reached from entry 'b'"):
        orch.submit("p", fence=fence, outputs={"a"}, entry="b")
    with pytest.raises(OrchestratorError, match="not a stage"):
        orch.submit("p", fence=fence, entry="zz")
    assert orch.running() == []


async def test_entry_is_refused_when_a_later_stage_needs_a_skipped_one():
    """a -> b -> c and a -> c: entering at b would start c without a's input."""
    prof = profile(
        [("a", "EmitN"), ("b", "Double"), ("c", "Double")],
        [{"src": "a", "dst": "b"}, {"src": "b", "dst": "c"}, {"src": "a", "dst": "c", "mode": "batch"}],
        ["b", "c"],
    )
    orch, _, _ = make_orchestrator(prof, {"a": EmitN, "b": Double, "c": Double})
    with pytest.raises(OrchestratorError, match="'c' takes input from 'a'"):
        orch.submit("p", fence=Fence("s1"), outputs={"c"}, entry="b")
    stream = orch.submit("p", fence=Fence("s1"), outputs={"b"}, entry="b")  # c is not needed: fine
    await stream.close()
    assert orch.running() == []


def dropped(hop: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("omni_rt_dropped_stale_total", {"hop": hop}) or 0.0


async def test_stale_fence_outputs_never_reach_the_client():
    engine_before = dropped("engine")
    current = {"fence": Fence("s1", epoch=0)}
    orch, _, _ = make_orchestrator(two_stage("chunk"), {"a": EmitN, "b": Double}, step_ms=2)
    fence = Fence("s1", epoch=0)
    stream = orch.submit("p", fence=fence, fence_source=lambda: current["fence"])
    stream.send_input(text_input(fence, 50))
    stream.end_input()
    n = 0
    async for ev in stream.events():
        if isinstance(ev, OutputEvent):
            assert ev.handle.fence.epoch == 0
            n += 1
            if n == 2:
                current["fence"] = Fence("s1", epoch=1)  # barge-in
        else:
            break
    # the request completes, but nothing after the epoch advance was delivered:
    # stage a's later outputs are dropped where they leave the engine, before any
    # connector put or routing
    assert n <= 3
    assert dropped("engine") > engine_before
    await stream.close()


async def test_stage_failure_fails_request_and_cancels_others():
    orch, engines, conn = make_orchestrator(two_stage("chunk", finals=["a", "b"]), {"a": EmitN, "b": Fail}, step_ms=2)
    fence = Fence("s1")
    stream = orch.submit("p", fence=fence)
    stream.send_input(text_input(fence, 500))
    stream.end_input()
    with pytest.raises(StageError, match="boom in stage"):
        async for _ in stream.payloads():
            pass
    await stream.close()
    await asyncio.sleep(0.01)
    assert engines["a"].load() == 0
    assert conn.inner.live_keys() == 0


async def test_orchestrator_never_touches_payload_bytes():
    orch, _, conn = make_orchestrator(two_stage("chunk", finals=["a", "b"]), {"a": EmitN, "b": Double})
    fence = Fence("s1")
    stream = orch.submit("p", fence=fence)
    stream.send_input(text_input(fence, 6))
    stream.end_input()
    await collect(stream)
    await stream.close()
    callers = {mod for _, mod in conn.callers}
    assert conn.bytes_moved > 0 and len(conn.callers) > 0
    assert "omni_rt.orchestrator" not in callers
    # bytes moved only by stage workers and the client side
    assert callers <= {"omni_rt.stage", "omni_rt.request"}
    puts = sum(1 for op, _ in conn.callers if op == "put")
    gets = sum(1 for op, _ in conn.callers if op == "get")
    assert puts == 1 + 6 + 6  # input + a's chunks + b's chunks
    assert gets == 1 + 6 * 2 + 6  # input + a's chunks read by client and b + b's chunks


async def test_replica_affinity_is_sticky_and_least_queue_spreads():
    from omni_rt.engines.fake import FakeArEngine
    from omni_rt.stage_pool import Replica, StagePool

    spec = two_stage().stage("a")
    engines = [FakeArEngine(name=f"r{i}") for i in range(3)]
    pool = StagePool(spec, [Replica(i, e, {}, EmitN(spec, e, {})) for i, e in enumerate(engines)])
    first = pool.pick("session-1")
    assert all(pool.pick("session-1") is first for _ in range(5))
    engines[0].running.update({"x", "y"})
    engines[1].running.add("z")
    assert pool.pick().index == 2  # least loaded
    rr = StagePool(spec.model_copy(update={"routing": "round_robin"}), pool.replicas)
    assert [rr.pick().index for _ in range(6)] == [0, 1, 2, 0, 1, 2]


async def test_client_hop_drops_chunks_that_went_stale_after_routing():
    current = {"fence": Fence("s1", epoch=0)}
    orch, _, conn = make_orchestrator(two_stage("chunk"), {"a": EmitN, "b": Double})
    fence = Fence("s1", epoch=0)
    stream = orch.submit("p", fence=fence, fence_source=lambda: current["fence"])
    stream.send_input(text_input(fence, 5))
    stream.end_input()
    await stream._state.finished.wait()  # everything routed to the client queue
    current["fence"] = Fence("s1", epoch=1)  # barge-in before the client read anything
    got = [p async for p in stream.payloads()]
    assert got == [] and stream.dropped_stale == 5
    assert stream.done.status == "completed"
    await stream.close()
    assert conn.inner.live_keys() == 0


def diamond(mode: str) -> ProfileSpec:
    """a feeds b and c; d takes both of them through `mode` edges."""
    return profile(
        [("a", "EmitN"), ("b", "Double"), ("c", "Double"), ("d", "Merge")],
        [{"src": "a", "dst": "b"}, {"src": "a", "dst": "c"}, {"src": "b", "dst": "d", "mode": mode}, {"src": "c", "dst": "d", "mode": mode}],
        ["d"],
    )


async def test_a_stage_with_two_batch_inputs_starts_when_both_have_finished():
    from testkit.harness import Merge

    Double.delay = 0.0
    orch, _, conn = make_orchestrator(diamond("batch"), {"a": EmitN, "b": Double, "c": Double, "d": Merge}, step_ms=1)
    fence = Fence("s1")
    stream = orch.submit("p", fence=fence)
    stream.send_input(text_input(fence, 3))
    stream.end_input()
    out, done = await asyncio.wait_for(collect(stream), 2)
    await stream.close()
    assert done.status == "completed"
    merged = out[0][1]
    expected = np.random.default_rng(3).choice(np.arange(1000), size=3) * 2
    assert merged.tolist() == expected.tolist() * 2  # b's three tokens, then c's
    assert conn.inner.live_keys() == 0


async def test_a_failure_while_routing_a_finished_stage_fails_the_request(monkeypatch):
    """An exception in the stage-done callback must not leave the request running."""
    orch, _, _ = make_orchestrator(two_stage("batch"), {"a": EmitN, "b": Double})
    fence = Fence("s1")
    stream = orch.submit("p", fence=fence)

    def broken(*args, **kw):
        raise KeyError("no such input")

    monkeypatch.setattr(orch, "_start_stage", broken)  # the batch destination cannot start
    stream.send_input(text_input(fence, 2))
    stream.end_input()
    with pytest.raises(Exception) as exc:
        await asyncio.wait_for(collect(stream), 2)
    assert not isinstance(exc.value, asyncio.TimeoutError)
    assert stream.done is not None and stream.done.status == "failed"
    assert orch.running() == []
    await stream.close()
