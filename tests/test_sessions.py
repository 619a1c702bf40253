"""SessionManager: states, caps, leases, eviction, fences, owned state — memory and Redis."""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import pytest

from omni_rt.errors import RequestAborted
from omni_rt.payloads import Fence, Payload, PayloadKind
from omni_rt.specs import SessionsSpec
from sessions import (
    IllegalTransition,
    InvalidResumeToken,
    MemoryStore,
    SessionElsewhere,
    SessionGone,
    SessionLimit,
    SessionManager,
    SessionNotFound,
    SessionState,
    StaleFence,
    StoreUnavailable,
)
from sessions.redis_store import RedisStore
from testkit.harness import LateEmitter, make_orchestrator, profile

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
async def redis_prefix():
    """A fresh key prefix on the machine's Redis; its keys are deleted afterwards.
    Redis is required: an unreachable Redis fails the test instead of skipping it."""
    import redis.asyncio as aioredis

    prefix = f"omni-rt-test:{uuid.uuid4().hex[:12]}"
    r = aioredis.Redis.from_url(REDIS_URL)
    await r.ping()
    yield prefix
    keys = [k async for k in r.scan_iter(match=f"{prefix}:*")]
    if keys:
        await r.delete(*keys)
    await r.aclose()


def late_profile():
    return profile([("a", "LateEmitter")], [], ["a"])


def spec(**kw) -> SessionsSpec:
    return SessionsSpec(**kw)


async def manager(store: str = "memory", prefix: str = "x", orchestrator=None, node_id=None, **kw) -> SessionManager:
    if store == "redis":
        kw.setdefault("slot_lease_ttl_s", 3.0)
        s = spec(store="redis", redis_url=REDIS_URL, redis_prefix=prefix, **kw)
    else:
        s = spec(**kw)
    m = SessionManager(s, orchestrator, node_id=node_id)
    await m.start()
    return m


def tokens(fence: Fence, n: int) -> Payload:
    return Payload(PayloadKind.TEXT, fence, text="go", meta={"n": n})


# ---- state machine ------------------------------------------------------------------


async def test_lifecycle_detach_resume_close():
    m = await manager()
    s = await m.open("realtime", principal="alice")
    assert s.state == SessionState.ACTIVE
    token = await m.issue_resume_token(s)
    await m.detach(s.id)
    assert s.state == SessionState.DETACHED
    with pytest.raises(IllegalTransition, match="is detached; cannot detach"):
        await m.detach(s.id)
    assert await m.resume(s.id, token, principal="alice") is s
    assert s.state == SessionState.ACTIVE
    await m.close(s.id)
    assert s.state == SessionState.CLOSED
    with pytest.raises(SessionGone, match="is over \\(closed\\)"):
        await m.close(s.id)
    with pytest.raises(SessionGone):
        await m.resume(s.id, token)
    assert (await m.counts())["total"] == 0
    await m.stop()


async def test_resume_refuses_wrong_missing_token_and_unknown_ids():
    m = await manager()
    s = await m.open("duplex")
    token = await m.issue_resume_token(s)
    await m.detach(s.id)
    with pytest.raises(InvalidResumeToken, match="does not match"):
        await m.resume(s.id, token + "x")
    with pytest.raises(InvalidResumeToken, match="is required"):
        await m.resume(s.id, None)
    with pytest.raises(InvalidResumeToken):
        await m.resume(s.id, token, principal="mallory")  # someone else's key
    with pytest.raises(SessionNotFound, match="No session 'sess_nope'"):
        await m.resume("sess_nope", token)
    # a fresh token replaces the old one
    new = await m.issue_resume_token(s)
    with pytest.raises(InvalidResumeToken):
        await m.resume(s.id, token)
    assert (await m.resume(s.id, new)).state == SessionState.ACTIVE
    # the token is kept hashed only
    assert token not in repr(vars(s)) and new not in repr(vars(s))
    # close from outside needs the token
    with pytest.raises(InvalidResumeToken):
        await m.close(s.id, token="wrong", require_token=True)
    await m.close(s.id, token=new, require_token=True)
    await m.stop()


