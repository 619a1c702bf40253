"""Property-based: random interleavings of session operations keep the invariants.

open / burst of opens / input / cancel / detach / resume (right and wrong token) /
expire / close / lease time passing + reaper, against a manager over a real
orchestrator (fake engines). After every step: no cap is exceeded, the store holds
exactly one slot per session that is not closed, every closed session returned its
slot exactly once. At the end everything is closed and nothing is left behind:
no slot, no running request, no connector key.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from omni_rt.payloads import Payload, PayloadKind
from omni_rt.specs import SessionsSpec
from sessions import IllegalTransition, InvalidResumeToken, SessionError, SessionLimit, SessionManager, SessionState
from testkit.harness import LateEmitter, make_orchestrator, profile

KINDS = ["oneshot", "realtime", "duplex"]
PRINCIPALS = ["alice", "bob", "carol"]
CAPS: dict[str, Any] = {"total": 6, "kind": {"realtime": 3, "duplex": 2}, "principal": 3}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_machine(store: str, prefix: str | None = None) -> type[RuleBasedStateMachine]:
    class SessionMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.loop = asyncio.new_event_loop()
            self.clock = Clock()
            LateEmitter.delay = 0.001
            self.orch, _, self.conn = make_orchestrator(profile([("a", "LateEmitter")], [], ["a"]), {"a": LateEmitter})
            kw = dict(
                max_total=CAPS["total"],
                max_per_kind=CAPS["kind"],
                max_per_principal=CAPS["principal"],
                idle_ttl_s=10,
                disconnect_grace_s=5,
                reaper_interval_s=60,  # the test calls reap() itself, on its own clock
                evict_detached_under_pressure=True,
            )
            if store == "redis":
                import uuid

                kw.update(store="redis", redis_prefix=f"{prefix}:{uuid.uuid4().hex[:8]}", slot_lease_ttl_s=600)
            self.m = SessionManager(SessionsSpec(**kw), self.orch, clock=self.clock)
            self.run(self.m.start())
            self.sessions: list = []  # every session ever admitted
            self.tokens: dict[str, str] = {}

        def run(self, coro):
            return self.loop.run_until_complete(coro)

        def live(self):
            return [s for s in self.sessions if s.state != SessionState.CLOSED]

        def pick(self, i: int, states: tuple[SessionState, ...] | None = None):
            pool = [s for s in self.live() if states is None or s.state in states]
            return pool[i % len(pool)] if pool else None

        # ---- rules ----
        @rule(kind=st.sampled_from(KINDS), principal=st.sampled_from(PRINCIPALS))
        def open(self, kind: str, principal: str) -> None:
            try:
                s = self.run(self.m.open(kind, "p", principal=principal))
            except SessionLimit:
                return
            self.sessions.append(s)
            self.tokens[s.id] = self.run(self.m.issue_resume_token(s))

        @rule(n=st.integers(2, 12), kind=st.sampled_from(KINDS), principal=st.sampled_from(PRINCIPALS))
        def burst(self, n: int, kind: str, principal: str) -> None:
            async def go():
                return await asyncio.gather(*(self.m.open(kind, "p", principal=principal) for _ in range(n)), return_exceptions=True)

            for r in self.run(go()):
                if isinstance(r, SessionLimit):
                    continue
                assert not isinstance(r, BaseException), r
                self.sessions.append(r)

        @rule(i=st.integers(0, 100))
        def input(self, i: int) -> None:
            s = self.pick(i, (SessionState.ACTIVE, SessionState.DETACHED))
            if s is None:
                return
            async def go() -> None:
                stream = s.submit()
                assert s.send_input(stream, Payload(PayloadKind.TEXT, s.fence, text="x", meta={"n": 100_000}))

            self.run(go())

        @rule(i=st.integers(0, 100), sig=st.sampled_from(["cancel", "barge_in", "clear", "commit"]))
        def signal(self, i: int, sig: str) -> None:
            s = self.pick(i, (SessionState.ACTIVE, SessionState.DETACHED))
            if s is None:
                return
            epoch = s.epoch
            self.run(s.signal(sig))
            assert s.epoch == epoch + (sig != "commit")
            if sig != "commit":
                assert not s.running_requests()

        @rule(i=st.integers(0, 100))
        def detach(self, i: int) -> None:
            s = self.pick(i)
            if s is None:
                return
            if s.state == SessionState.ACTIVE:
                self.run(self.m.detach(s.id))
                assert s.state == SessionState.DETACHED
            else:
                try:
                    self.run(self.m.detach(s.id))
                    raise AssertionError("detach from a non-active state must fail")
                except IllegalTransition:
                    pass

        @rule(i=st.integers(0, 100), right=st.booleans())
        def resume(self, i: int, right: bool) -> None:
            s = self.pick(i)
            if s is None:
                return
            token = self.tokens.get(s.id)
            try:
                self.run(self.m.resume(s.id, token if right else "not-the-token"))
            except InvalidResumeToken:
                assert not right or token is None
                return
            assert right and s.state == SessionState.ACTIVE

        @rule(i=st.integers(0, 100), how=st.sampled_from(["close", "expire", "evicted"]))
        def end(self, i: int, how: str) -> None:
            s = self.pick(i)
            if s is None:
                return
            if how == "close":
                self.run(self.m.close(s.id))
            else:
                self.run(self.m.expire(s.id, "idle_timeout" if how == "expire" else "evicted"))
            assert s.state == SessionState.CLOSED
            try:
                self.run(self.m.close(s.id))
                raise AssertionError("double close must fail")
            except SessionError:
                pass

        @rule(dt=st.sampled_from([0.5, 3.0, 6.0, 11.0]))
        def time_passes(self, dt: float) -> None:
            self.clock.now += dt
            self.run(self.m.reap())
            for s in self.live():
                if s.state == SessionState.DETACHED:
                    assert self.clock.now - s.detached_at < 5

        # ---- invariants ----
        @invariant()
        def caps_hold_and_slots_match(self) -> None:
            counts = self.run(self.m.counts())
            held = [s for s in self.sessions if s.state != SessionState.CLOSED]
            assert counts["total"] == len(held) <= CAPS["total"]
            for kind, cap in CAPS["kind"].items():
                assert counts["kinds"].get(kind, 0) == sum(1 for s in held if s.kind == kind) <= cap
            for p in PRINCIPALS:
                assert sum(1 for s in held if s.principal == p) <= CAPS["principal"]
            closed = [s for s in self.sessions if s.state == SessionState.CLOSED]
            assert self.m.stats["slots_released"] == len(closed)

        def teardown(self) -> None:
            try:
                self.run(self.m.stop())
                assert all(s.state == SessionState.CLOSED for s in self.sessions)
                assert self.m.stats["slots_released"] == len(self.sessions)
                assert self.orch.running() == []
                # late flushes from cancelled turns land nowhere
                self.run(asyncio.sleep(0.02))
                assert self.conn.inner.live_keys() == 0
                if store == "redis":
                    fresh = SessionManager(self.m.spec)
                    self.run(fresh.store.connect())
                    assert self.run(fresh.counts())["total"] == 0
                    self.run(fresh.store.close())
            finally:
                self.loop.close()

    return SessionMachine


TestMemorySessions = make_machine("memory").TestCase
TestMemorySessions.settings = settings(max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck))

TestRedisSessions = make_machine("redis", "omni-rt-test:prop").TestCase
TestRedisSessions.settings = settings(max_examples=15, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(autouse=True, scope="module")
def _cleanup_redis_keys():
    yield
    import redis

    r = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    keys = list(r.scan_iter(match="omni-rt-test:prop:*"))
    if keys:
        r.delete(*keys)
    r.close()
