"""One session: its state machine, fence, requests, event stream and owned state.

A session is what a client holds across turns. It submits orchestrator requests under
its current fence, owns everything that must outlive one request (conversation
history, KV-prefix handles, latent buffers, episode state: `data`, plus finalizers for
anything that must be freed), and carries an event stream to the attached client
that drops any event from a cancelled turn.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
import inspect
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from omni_rt import metrics
from omni_rt.payloads import SPEECH_STAGES, Fence, Payload
from sessions.errors import IllegalTransition, StaleFence

T = TypeVar("T")

if TYPE_CHECKING:
    from omni_rt.request import RequestStream
    from sessions.manager import SessionManager
    from sessions.migration import Exporter

log = logging.getLogger("sessions")


class SessionState(str, enum.Enum):
    OPENING = "opening"
    ACTIVE = "active"
    DETACHED = "detached"
    CLOSING = "closing"
    CLOSED = "closed"


TRANSITIONS: dict[SessionState, frozenset[SessionState]] = {
    SessionState.OPENING: frozenset({SessionState.ACTIVE, SessionState.CLOSING}),
    SessionState.ACTIVE: frozenset({SessionState.DETACHED, SessionState.CLOSING}),
    SessionState.DETACHED: frozenset({SessionState.ACTIVE, SessionState.CLOSING}),
    SessionState.CLOSING: frozenset({SessionState.CLOSED}),
    SessionState.CLOSED: frozenset(),
}

# The events that end an attachment's stream: the session is over here (closed,
# expired) or moved to another node (migrated).
END_EVENTS = frozenset({"session.expired", "session.closed", "session.migrated"})

# Signals a client may send. cancel / barge_in / clear advance the epoch.
SIGNALS = ("commit", "cancel", "barge_in", "clear")


@dataclass(frozen=True, slots=True)
class SessionEvent:
    """One event for the attached client. `fence` is set for events of a turn."""

    type: str
    data: Mapping[str, Any] = field(default_factory=dict)
    fence: Fence | None = None
    seq: int = 0


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def token_hash_matches(stored_hash: str, token: str) -> bool:
    """Whether `token` is the one whose hash was stored (in constant time)."""
    return hmac.compare_digest(stored_hash, hash_token(token))


Finalizer = Callable[[], Awaitable[None] | None]


class Session:
    def __init__(
        self,
        manager: SessionManager,
        session_id: str,
        kind: str,
        pipeline: str | None,
        params: Mapping[str, Any],
        principal: str,
        replay_limit: int,
        pending_limit: int = 1 << 30,
    ) -> None:
        self._manager = manager
        self.id = session_id
        self.kind = kind
        self.pipeline = pipeline
        self.params = dict(params)
        self.principal = principal
        self.state = SessionState.OPENING
        self.epoch = 0
        self.turn = 0
        self._fence: Fence | None = None
        self.created_at = time.time()
        self.opened_at = manager.clock()  # on the manager's clock (leases, load-aware admission)
        self.weighed = False  # load-aware admission counts this session (set when it is admitted)
        self.span: Any = None  # its trace span (omni_rt.tracing), while tracing is on
        self.last_active = manager.clock()
        self.detached_at: float | None = None
        self.close_reason: str | None = None
        # State that outlives a request: history, KV-prefix handles, latents, episode.
        self.data: dict[str, Any] = {}
        self._kept: dict[type, Any] = {}  # the wire's own state objects, one per type (`keep`)
        self._finalizers: list[Finalizer] = []
        self._requests: dict[str, RequestStream] = {}
        self._open_ended: set[str] = set()  # requests that do not hold the idle lease (submit)
        self._token_hash: str | None = None
        self._events: deque[SessionEvent] = deque()
        self._wakeup = asyncio.Event()
        self._attach_gen = 0
        self._seq = 0
        self._replay_limit = replay_limit
        self._pending_limit = pending_limit
        self.dropped_events = 0
        self.overflowed = False  # the attached client stopped reading (slow_consumer)
        self.closed = asyncio.Event()
        # how this session's wire moves it to another node when this one drains
        # (sessions.migration); None: it finishes or ends here
        self.exporter: Exporter | None = None
        # a session that cannot move and should not be cut (a phone call, pinned to the
        # provider's socket): a drain waits for it to end, up to its deadline
        self.pinned = False

    # ---- the wire's state ---------------------------------------------------------------
    def keep(self, value: T) -> T:
        """Keep `value` as this session's state of its type (a wire's conversation, a
        call): it lives as long as the session, across reconnects. One per type."""
        self._kept[type(value)] = value
        return value

    def kept(self, cls: type[T]) -> T | None:
        """This session's state of type `cls`, or None (a session of another wire)."""
        value = self._kept.get(cls)
        return value if isinstance(value, cls) else None

    # ---- moving to another node (sessions.handoff) -------------------------------------
    def snapshot(self, node: str) -> dict[str, Any]:
        """What moves with this session besides its wire's state: who it is, its token's
        hash, its counters and, when no client is attached, the events it still holds
        (an attached client reads what is queued before it hears the session moved)."""
        from sessions import migration

        return {
            "id": self.id, "kind": self.kind, "pipeline": self.pipeline, "params": self.params, "principal": self.principal,
            "token_hash": self.token_hash, "epoch": self.epoch, "turn": self.turn, "seq": self._seq, "created_at": self.created_at,
            "from_node": node,
            "events": migration.events_state(list(self._events)) if self.state == SessionState.DETACHED else [],
            "dropped_events": self.dropped_events,
        }

    @classmethod
    def from_snapshot(cls, manager: SessionManager, core: Mapping[str, Any]) -> Session:
        """A moved session as `snapshot` left it, not yet active (`moved_in`)."""
        from sessions import migration

        sid = str(core["id"])
        s = cls(manager, sid, str(core["kind"]), core.get("pipeline"), core.get("params") or {}, str(core["principal"]),
                manager.spec.replay_buffer_events, manager.spec.max_pending_events)
        s._token_hash = str(core["token_hash"])
        s.epoch, s.turn, s._seq = int(core["epoch"]), int(core["turn"]), int(core["seq"])
        s.created_at = float(core.get("created_at") or s.created_at)
        s.dropped_events = int(core.get("dropped_events") or 0)
        s._events.extend(migration.events_of(sid, list(core.get("events") or [])))
        return s

    def moved_in(self) -> None:
        """A session restored from another node's snapshot becomes active here."""
        self._transition(SessionState.ACTIVE, "resume")

    # ---- state machine ---------------------------------------------------------------
    def _transition(self, to: SessionState, action: str) -> None:
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(self.id, self.state.value, action)
        self.state = to

    @property
    def is_open(self) -> bool:
        return self.state in (SessionState.ACTIVE, SessionState.DETACHED)

    def _require_open(self, action: str) -> None:
        if not self.is_open:
            raise IllegalTransition(self.id, self.state.value, action)

    def touch(self) -> None:
        """Client activity: restarts the idle lease."""
        self.last_active = self._manager.clock()

    # ---- resume tokens (only the hash is kept) ---------------------------------------
    def issue_resume_token(self) -> str:
        """A fresh resume token; any earlier one stops working."""
        token = secrets.token_urlsafe(24)
        self._token_hash = hash_token(token)
        return token

    def token_matches(self, token: str | None) -> bool:
        if self._token_hash is None or not token:
            return False
        return token_hash_matches(self._token_hash, token)

    @property
    def token_hash(self) -> str | None:
        return self._token_hash

    # ---- fences ----------------------------------------------------------------------
    @property
    def fence(self) -> Fence:
        # read at every hop of every chunk: the object is remade only when it changes
        f = self._fence
        if f is None or f.epoch != self.epoch or f.turn != self.turn:
            f = self._fence = Fence(self.id, self.epoch, self.turn)
        return f

    def check_fence(self, fence: Fence) -> None:
        """Reject an input that belongs to a cancelled or cleared turn."""
        if fence.session_id != self.id:
            raise StaleFence(f"input fence belongs to session '{fence.session_id}', not '{self.id}'")
        if fence.is_stale_against(self.fence):
            raise StaleFence(
                f"input is from epoch {fence.epoch}, but session '{self.id}' is at epoch {self.epoch} (the turn was cancelled)"
            )

    def advance_epoch(self) -> Fence:
        self.epoch += 1
        return self.fence

    # ---- requests --------------------------------------------------------------------
    def entry_stage(self, pipeline: str | None = None) -> str | None:
        """The entry stage of the profile served for this session's pipeline (None
        without an orchestrator or pipeline)."""
        name = pipeline or self.pipeline
        orch = self._manager.orchestrator
        profile = orch.pipelines.get(name) if orch is not None and name is not None else None
        return profile.entry if profile is not None else None

    def serves(self, stage: str) -> bool:
        """Whether this session's pipeline, as served, has `stage` among the outputs a
        request may ask for."""
        return self.pipeline is not None and self._manager.orchestrator is not None and stage in self._manager.final_outputs(self.pipeline)

    def image_limit(self) -> tuple[int, str]:
        """How many images a prompt of this session's thinker may hold (its stage's
        `engine_args.limit_mm_per_prompt.image`; 0: it sees none), and the served
        profile's name (for errors)."""
        orch = self._manager.orchestrator
        profile = orch.pipelines.get(self.pipeline) if orch is not None and self.pipeline is not None else None
        if profile is None:
            return 0, ""
        limit = 0
        for s in profile.stages:
            if s.name == "thinker":
                mm = s.engine_args.get("limit_mm_per_prompt") or {}
                limit = int(mm.get("image", 0) or 0) if isinstance(mm, Mapping) else 0
        return limit, profile.name

    def speech_outputs(self) -> set[str]:
        """The stages of this session's pipeline that speak its answers (the split
        talker's `code2wav`, or Qwen-Omni's `token2wav`, as the profile has it)."""
        if self.pipeline is None:
            return set()
        return self._manager.final_outputs(self.pipeline) & SPEECH_STAGES

    def submit(
        self,
        params: Mapping[str, Any] | None = None,
        *,
        pipeline: str | None = None,
        outputs: set[str] | None = None,
        entry: str | None = None,
        fenced: bool = True,
        open_ended: bool = False,
    ) -> RequestStream:
        """Start the next turn: an orchestrator request fenced by this session
        (`entry`: start at a later stage than the pipeline's entry).

        `fenced=False` is for work an epoch advance must not drop, such as encoding
        what the user said: a barge-in cancels the answer, not the question.
        `open_ended=True` is for a request that runs as long as the session does (a
        full-duplex conversation): it does not hold the idle lease, so a client that
        stops sending still expires after `idle_ttl_s`.
        """
        self._require_open("submit a request")
        name = pipeline or self.pipeline
        if name is None:
            raise ValueError(f"session {self.id} has no pipeline to submit to")
        self.turn += 1
        self.touch()
        fence = self.fence
        stream = self._manager.orchestrator_submit(
            name,
            fence=fence,
            params={**self.params, **(params or {})},
            request_id=f"{self.id}.t{self.turn}",
            outputs=outputs,
            affinity=self.id,
            fence_source=(lambda: self.fence) if fenced else None,
            entry=entry,
            trace_parent=self.span,
        )
        self._prune()
        self._requests[stream.request_id] = stream
        if open_ended:
            self._open_ended.add(stream.request_id)
        return stream

    def send_input(self, stream: RequestStream, payload: Payload) -> bool:
        """Feed a request of this session. Inputs with an old fence are refused."""
        self._require_open("take input")
        self.check_fence(payload.fence)
        self.touch()
        return stream.send_input(payload)

    def running_requests(self) -> list[RequestStream]:
        return [s for s in self._requests.values() if s.running]

    def holds_lease(self) -> bool:
        """A request is running that keeps the session from idling out (an answer still
        being generated; not an open-ended one)."""
        return any(s.running and rid not in self._open_ended for rid, s in self._requests.items())

    def _prune(self) -> None:
        for rid in [rid for rid, s in self._requests.items() if s.closed]:
            del self._requests[rid]
            self._open_ended.discard(rid)

    async def abort_requests(self, reason: str) -> int:
        """Abort every running request and wait for its stages to stop."""
        running = self.running_requests()
        await asyncio.gather(*(s.abort(reason) for s in running), return_exceptions=True)
        return len(running)

    async def signal(self, name: str) -> Fence:
        """commit ends the running requests' input; cancel, barge_in and clear advance
        the epoch (so every hop drops the old turn's output) and abort them."""
        if name not in SIGNALS:
            raise ValueError(f"unknown signal {name!r}; known: {', '.join(SIGNALS)}")
        self._require_open(name)
        self.touch()
        if name == "commit":
            for s in self.running_requests():
                s.end_input()
            return self.fence
        fence = self.advance_epoch()
        await self.abort_requests("turn_detected" if name == "barge_in" else "cancelled" if name == "cancel" else "cleared")
        return fence

    # ---- owned state -----------------------------------------------------------------
    def add_finalizer(self, fn: Finalizer) -> None:
        """Run `fn` when the session ends (free a latent buffer, a KV prefix, a file)."""
        self._finalizers.append(fn)

    async def _release_resources(self, reason: str) -> None:
        await self.abort_requests(reason)
        for s in list(self._requests.values()):
            await s.close()
        self._requests.clear()
        for fn in reversed(self._finalizers):
            try:
                res = fn()
                if inspect.isawaitable(res):
                    await res
            except Exception:  # noqa: BLE001 - free the rest regardless
                log.exception("session %s: finalizer failed", self.id)
        self._finalizers.clear()
        self.data.clear()

    # ---- event stream ----------------------------------------------------------------
    def emit(self, type: str, data: Mapping[str, Any] | None = None, *, fence: Fence | None = None) -> bool:
        """Queue an event for the client. Events of a cancelled turn are dropped here
        (the session hop of the fence checks). False when dropped."""
        if self.state in (SessionState.CLOSED, SessionState.OPENING):
            return False
        if fence is not None and fence.is_stale_against(self.fence):
            metrics.DROPPED_STALE.labels(hop="session").inc()
            return False
        if self.state == SessionState.ACTIVE and (self.overflowed or len(self._events) >= self._pending_limit):
            # The attached client does not read: end the session rather than let its
            # queue grow without bound (others are unaffected).
            if not self.overflowed:
                self.overflowed = True
                self._manager._slow_consumer(self)
            return False
        self._seq += 1
        self._events.append(SessionEvent(type, dict(data or {}), fence, self._seq))
        if self.state == SessionState.DETACHED:
            self._trim_replay()
        self._wakeup.set()
        return True

    def requeue(self, events: Iterable[SessionEvent]) -> None:
        """Put events a writer took but did not send back at the front (in order), for
        the next attachment's replay."""
        back = list(events)
        if back and self.state != SessionState.CLOSED:
            self._events.extendleft(reversed(back))
            if self.state == SessionState.DETACHED:
                self._trim_replay()

    def _trim_replay(self) -> None:
        while len(self._events) > self._replay_limit:
            self._events.popleft()
            self.dropped_events += 1
            metrics.SESSION_EVENTS_DROPPED.labels(kind=self.kind).inc()

    @property
    def queued_events(self) -> int:
        """Events waiting for the client (replayed on resume)."""
        return len(self._events)

    @property
    def attachment(self) -> int:
        """Changes each time a client's attachment ends (detach, takeover by a resume)."""
        return self._attach_gen

    def attached_as(self, attachment: int) -> bool:
        """True while the attachment that read `attachment` is still the session's
        active one (not detached, ended or taken over by a resume elsewhere)."""
        return self.state == SessionState.ACTIVE and self._attach_gen == attachment

    def _end_attachment(self) -> None:
        self._attach_gen += 1
        self._wakeup.set()

    async def events(self) -> AsyncIterator[SessionEvent]:
        """Events for the attached client, in order. Ends when the session detaches or
        ends (after its final `session.closed` / `session.expired` event)."""
        gen = self._attach_gen
        while True:
            while self._events and gen == self._attach_gen:
                yield self._events.popleft()
            if gen != self._attach_gen or self.state == SessionState.CLOSED:
                return
            self._wakeup.clear()
            if self._events or gen != self._attach_gen or self.state == SessionState.CLOSED:
                continue
            await self._wakeup.wait()

    # ---- introspection ---------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        now = self._manager.clock()
        return {
            "id": self.id,
            "object": "session",
            "kind": self.kind,
            "pipeline": self.pipeline,
            "principal": self.principal,
            "state": self.state.value,
            "created_at": int(self.created_at),
            "idle_s": round(now - self.last_active, 3),
            "detached_s": round(now - self.detached_at, 3) if self.detached_at is not None else None,
            "epoch": self.epoch,
            "turn": self.turn,
            "running_requests": len(self.running_requests()),
            "node": self._manager.node_id,
        }