async def test_resume_takes_over_an_attached_session_and_ends_the_old_event_stream():
    m = await manager()
    s = await m.open("duplex")
    token = await m.issue_resume_token(s)
    old_events = s.events()
    waiter = asyncio.ensure_future(old_events.__anext__())
    await asyncio.sleep(0)
    await m.resume(s.id, token)
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(waiter, 1)
    s.emit("hello")
    ev = await asyncio.wait_for(s.events().__anext__(), 1)
    assert ev.type == "hello"
    await m.stop()


async def test_bad_kind_and_unknown_pipeline_are_refused():
    orch, _, _ = make_orchestrator(late_profile(), {"a": LateEmitter})
    m = await manager(orchestrator=orch)
    with pytest.raises(ValueError, match="unknown session kind 'chat'"):
        await m.open("chat")
    from sessions import UnknownPipeline

    with pytest.raises(UnknownPipeline, match="Pipeline 'nope' is not served"):
        await m.open("oneshot", "nope")
    assert (await m.counts())["total"] == 0
    await m.stop()


# ---- admission caps -----------------------------------------------------------------


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_burst_of_1000_opens_admits_exactly_the_cap(store, redis_prefix):
    m = await manager(store, redis_prefix, max_total=50)
    results = await asyncio.gather(*(m.open("oneshot") for _ in range(1000)), return_exceptions=True)
    admitted = [r for r in results if not isinstance(r, BaseException)]
    rejected = [r for r in results if isinstance(r, SessionLimit)]
    assert len(admitted) == 50 and len(rejected) == 950
    assert all(r.scope == "total" and r.retry_after_s == 1 for r in rejected)
    assert (await m.counts())["total"] == 50
    await asyncio.gather(*(m.close(s.id) for s in admitted))
    assert (await m.counts())["total"] == 0
    assert m.stats["slots_released"] == 50
    await m.stop()


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_per_kind_and_per_principal_caps(store, redis_prefix):
    m = await manager(store, redis_prefix, max_total=10, max_per_kind={"realtime": 2}, max_per_principal=3)
    a = [await m.open("realtime", principal="a") for _ in range(2)]
    with pytest.raises(SessionLimit, match="at most 2 'realtime' sessions") as ei:
        await m.open("realtime", principal="b")
    assert ei.value.scope == "kind"
    a.append(await m.open("oneshot", principal="a"))
    with pytest.raises(SessionLimit, match="for this principal") as ei:
        await m.open("oneshot", principal="a")
    assert ei.value.scope == "principal"
    b = await m.open("oneshot", principal="b")  # other principals are unaffected
    await m.close(a[0].id)
    await m.open("realtime", principal="b")  # the freed kind slot is reusable
    counts = await m.counts()
    assert counts["total"] == 4 and counts["kinds"] == {"realtime": 2, "oneshot": 2}
    assert b.state == SessionState.ACTIVE
    await m.stop()


async def test_closing_session_keeps_its_slot_until_its_resources_are_freed():
    m = await manager(max_total=1)
    s = await m.open("world")
    freed = asyncio.Event()
    proceed = asyncio.Event()

    async def slow_free() -> None:
        await proceed.wait()
        freed.set()

    s.add_finalizer(slow_free)
    closing = asyncio.ensure_future(m.close(s.id))
    await asyncio.sleep(0.01)
    assert s.state == SessionState.CLOSING
    with pytest.raises(SessionLimit):
        await m.open("world")
    proceed.set()
    await closing
    assert freed.is_set() and s.state == SessionState.CLOSED
    await m.open("world")
    assert m.stats["slots_released"] == 1
    await m.stop()


