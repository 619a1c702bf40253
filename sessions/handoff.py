"""Draining a node for a rolling deploy: its sessions go to the session store and
resume on another node (`SessionManager.drain`, `omni-rt drain`, SIGTERM).

`drain` stops admitting, then hands every session off: a session whose wire can move
it (an exporter) reaches a clean point, its state goes to the store as a bounded blob
(`sessions.migration`) and its client hears it moved; one that cannot move finishes
its turn and ends (`drained`). `adopt` is the other side: the node a client resumes on
takes the moved session over (its token checked, a slot taken, the wire's state
restored by its restorer).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from omni_rt import metrics
from sessions import migration
from sessions.errors import IllegalTransition, InvalidResumeToken, SessionError, StoreUnavailable, UnknownPipeline
from sessions.session import Session, SessionState, token_hash_matches
from sessions.store import Slot

if TYPE_CHECKING:
    from sessions.manager import SessionManager

log = logging.getLogger("sessions")


async def drain(m: SessionManager, timeout_s: float) -> dict[str, Any]:
    """Stop admitting, then hand every session off: a session whose wire can move it
    reaches a clean point, its state goes to the store and its client hears
    `session.migrated` (it resumes on any node); one that cannot move finishes its
    turn (a one-shot request its answer) and ends with reason `drained`. Returns
    what moved, ended and failed; sessions still here at the timeout are ended."""
    m.draining = True
    t0 = time.monotonic()
    deadline = t0 + max(0.0, timeout_s)
    log.info("draining: %d session(s) to hand off within %.0f s", len(m.sessions()), timeout_s)
    outcomes = await asyncio.gather(*(_hand_off(m, s, deadline) for s in m.sessions()))
    report: dict[str, Any] = {"node": m.node_id, "moved": [], "ended": [], "failed": []}
    for sid, outcome, why in outcomes:
        report[outcome].append({"session_id": sid, **({"reason": why} if why else {})})
    report["remaining"] = len(m.sessions())
    report["seconds"] = round(time.monotonic() - t0, 3)
    m.drain_report = report
    log.info("drained in %.2f s: %d moved, %d ended, %d failed", report["seconds"], len(report["moved"]), len(report["ended"]), len(report["failed"]))
    return report


async def _hand_off(m: SessionManager, s: Session, deadline: float) -> tuple[str, str, str | None]:
    """(session id, moved | ended | failed, why)."""
    try:
        if s.exporter is not None and s.is_open:
            left = max(0.0, deadline - time.monotonic())
            state = await asyncio.wait_for(s.exporter(left), timeout=left + 1.0)
        else:
            state = None
            await _quiesce(s, deadline)
        if not s.is_open:
            await s.closed.wait()
            return s.id, "ended", s.close_reason
        if state is None:
            await m.end(s, "drained")
            return s.id, "ended", "nothing to move"
        # after its clean point: what the client has not read goes with it (a
        # detached session's events, replayed where it resumes)
        # up to migration_max_bytes of msgpack: packed in a thread, off the loop that paces audio
        blob = await asyncio.to_thread(migration.encode, s.snapshot(m.node_id), state, m.spec.migration_max_bytes)
        await m.store.put_state(s.id, blob, m.spec.migration_ttl_s, {**m.record(s), "state": "migrated", "node": None,
                                                                     "from_node": m.node_id, "url": m.spec.resume_url})
        await m.end(s, "migrated")
        m.stats["moved_out"] += 1
        metrics.SESSIONS_MIGRATED.labels(kind=s.kind, direction="out").inc()
        log.info("session %s (%s) moved: %d bytes of state", s.id, s.kind, len(blob))
        return s.id, "moved", None
    except Exception as exc:  # noqa: BLE001 - one session's failure is reported, the others still move
        if isinstance(exc, SessionError):
            why = exc.message
        elif isinstance(exc, asyncio.TimeoutError):
            why = "no clean point before the drain timeout"
        else:
            why = f"{type(exc).__name__}: {exc}"
            log.exception("session %s (%s): its hand-off failed", s.id, s.kind)
        log.warning("session %s (%s) could not move: %s", s.id, s.kind, why)
        if s.is_open:
            await m.end(s, "drained")
        return s.id, "failed", why


async def _quiesce(s: Session, deadline: float) -> None:
    """A session with nothing to move: a one-shot one finishes here (its handler ends
    it), a pinned one (a phone call) until it ends; another finishes the turn it is
    generating."""
    while s.is_open and time.monotonic() < deadline:
        if s.kind != "oneshot" and not s.pinned and not s.holds_lease():
            return
        try:
            await asyncio.wait_for(s.closed.wait(), timeout=min(0.05, max(0.0, deadline - time.monotonic())))
        except asyncio.TimeoutError:
            pass


async def adopt(m: SessionManager, session_id: str, blob: bytes, token: str | None, principal: str | None) -> Session:
    """Take over a session another node moved: its token is checked, a slot taken,
    the wire's state restored; on any failure nothing is kept (the state stays in
    the store for another try until it lapses). A moved real-time session is weighed
    like a new one: a node that cannot serve it in real time refuses it (capacity,
    retry-after), and its client resumes it on another node or later."""
    doc = await asyncio.to_thread(migration.decode, session_id, blob, m.spec.migration_max_bytes)
    core, state = doc["session"], doc["state"]
    if not token or not core.get("token_hash") or not token_hash_matches(str(core["token_hash"]), token):
        raise InvalidResumeToken(session_id, missing=not token)
    if principal is not None and principal != core.get("principal"):
        raise InvalidResumeToken(session_id)
    kind, pipeline = str(core["kind"]), core.get("pipeline")
    if pipeline is not None and m.orchestrator is not None and pipeline not in m.orchestrator.pipelines:
        raise UnknownPipeline(
            f"Session '{session_id}' was moved from node {core.get('from_node')} running pipeline '{pipeline}', which this node "
            f"does not serve (served: {', '.join(sorted(m.orchestrator.pipelines))}); resume it on a node that does."
        )
    restore = m.restorers.get((kind, pipeline))
    if restore is None:
        raise migration.MigrationError(f"Session '{session_id}' ({kind}) was moved, but this node cannot restore {kind} sessions of pipeline '{pipeline}'.")
    try:
        s = Session.from_snapshot(m, core)
    except Exception as exc:
        raise migration.MigrationFailed(f"Session '{session_id}' was moved, but its state could not be read ({type(exc).__name__}: {exc}).") from None
    slot = Slot(session_id, kind, s.principal)
    s.weighed = m.admission.applies(kind, None)
    if s.weighed:
        m.weigh(kind, s.principal, pipeline, what="moved")
    with m.admitting(s):
        try:
            await m.store.acquire(slot, m.limits, {**m.record(s), "state": SessionState.ACTIVE.value})
        except ValueError:
            raise IllegalTransition(session_id, "being resumed on another node", "resume") from None
    try:
        restore(s, state)
    except Exception as exc:
        await m.store.release(slot)
        log.exception("session %s: its moved state could not be restored", session_id)
        raise migration.MigrationFailed(f"Session '{session_id}' was moved, but restoring it failed ({type(exc).__name__}: {exc}).") from None
    m.adopt(s)
    try:
        await m.store.drop_state(session_id)
    except StoreUnavailable as exc:
        log.warning("session %s: its moved state was not dropped from the store (%s); it lapses", session_id, exc)
    m.stats["moved_in"] += 1
    metrics.SESSIONS_ADMITTED.labels(kind=kind).inc()
    metrics.SESSIONS_ACTIVE.labels(kind=kind).inc()
    metrics.SESSIONS_MIGRATED.labels(kind=kind, direction="in").inc()
    log.info("session %s (%s) moved in from node %s", session_id, kind, core.get("from_node"))
    return s
