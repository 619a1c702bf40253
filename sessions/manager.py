"""SessionManager: admits, leases, fences and frees every session.

Every workload is a session: a voice call, a robot episode, a world-model rollout, a
one-shot HTTP request. The manager is the one place that

- admits a session against the caps (total, per kind, per principal) through the
  store, atomically, and gives its slot back exactly once, after everything it held
  is freed (a closing session keeps its slot until then);
- leases it: an attached session expires after `idle_ttl_s` without activity (and no
  running request), a detached one after `disconnect_grace_s`; a reaper checks both
  and renews this node's slot leases in the store;
- optionally evicts the longest-detached session of the full scope to admit a new one;
- frees everything on close, expiry or eviction: running requests aborted (connector
  keys cleaned), stage-held state and affinity released, session-scoped connector
  keys, finalizers (latent buffers, KV prefixes), and the attached client hears a
  `session.expired` / `session.closed` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from omni_rt import metrics, tracing
from omni_rt.load import LoadMeters
from omni_rt.specs import SESSION_KINDS, SessionsSpec
from sessions import handoff, migration
from sessions.admission import RealtimeAdmission
from sessions.errors import (
    CapacityLimit,
    Draining,
    IllegalTransition,
    InvalidResumeToken,
    RateLimited,
    SessionElsewhere,
    SessionGone,
    SessionLimit,
    SessionNotFound,
    StoreUnavailable,
    UnknownPipeline,
)
from sessions.ratelimit import RateLimiter
from sessions.session import Session, SessionState, token_hash_matches
from sessions.store import Limits, MemoryStore, SessionStore, Slot

if TYPE_CHECKING:
    from omni_rt.orchestrator import Orchestrator
    from omni_rt.request import RequestStream

log = logging.getLogger("sessions")

# Why a session ended → the event its client hears.
EXPIRY_REASONS = frozenset({"idle_timeout", "disconnect_grace_expired", "evicted", "operator", "shutdown", "drained"})
# Ends that tell the client to reconnect elsewhere (WebSocket close 1012): its session
# moved to the session store ("migrated", it resumes on another node) or could not
# move and was ended for the restart ("drained").
RESTART_REASONS = frozenset({"migrated", "drained", "shutdown"})


def make_store(spec: SessionsSpec) -> SessionStore:
    if spec.store == "redis":
        from sessions.redis_store import RedisStore

        return RedisStore(
            spec.redis_url,
            prefix=spec.redis_prefix,
            lease_ttl_s=spec.slot_lease_ttl_s,
            timeout_s=spec.redis_timeout_s,
            kinds=SESSION_KINDS,
        )
    return MemoryStore()


DECISIONS_KEPT = 50


class SessionManager:
    def __init__(
        self,
        spec: SessionsSpec | None = None,
        orchestrator: Orchestrator | None = None,
        store: SessionStore | None = None,
        *,
        node_id: str | None = None,
        gone_limit: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        meters: LoadMeters | None = None,
    ) -> None:
        self.clock = clock  # leases are measured on this clock (tests drive it by hand)
        self.spec = spec or SessionsSpec()
        self.orchestrator = orchestrator
        self.store = store or make_store(self.spec)
        self.node_id = node_id or self.spec.node_id or f"{socket.gethostname()}:{os.getpid()}"
        self.limits = Limits(
            self.spec.max_total,
            dict(self.spec.max_per_kind),
            self.spec.max_per_principal,
            self.spec.retry_after_s,
            dict(self.spec.principal_caps),
        )
        # this server's load meters (the orchestrator's: its stages write them), read by admission
        self.meters: LoadMeters = meters if meters is not None else orchestrator.meters if orchestrator is not None else LoadMeters()
        self.admission = RealtimeAdmission(self.spec.realtime_admission, self.meters, clock=clock)
        self.rate_limits = RateLimiter(self.spec.rate_limits, self.store)
        self._charges: set[asyncio.Task[None]] = set()
        # weighed sessions admitted and not yet registered (their slot is being acquired):
        # counted as new by the next decision, so concurrent opens cannot over-admit
        self._admitting = 0
        self._sessions: dict[str, Session] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()  # session id -> why it ended
        self._gone_limit = gone_limit
        self._closing: dict[str, asyncio.Task[None]] = {}
        # Ends scheduled from code that cannot wait for them (a full event queue, a
        # stuck writer). The loop keeps only weak references to tasks: these are held
        # here until they finish, or they could be collected mid-flight.
        self.background: set[asyncio.Task[None]] = set()
        self._reaper: asyncio.Task[None] | None = None
        # The last admission decisions, newest last (the dashboard shows them): what was
        # asked, the outcome, and for weighed sessions what the load-aware check saw.
        self.decisions: deque[dict[str, Any]] = deque(maxlen=DECISIONS_KEPT)
        # draining: no admissions; sessions move to the store (drain)
        self.draining = False
        self.drain_report: dict[str, Any] | None = None
        # (kind, pipeline) -> the wire's restorer of a moved session's state
        self.restorers: dict[tuple[str, str | None], migration.Restorer] = {}
        self.stats = {"moved_out": 0, "moved_in": 0, "admitted": 0, "rejected": 0, "closed": 0, "expired": 0, "evicted": 0, "slots_released": 0, "lapsed_leases": 0}

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        a = self.admission.spec
        await self.meters.start(machine=a.enabled and (a.weigh_outside_load or a.max_throttled_fraction is not None))
        await self.store.connect()
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever(), name="session-reaper")

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
            self._reaper = None
        await asyncio.gather(*(self.end(s, "shutdown") for s in list(self._sessions.values())), return_exceptions=True)
        await asyncio.gather(*self.background, return_exceptions=True)
        await self.store.close()
        await self.meters.stop()

    # ---- admission -------------------------------------------------------------------
    async def open(
        self,
        kind: str,
        pipeline: str | None = None,
        params: Mapping[str, Any] | None = None,
        principal: str = "anonymous",
        control_hz: float | None = None,
        admit: Callable[[], None] | None = None,
    ) -> Session:
        """Admit a new session or raise SessionLimit / StoreUnavailable. `control_hz`:
        the control rate a robot declared (load-aware admission weighs it then).
        `admit`: a pipeline's own real-time check (it raises CapacityLimit), which
        replaces the load-aware one for this session (a full-duplex model's frame
        budget)."""
        if kind not in SESSION_KINDS:
            raise ValueError(f"unknown session kind {kind!r}; known: {', '.join(SESSION_KINDS)}")
        if pipeline is not None and self.orchestrator is not None and pipeline not in self.orchestrator.pipelines:
            raise UnknownPipeline(f"Pipeline '{pipeline}' is not served here; served: {', '.join(sorted(self.orchestrator.pipelines))}.")
        if self.draining:
            self.stats["rejected"] += 1
            metrics.SESSIONS_REJECTED.labels(kind=kind, reason="draining").inc()
            self._decided(kind, principal, None, "draining", "this node is draining", weighed=False)
            raise Draining(kind, self.spec.retry_after_s)
        if kind == "oneshot" and self.rate_limits.limited(principal, "requests"):
            try:
                await self.rate_limits.take(principal, "requests")
            except RateLimited as exc:
                self.stats["rejected"] += 1
                metrics.SESSIONS_REJECTED.labels(kind=kind, reason="rate_limit").inc()
                self._decided(kind, principal, None, "rate_limit", exc.message, weighed=False)
                raise
        t0 = time.perf_counter()
        sid = f"sess_{secrets.token_hex(12)}"
        slot = Slot(sid, kind, principal)
        session = Session(self, sid, kind, pipeline, params or {}, principal, self.spec.replay_buffer_events, self.spec.max_pending_events)
        # The directory entry is written with the slot, in the same atomic step.
        record = {**self.record(session), "state": SessionState.ACTIVE.value}
        session.weighed = admit is None and self.admission.applies(kind, control_hz)
        load = self.weigh(kind, principal, pipeline, admit) if session.weighed or admit is not None else None
        # From the decision until the session is registered it counts as new: the store
        # (Redis) is awaited in between, and concurrent opens must see this one.
        with self.admitting(session):
            await self._acquire(session, slot, record)
        self._sessions[sid] = session
        session._transition(SessionState.ACTIVE, "open")
        self.stats["admitted"] += 1
        self._decided(kind, principal, sid, None, None, load=load)
        session.span = tracing.span("session", **{"omni_rt.session.id": sid, "omni_rt.session.kind": kind,
                                                  "omni_rt.pipeline": pipeline, "omni_rt.principal": principal})
        metrics.SESSIONS_ADMITTED.labels(kind=kind).inc()
        metrics.SESSIONS_ACTIVE.labels(kind=kind).inc()
        metrics.ADMISSION_SECONDS.observe(time.perf_counter() - t0)
        return session

    async def _acquire(self, session: Session, slot: Slot, record: dict[str, Any]) -> None:
        """The session's slot in the store, evicting a detached session to make room
        where that is allowed; SessionLimit / StoreUnavailable when there is none."""
        kind, principal = slot.kind, slot.principal
        evicted: set[str] = set()
        while True:
            try:
                await self.store.acquire(slot, self.limits, record)
                break
            except SessionLimit as exc:
                victim = self._eviction_victim(exc, slot, evicted) if self.spec.evict_detached_under_pressure else None
                if victim is None:
                    self.stats["rejected"] += 1
                    metrics.SESSIONS_REJECTED.labels(kind=kind, reason=exc.scope).inc()
                    self._decided(kind, principal, None, exc.scope, exc.message)
                    raise
                evicted.add(victim.id)
                log.info("session %s evicted under pressure to admit a %s session", victim.id, kind)
                await self.end(victim, "evicted")
            except StoreUnavailable as exc:
                self.stats["rejected"] += 1
                metrics.SESSIONS_REJECTED.labels(kind=kind, reason="store_unavailable").inc()
                self._decided(kind, principal, None, "store_unavailable", exc.message)
                raise

    def weigh(self, kind: str, principal: str, pipeline: str | None, admit: Callable[[], None] | None = None,
              what: str = "new") -> dict[str, Any] | None:
        """Load-aware admission of one more real-time session (`admit`: a pipeline's own
        check instead); a refusal is counted and recorded, and raised (CapacityLimit).
        Returns what the load-aware check measured and predicted for this session (taken
        now: concurrent opens decide while this one awaits the store)."""
        try:
            if admit is not None:
                admit()
                return None
            self.admission.check(kind, *self._realtime_split(), pipeline=pipeline)
            return dict(self.admission.last)
        except CapacityLimit as exc:
            self.stats["rejected"] += 1
            metrics.SESSIONS_REJECTED.labels(kind=kind, reason="capacity").inc()
            self._decided(kind, principal, None, "capacity", exc.message if what == "new" else f"{what}: {exc.message}", weighed=admit is None)
            raise

    def realtime_sessions(self) -> int:
        """Attached sessions on this node of the kinds load-aware admission weighs. A
        detached one generates nothing new (what it still runs shows in the measured
        load); it is weighed again when it resumes."""
        return sum(self._realtime_split())

    def charge_soon(self, principal: str, resource: str, amount: float) -> None:
        """Charge a rate limit from synchronous code (an answer's usage, known at its
        end): the store is written in a task of its own."""
        if amount <= 0 or not self.rate_limits.limited(principal, resource):
            return
        async def charge() -> None:
            try:
                await self.rate_limits.charge(principal, resource, amount)
            except Exception:  # noqa: BLE001 - a charge that could not be written is logged, never raised into the loop
                log.exception("rate limit charge for %s (%s) failed", principal, resource)

        task = asyncio.get_running_loop().create_task(charge())
        self._charges.add(task)
        task.add_done_callback(self._charges.discard)

    def headroom(self) -> dict[str, int]:
        """Per load-weighed kind: how many more sessions would be admitted now (the
        load-aware check, one after the other, within the caps on this node)."""
        spec = self.spec
        open_by_kind: dict[str, int] = {}
        for s in self._sessions.values():
            open_by_kind[s.kind] = open_by_kind.get(s.kind, 0) + 1
        total_room = max(0, spec.max_total - len(self._sessions))
        est, new = self._realtime_split()
        if self.admission.spec.enabled:
            # the dearest session the node serves decides (each calibrated pipeline's cost, else the prior)
            costed: list[str | None] = list(self.admission.costs) or [None]
            load_room = min(self.admission.headroom(est, new, p, limit=total_room) for p in costed)
        else:
            load_room = total_room
        out: dict[str, int] = {}
        for kind in sorted(self.admission.kinds):
            room = min(load_room, total_room)
            cap = spec.max_per_kind.get(kind)
            if cap is not None:
                room = min(room, max(0, cap - open_by_kind.get(kind, 0)))
            out[kind] = room
        return out

    def _realtime_split(self) -> tuple[int, int]:
        """(established, new) open real-time sessions: new ones opened less than
        `realtime_admission.new_session_s` ago and have not shown their load yet."""
        now = self.clock()
        young = self.admission.spec.new_session_s
        est, new = 0, self._admitting
        for s in self._sessions.values():
            if s.weighed and s.state == SessionState.ACTIVE:
                if now - s.opened_at < young:
                    new += 1
                else:
                    est += 1
        return est, new

    def _eviction_victim(self, exc: SessionLimit, slot: Slot, skip: set[str]) -> Session | None:
        """Longest-detached local session whose slot would make room in the full scope."""
        candidates = [
            s
            for s in self._sessions.values()
            if s.state == SessionState.DETACHED
            and s.id not in skip
            and (exc.scope == "total" or (exc.scope == "kind" and s.kind == slot.kind) or (exc.scope == "principal" and s.principal == slot.principal))
        ]
        if not candidates:
            return None
        return min(candidates, key=lambda s: s.detached_at or 0.0)

    # ---- lookup ----------------------------------------------------------------------
    def get(self, session_id: str) -> Session:
        s = self._sessions.get(session_id)
        if s is None:
            if session_id in self._gone:
                raise SessionGone(session_id, self._gone[session_id])
            raise SessionNotFound(session_id)
        return s

    @contextlib.contextmanager
    def admitting(self, session: Session) -> Iterator[None]:
        """While a weighed session is being admitted (the store is awaited between the
        decision and its registration) it counts as new: concurrent opens see it."""
        self._admitting += int(session.weighed)
        try:
            yield
        finally:
            self._admitting -= int(session.weighed)

    def adopt(self, session: Session) -> None:
        """Register a session restored here from another node (`sessions.handoff.adopt`)."""
        self._sessions[session.id] = session
        session.moved_in()

    def sessions(self, principal: str | None = None) -> list[Session]:
        return [s for s in self._sessions.values() if principal is None or s.principal == principal]

    async def locate(self, session_id: str) -> dict[str, Any] | None:
        """The directory entry for a session on any node (None if unknown)."""
        return await self.store.lookup(session_id)

    # ---- detach / resume -------------------------------------------------------------
    async def detach(self, session_id: str) -> Session:
        """The client went away: keep the session resumable for `disconnect_grace_s`."""
        s = self.get(session_id)
        s._transition(SessionState.DETACHED, "detach")
        s.detached_at = self.clock()
        s._end_attachment()
        s._trim_replay()
        await self._publish(s)
        return s

    async def resume(self, session_id: str, token: str | None, principal: str | None = None) -> Session:
        """Re-attach with the session's resume token. An attached session is taken over
        (the old attachment's event stream ends)."""
        s = self._sessions.get(session_id)
        if s is None:
            blob = await self.store.get_state(session_id)
            if blob is not None:  # moved off a draining node: adopted here
                if self.draining:
                    raise Draining("moved", self.spec.retry_after_s, what="session moved from another node")
                return await handoff.adopt(self, session_id, blob, token, principal)
            if session_id in self._gone:
                raise SessionGone(session_id, self._gone[session_id])
            rec = await self.store.lookup(session_id)
            if rec is None:
                raise SessionNotFound(session_id)
            if not token or rec.get("token_hash") is None or not token_hash_matches(rec["token_hash"], token):
                raise InvalidResumeToken(session_id, missing=not token)
            raise SessionElsewhere(session_id, str(rec.get("node")), rec.get("url"))
        if not token:
            raise InvalidResumeToken(session_id, missing=True)
        if not s.token_matches(token) or (principal is not None and principal != s.principal):
            raise InvalidResumeToken(session_id)
        if s.state == SessionState.ACTIVE:
            s._transition(SessionState.DETACHED, "take over")
            s._end_attachment()
        s._transition(SessionState.ACTIVE, "resume")
        s.detached_at = None
        s.touch()
        await self._publish(s)
        return s

    # ---- close / expire --------------------------------------------------------------
    async def close(self, session_id: str, *, token: str | None = None, require_token: bool = False, reason: str = "closed") -> None:
        """End a session. Outside callers (`require_token`) must present its token."""
        s = self.get(session_id)
        if require_token and not s.token_matches(token):
            raise InvalidResumeToken(session_id, missing=not token)
        if s.state in (SessionState.CLOSING, SessionState.CLOSED):
            raise IllegalTransition(session_id, s.state.value, "close")
        await self.end(s, reason)

    def _slow_consumer(self, s: Session) -> None:
        """An attached client stopped reading and its event queue is full: end it."""
        log.warning("session %s (%s): the client is not reading (%d events queued); ending it", s.id, s.kind, len(s._events))
        s._events.clear()  # what it did not read is gone; the final event goes out first
        self.end_soon(s, "slow_consumer")

    def end_soon(self, s: Session, reason: str) -> asyncio.Task[None]:
        """End `s` in the background (for callers that cannot wait, e.g. inside emit)."""
        task = asyncio.get_running_loop().create_task(self.end(s, reason), name=f"end-{s.id}")
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    async def expire(self, session_id: str, reason: str = "idle_timeout") -> None:
        await self.end(self.get(session_id), reason)

    async def end(self, s: Session, reason: str) -> None:
        """closing → free everything → return the slot once → closed. Idempotent (for
        adapters ending their own session): concurrent callers wait for the one that
        is already ending it; a closed session is left alone."""
        task = self._closing.get(s.id)
        if task is None:
            if s.state == SessionState.CLOSED:
                return
            log.debug("session %s (%s) ending: %s", s.id, s.kind, reason)
            task = asyncio.get_running_loop().create_task(self._do_end(s, reason))
            self._closing[s.id] = task
        await asyncio.shield(task)

    async def _do_end(self, s: Session, reason: str) -> None:
        try:
            s._transition(SessionState.CLOSING, "close")
            s.close_reason = reason
            if reason == "migrated":
                s.emit("session.migrated", {"session_id": s.id, "reason": "drain", "resume_url": self.spec.resume_url})
            else:
                event = "session.expired" if reason in EXPIRY_REASONS else "session.closed"
                s.emit(event, {"session_id": s.id, "reason": reason})
            await s._release_resources(reason)
            if self.orchestrator is not None:
                self.orchestrator.release_session(s.id)
        finally:
            # The slot (and the directory entry) go back only now that nothing is held.
            try:
                if await self.store.release(Slot(s.id, s.kind, s.principal)):
                    self.stats["slots_released"] += 1
                else:
                    log.warning("session %s: its slot had already lapsed in the store", s.id)
            except StoreUnavailable as exc:
                log.warning("session %s: slot not returned (%s); it lapses with its lease", s.id, exc)
            s.state = SessionState.CLOSED
            s._wakeup.set()
            s.closed.set()
            self._sessions.pop(s.id, None)
            self._closing.pop(s.id, None)
            self._gone[s.id] = reason
            while len(self._gone) > self._gone_limit:
                self._gone.popitem(last=False)
            key = "evicted" if reason == "evicted" else "expired" if reason in ("idle_timeout", "disconnect_grace_expired") else "closed"
            self.stats[key] += 1
            metrics.SESSIONS_ACTIVE.labels(kind=s.kind).dec()
            metrics.SESSIONS_ENDED.labels(kind=s.kind, reason=reason).inc()
            if s.span is not None:
                s.span.set_attribute("omni_rt.session.end_reason", reason)
                tracing.end(s.span)
            if reason in ("idle_timeout", "disconnect_grace_expired", "evicted"):
                metrics.SESSIONS_EVICTED.labels(kind=s.kind, reason=reason).inc()

    # ---- drain: moving sessions to other nodes (sessions.handoff) ---------------------
    async def drain(self, timeout_s: float) -> dict[str, Any]:
        """Stop admitting, then hand every session off (`sessions.handoff.drain`)."""
        return await handoff.drain(self, timeout_s)

    # ---- leases ----------------------------------------------------------------------
    async def reap(self) -> list[str]:
        """One reaper pass: expire idle and detached-too-long sessions, renew leases."""
        now = self.clock()
        ended: list[tuple[Session, str]] = []
        for s in list(self._sessions.values()):
            if s.state == SessionState.DETACHED and s.detached_at is not None:
                if now - s.detached_at >= self.spec.disconnect_grace_s:
                    ended.append((s, "disconnect_grace_expired"))
            elif s.state == SessionState.ACTIVE and now - s.last_active >= self.spec.idle_ttl_s and not s.holds_lease():
                ended.append((s, "idle_timeout"))
        for s, why in ended:
            log.info("session %s (%s) expired: %s", s.id, s.kind, why)
            await self.end(s, why)
        live = [s for s in self._sessions.values() if s.is_open]
        try:
            lapsed = await self.store.renew([Slot(s.id, s.kind, s.principal) for s in live])
            await self.store.publish_many([self.record(s) for s in live if s.is_open])
            # A session that ended while these were in flight may have had its released
            # slot (and directory entry) written back: give them back again.
            for s in live:
                if not s.is_open:
                    lapsed -= int(await self.store.release(Slot(s.id, s.kind, s.principal)))
            if lapsed > 0:
                self.stats["lapsed_leases"] += lapsed
                log.warning("%d slot lease(s) of this node had lapsed in the store and were renewed", lapsed)
        except StoreUnavailable as exc:
            log.warning("session store unreachable during lease renewal: %s", exc)
        return [s.id for s, _ in ended]

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.spec.reaper_interval_s)
            try:
                await self.reap()
            except Exception:  # noqa: BLE001 - the reaper must survive anything
                log.exception("session reaper pass failed")

    async def issue_resume_token(self, s: Session) -> str:
        """A fresh resume token for `s` (earlier ones stop working); only its hash is
        kept, locally and in the directory."""
        token = s.issue_resume_token()
        await self._publish(s)
        return token

    async def _publish(self, s: Session) -> None:
        try:
            await self.store.publish(self.record(s))
        except StoreUnavailable as exc:
            log.warning("session %s: directory not updated: %s", s.id, exc)

    def record(self, s: Session) -> dict[str, Any]:
        """The directory entry of a session of this node."""
        if s.state == SessionState.DETACHED and s.detached_at is not None:
            lease_left = self.spec.disconnect_grace_s - (self.clock() - s.detached_at)
        else:
            lease_left = self.spec.idle_ttl_s - (self.clock() - s.last_active)
        return {
            "session_id": s.id,
            "node": self.node_id,
            "url": self.spec.advertise_url,
            "kind": s.kind,
            "principal": s.principal,
            "state": s.state.value,
            "lease_expires_at": round(time.time() + max(0.0, lease_left), 3),
            "token_hash": s.token_hash,
        }

    # ---- used by Session -------------------------------------------------------------
    def final_outputs(self, pipeline: str) -> set[str]:
        """The stages whose outputs a request of `pipeline` may ask for."""
        if self.orchestrator is None:
            raise RuntimeError("this session manager has no orchestrator")
        profile = self.orchestrator.pipelines.get(pipeline)
        return set(profile.final_outputs) if profile is not None else set()

    def orchestrator_submit(self, pipeline: str, **kw: Any) -> RequestStream:
        if self.orchestrator is None:
            raise RuntimeError("this session manager has no orchestrator")
        return self.orchestrator.submit(pipeline, **kw)

    async def counts(self) -> dict[str, Any]:
        return await self.store.counts()

    def _decided(self, kind: str, principal: str, session_id: str | None, refused: str | None, why: str | None, weighed: bool = True,
                 load: Mapping[str, Any] | None = None) -> None:
        """Record a decision; `load`: what the load-aware check measured and predicted
        for it (a capacity refusal's is the check just made)."""
        entry: dict[str, Any] = {"time": time.time(), "kind": kind, "principal": principal, "admitted": refused is None}
        if session_id is not None:
            entry["session_id"] = session_id
        if refused is not None:
            entry.update(reason=refused, message=why)
        if load is None and weighed and refused == "capacity" and self.admission.last:
            load = self.admission.last
        if load:
            entry["load"] = dict(load)
        self.decisions.append(entry)

    def health(self) -> dict[str, Any]:
        by_state: dict[str, int] = {}
        for s in self._sessions.values():
            by_state[s.state.value] = by_state.get(s.state.value, 0) + 1
        return {
            "node": self.node_id,
            "draining": self.draining,
            **({"drain": self.drain_report} if self.drain_report is not None else {}),
            "store": self.store.health(),
            "local": len(self._sessions),
            "by_state": by_state,
            "realtime_admission": {**self.admission.health(), "open": self.realtime_sessions()},
        }