async def test_concurrent_closes_return_the_slot_exactly_once():
    m = await manager(max_total=5)
    s = await m.open("oneshot")
    results = await asyncio.gather(m.close(s.id), m.expire(s.id, "idle_timeout"), m.close(s.id), return_exceptions=True)
    assert results[0] is None
    assert m.stats["slots_released"] == 1
    assert (await m.counts())["total"] == 0
    await m.stop()


# ---- leases, reaper, eviction --------------------------------------------------------


async def test_idle_attached_session_expires_and_its_client_hears_it():
    m = await manager(idle_ttl_s=0.05, reaper_interval_s=0.02)
    s = await m.open("realtime")
    events = [ev async for ev in s.events()]  # ends when the session ends
    assert [e.type for e in events] == ["session.expired"]
    assert events[0].data["reason"] == "idle_timeout"
    assert s.state == SessionState.CLOSED and m.stats["expired"] == 1
    with pytest.raises(SessionGone, match="idle_timeout"):
        m.get(s.id)
    await m.stop()


async def test_running_request_is_not_idle():
    LateEmitter.delay = 0.05
    orch, _, _ = make_orchestrator(late_profile(), {"a": LateEmitter})
    m = await manager(orchestrator=orch, idle_ttl_s=0.05, reaper_interval_s=60)
    s = await m.open("realtime", "p")
    stream = s.submit()
    s.send_input(stream, tokens(s.fence, 4))
    stream.end_input()
    await asyncio.sleep(0.1)
    assert await m.reap() == []  # past the TTL, but a request is running
    assert [p async for p in stream.payloads()]
    await stream.close()
    await asyncio.sleep(0.06)
    assert await m.reap() == [s.id]
    await m.stop()
    LateEmitter.delay = 0.01


async def test_detached_session_expires_after_grace_and_resume_then_fails():
    m = await manager(disconnect_grace_s=0.05, reaper_interval_s=0.02)
    s = await m.open("duplex")
    token = await m.issue_resume_token(s)
    await m.detach(s.id)
    await asyncio.wait_for(s.closed.wait(), 2)
    with pytest.raises(SessionGone, match="disconnect_grace_expired"):
        await m.resume(s.id, token)
    assert (await m.counts())["total"] == 0
    await m.stop()


async def test_detached_events_are_replayed_from_a_bounded_buffer():
    m = await manager(replay_buffer_events=3)
    s = await m.open("duplex")
    token = await m.issue_resume_token(s)
    await m.detach(s.id)
    for i in range(5):
        s.emit("chunk", {"i": i})
    await m.resume(s.id, token)
    s.emit("after")
    got = []
    async for ev in s.events():
        got.append((ev.type, ev.data.get("i")))
        if ev.type == "after":
            break
    assert got == [("chunk", 2), ("chunk", 3), ("chunk", 4), ("after", None)]
    assert s.dropped_events == 2
    await m.stop()


async def test_pressure_eviction_takes_the_longest_detached_session_in_scope():
    m = await manager(max_total=10, max_per_kind={"duplex": 3}, evict_detached_under_pressure=True)
    d = [await m.open("duplex") for _ in range(3)]
    other = await m.open("world")
    await m.detach(other.id)  # detached, but not in the full scope (kind duplex)
    await m.detach(d[1].id)
    await asyncio.sleep(0.01)
    await m.detach(d[2].id)
    new = await m.open("duplex")
    assert d[1].state == SessionState.CLOSED and d[1].close_reason == "evicted"
    assert d[2].state == SessionState.DETACHED and other.state == SessionState.DETACHED
    await m.open("duplex")  # evicts d[2], the next longest detached
    assert d[2].state == SessionState.CLOSED
    with pytest.raises(SessionLimit):
        await m.open("duplex")  # nothing detached is left in scope: refuse
    assert d[0].state == SessionState.ACTIVE and new.state == SessionState.ACTIVE
    assert m.stats["evicted"] == 2
    await m.stop()


async def test_no_eviction_unless_enabled():
    m = await manager(max_total=1)
    s = await m.open("duplex")
    await m.detach(s.id)
    with pytest.raises(SessionLimit):
        await m.open("duplex")
    assert s.state == SessionState.DETACHED
    await m.stop()


async def test_expiry_frees_engine_work_connector_keys_and_stage_state():
    LateEmitter.delay = 0.02
    LateEmitter.released = []
    orch, engines, conn = make_orchestrator(late_profile(), {"a": LateEmitter})
    m = await manager(orchestrator=orch)
    s = await m.open("realtime", "p")
    freed = []
    s.data["latents"] = np.zeros((4, 8), np.float32)
    s.add_finalizer(lambda: freed.append("latents"))
    stream = s.submit()
    s.send_input(stream, tokens(s.fence, 1000))
    # a session-scoped key (e.g. a KV prefix handle) stored under the session id
    conn.put(s.id, "kv-prefix", Payload(PayloadKind.KV, s.fence, arrays={"k": np.ones(4, np.float32)}))
    it = stream.payloads()
    await it.__anext__()
    assert orch.running() == [stream.request_id]
    await m.expire(s.id, "evicted")
    assert orch.running() == []
    assert conn.inner.live_keys() == 0
    assert freed == ["latents"] and s.data == {}
    assert LateEmitter.released == [s.id]
    assert (await m.counts())["total"] == 0
    await asyncio.sleep(0.05)  # the late flush lands nowhere
    assert conn.inner.live_keys() == 0
    await m.stop()
    LateEmitter.delay = 0.01


# ---- fences -------------------------------------------------------------------------


async def test_late_chunks_after_cancel_never_reach_the_event_stream_or_next_turn():
    LateEmitter.late_emits = 0
    orch, _, conn = make_orchestrator(late_profile(), {"a": LateEmitter})
    m = await manager(orchestrator=orch)
    s = await m.open("realtime", "p")
    cancelled_at: list[int] = []

    async def pump(stream) -> None:
        # adapter-style pump: request outputs → session events, fence attached
        async for _, payload, _ in stream.payloads():
            s.emit("chunk", {"turn": payload.meta["turn"], "i": payload.meta["i"]}, fence=payload.fence)
        await stream.close()

    t1 = s.submit()
    s.send_input(t1, tokens(s.fence, 1000))
    p1 = asyncio.ensure_future(pump(t1))
    seen = []
    async for ev in s.events():
        seen.append(ev)
        if len(seen) == 3:
            break
    await s.signal("barge_in")
    cancelled_at.append(len(seen))
    with pytest.raises(RequestAborted):
        await p1  # the aborted request ends its pump
    t2 = s.submit()
    s.send_input(t2, tokens(s.fence, 4))
    t2.end_input()
    await pump(t2)
    s.emit("turn.done")
    async for ev in s.events():
        seen.append(ev)
        if ev.type == "turn.done":
            break
    await asyncio.sleep(0.05)  # let the late flush finish
    assert LateEmitter.late_emits == LateEmitter.late  # the engine really did emit late
    after = seen[cancelled_at[0]:]
    assert [e.data["turn"] for e in after if e.type == "chunk"] == [2, 2, 2, 2]
    assert all(e.fence.epoch == 1 for e in after if e.fence is not None)
    assert t2.dropped_stale == 0
    assert conn.inner.live_keys() == 0
    await m.stop()


async def test_stale_event_and_stale_input_are_refused():
    orch, _, _ = make_orchestrator(late_profile(), {"a": LateEmitter})
    m = await manager(orchestrator=orch)
    s = await m.open("realtime", "p")
    old = s.fence
    stream = s.submit()
    await s.signal("clear")
    assert s.epoch == 1
    assert not s.emit("chunk", fence=Fence(s.id, old.epoch, 1))  # session-stream hop
    with pytest.raises(StaleFence, match="epoch 0, but session .* is at epoch 1"):
        s.send_input(stream, tokens(Fence(s.id, 0, 1), 1))
    with pytest.raises(StaleFence, match="belongs to session 'other'"):
        s.check_fence(Fence("other", 5, 5))
    # the orchestrator refuses a stale input too, even when fed directly
    t = s.submit()
    assert not t.send_input(tokens(old, 1))
    assert t.send_input(tokens(s.fence, 1))
    await m.stop()


async def test_commit_ends_input_and_signals_are_validated():
    orch, _, _ = make_orchestrator(late_profile(), {"a": LateEmitter})
    m = await manager(orchestrator=orch)
    s = await m.open("realtime", "p")
    stream = s.submit()
    s.send_input(stream, tokens(s.fence, 2))
    await s.signal("commit")
    assert [p.meta["i"] async for _, p, _ in stream.payloads()] == [0, 1]
    assert stream.done is not None and stream.done.status == "completed"
    with pytest.raises(ValueError, match="unknown signal 'explode'"):
        await s.signal("explode")
    await m.close(s.id)
    with pytest.raises(IllegalTransition, match="is closed; cannot submit"):
        s.submit()
    await m.stop()


# ---- Redis: cluster view ------------------------------------------------------------


async def test_two_nodes_on_one_redis_share_caps_exactly(redis_prefix):
    # 400 admissions in flight at once on a busy 2-core CI machine: a command may wait
    # longer than the default 1 s timeout (it would count as Redis lost); this test is
    # about the caps, so it gives Redis time
    caps = {"max_total": 20, "max_per_kind": {"robot": 5}, "redis_timeout_s": 15.0}
    a = await manager("redis", redis_prefix, node_id="node-a", **caps)
    b = await manager("redis", redis_prefix, node_id="node-b", **caps)
    # 200 robots at once on both nodes, then 200 one-shots: the kind cap and the total
    # cap each hold exactly (which kind reaches Redis first is not ordered when both
    # are in flight together, so they go one kind after the other)
    robots = await asyncio.gather(*[(a if i % 2 else b).open("robot") for i in range(200)], return_exceptions=True)
    oneshots = await asyncio.gather(*[(a if i % 2 else b).open("oneshot") for i in range(200)], return_exceptions=True)
    res = robots + oneshots
    ok = [r for r in res if not isinstance(r, BaseException)]
    assert len(ok) == 20
    assert sum(1 for r in ok if r.kind == "robot") == 5 and {r.kind for r in ok} == {"robot", "oneshot"}
    other = [repr(r) for r in res if isinstance(r, BaseException) and not isinstance(r, SessionLimit)]
    assert not other, other[:3]
    assert (await a.counts())["total"] == 20 == (await b.counts())["total"]
    await a.stop()
    await b.stop()


async def test_directory_tells_where_a_session_lives(redis_prefix):
    a = await manager("redis", redis_prefix, node_id="node-a", advertise_url="http://10.0.0.1:8000")
    b = await manager("redis", redis_prefix, node_id="node-b")
    s = await a.open("duplex", principal="p")
    token = await a.issue_resume_token(s)
    await a.detach(s.id)
    rec = await b.locate(s.id)
    assert rec["node"] == "node-a" and rec["state"] == "detached" and rec["kind"] == "duplex"
    assert rec["lease_expires_at"] > 0 and token not in str(rec)
    with pytest.raises(SessionElsewhere, match="lives on node node-a \\(http://10.0.0.1:8000\\)"):
        await b.resume(s.id, token)
    with pytest.raises(InvalidResumeToken):
        await b.resume(s.id, "wrong")  # the location is only told to the token holder
    await a.close(s.id)
    assert await b.locate(s.id) is None
    await a.stop()
    await b.stop()


@pytest.mark.integration  # waits for Redis-side lease expiry (server time)
async def test_dead_node_gives_its_slots_back_after_one_lease(redis_prefix):
    a = await manager("redis", redis_prefix, node_id="node-a", max_total=4, slot_lease_ttl_s=1.0, reaper_interval_s=0.2)
    b = await manager("redis", redis_prefix, node_id="node-b", max_total=4, slot_lease_ttl_s=1.0, reaper_interval_s=0.2)
    for _ in range(4):
        await a.open("oneshot")
    await asyncio.sleep(1.3)  # node a is alive: it renews, so its slots stay
    with pytest.raises(SessionLimit):
        await b.open("oneshot")
    # node a dies: no shutdown, no release, no more renewals
    reaper = a._reaper
    assert reaper is not None
    reaper.cancel()
    await asyncio.gather(reaper, return_exceptions=True)
    await asyncio.sleep(1.2)
    for _ in range(4):
        await b.open("oneshot")
    await b.stop()
    await a.store.close()


async def test_redis_unreachable_at_start_refuses_with_a_clear_error():
    m = SessionManager(spec(store="redis", redis_url="redis://127.0.0.1:1/0", redis_timeout_s=0.3))
    with pytest.raises(StoreUnavailable, match=r"Redis at redis://127.0.0.1:1/0\) is unreachable"):
        await m.start()


async def test_redis_lost_while_running_refuses_admission_but_sessions_keep_working(redis_prefix):
    proxy = await TcpProxy.start(6379)
    orch, _, _ = make_orchestrator(late_profile(), {"a": LateEmitter})
    m = SessionManager(
        spec(store="redis", redis_url=f"redis://127.0.0.1:{proxy.port}/0", redis_prefix=redis_prefix, redis_timeout_s=0.3),
        orch,
    )
    await m.start()
    s = await m.open("realtime", "p")
    await proxy.stop()
    with pytest.raises(StoreUnavailable, match="is unreachable"):
        await m.open("realtime", "p")
    # the existing session still runs turns locally
    stream = s.submit()
    s.send_input(stream, tokens(s.fence, 2))
    stream.end_input()
    assert len([p async for p in stream.payloads()]) == 2
    await m.reap()  # renewal fails quietly
    await m.close(s.id)  # the slot lapses with its lease; closing still works
    assert s.state == SessionState.CLOSED
    await m.stop()


class TcpProxy:
    """Loopback TCP proxy to a local port; stop() cuts every connection (a lost Redis)."""

    def __init__(self) -> None:
        self.server: asyncio.AbstractServer | None = None
        self.port = 0
        self.writers: list[asyncio.StreamWriter] = []

    @classmethod
    async def start(cls, target: int) -> TcpProxy:
        self = cls()

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                w.close()

        async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
            ur, uw = await asyncio.open_connection("127.0.0.1", target)
            self.writers += [cw, uw]
            await asyncio.gather(pipe(cr, uw), pipe(ur, cw))

        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for w in self.writers:
            w.close()
        await self.server.wait_closed()


def test_store_is_memory_by_default():
    m = SessionManager()
    assert isinstance(m.store, MemoryStore)
    assert isinstance(SessionManager(spec(store="redis")).store, RedisStore)


async def test_an_end_scheduled_from_inside_is_held_until_it_finishes():
    """A session ended from code that cannot wait (a client that stopped reading
    overflows its queue inside emit) ends in a background task, which the manager
    holds until it is done: the loop keeps only weak references to tasks."""
    m = await manager(max_pending_events=16)
    s = await m.open("realtime")
    release = s._release_resources

    async def slow_release(reason: str) -> None:
        await asyncio.sleep(0.02)
        await release(reason)

    s._release_resources = slow_release  # type: ignore[method-assign]
    for i in range(17):  # the 17th event overflows the queue of an attached client that does not read
        s.emit("x", {"i": i})
    assert len(m.background) == 1 and not next(iter(m.background)).done()
    await asyncio.wait_for(s.closed.wait(), 1)
    await asyncio.sleep(0)
    assert s.close_reason == "slow_consumer" and m.background == set()
    await m.stop()
