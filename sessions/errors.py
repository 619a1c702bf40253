"""Session errors. Each names the problem and, as every `OmniError`, how the wires
report it (HTTP status, WebSocket close code); adapters map them in one place."""

from __future__ import annotations

from collections.abc import Mapping

from omni_rt.errors import CLIENT, SERVER, WS_POLICY_VIOLATION, WS_TRY_AGAIN_LATER, OmniError


class SessionError(OmniError):
    """Base class. `code` is the stable machine-readable name adapters put on the wire."""

    code = "session_error"
    http_status = 400
    ws_close = WS_POLICY_VIOLATION
    type = CLIENT

    def __init__(self, message: str, *, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message, headers=headers)


class SessionLimit(SessionError):
    """Admission refused: a cap is full. `scope` is total, kind or principal."""

    code = "session_limit"
    http_status = 429
    ws_close = WS_TRY_AGAIN_LATER
    type = "requests"

    def __init__(self, scope: str, kind: str, cap: int, retry_after_s: int) -> None:
        what = {"total": "sessions in total", "kind": f"'{kind}' sessions", "principal": "sessions for this principal"}[scope]
        super().__init__(
            f"Session limit reached: at most {cap} {what} may be open at once; retry later.",
            headers={"retry-after": str(retry_after_s)},
        )
        self.scope = scope
        self.kind = kind
        self.cap = cap
        self.retry_after_s = retry_after_s


class CapacityLimit(SessionLimit):
    """Admission refused by load: one more real-time session would push generation
    past the configured real-time factor (sessions.realtime_admission)."""

    code = "capacity"

    def __init__(
        self,
        kind: str,
        sessions: int,
        predicted_rtf: float,
        target_rtf: float,
        retry_after_s: int,
        *,
        cpu: float | None = None,
        max_cpu: float | None = None,
        outside: float = 0.0,
        throttled: float | None = None,
        hole: float | None = None,
        why: list[str] | None = None,
    ) -> None:
        cpus = f", its CPUs {cpu:.0%} busy (at most {max_cpu:.0%})" if cpu is not None and max_cpu is not None else ""
        if outside > 0:
            cpus += f", {outside:.0%} of its CPUs taken by other processes"
        if throttled is not None and "throttled" in (why or []):
            cpus += f", its container CPU-throttled in {throttled:.0%} of periods"
        if hole is not None and "late_audio" in (why or []):
            cpus += f", and a session's answer just went silent for {hole * 1000:.0f} ms waiting for its audio"
        because = f" [{', '.join(why)}]" if why else ""
        SessionError.__init__(
            self,
            f"Server at real-time capacity{because}: with {sessions} '{kind}'-class session(s) running, one more would generate at "
            f"{predicted_rtf:.2f}x real time (target {target_rtf:.2f}){cpus}; retry in {retry_after_s} s.",
            headers={"retry-after": str(retry_after_s)},
        )
        self.why = list(why or [])
        self.scope = "capacity"
        self.kind = kind
        self.cap = sessions
        self.retry_after_s = retry_after_s
        self.predicted_rtf = predicted_rtf


class Draining(CapacityLimit):
    """Admission refused: this node is draining (its sessions are moving to other
    nodes); another node takes new sessions."""

    def __init__(self, kind: str, retry_after_s: int, what: str | None = None) -> None:
        SessionError.__init__(
            self,
            f"This node is draining for a restart and admits no {what or f'new {kind!r} session'}; retry in {retry_after_s} s "
            "(another node takes it).",
            headers={"retry-after": str(retry_after_s)},
        )
        self.scope = "capacity"
        self.kind = kind
        self.cap = 0
        self.retry_after_s = retry_after_s


class StoreUnavailable(SessionError):
    """The session store (Redis) cannot be reached: no new admissions."""

    code = "session_store_unavailable"
    http_status = 503
    ws_close = WS_TRY_AGAIN_LATER
    type = SERVER

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"retry-after": "5"})


class SessionNotFound(SessionError):
    code = "session_not_found"
    http_status = 404

    def __init__(self, session_id: str) -> None:
        super().__init__(f"No session '{session_id}' exists.")
        self.session_id = session_id


class FrameCapacity(CapacityLimit):
    """Admission refused by a pipeline's own real-time check: one more conversation
    would not fit the model's frame budget (`pipelines.moshi`)."""

    def __init__(self, kind: str, sessions: int, why: str, retry_after_s: int) -> None:
        SessionError.__init__(self, f"Server at real-time capacity: {why}; retry in {retry_after_s} s.", headers={"retry-after": str(retry_after_s)})
        self.scope = "capacity"
        self.kind = kind
        self.cap = sessions
        self.retry_after_s = retry_after_s


class SessionGone(SessionError):
    """The session existed but is over (closed, expired, evicted)."""

    code = "session_gone"
    http_status = 410

    def __init__(self, session_id: str, reason: str) -> None:
        super().__init__(f"Session '{session_id}' is over ({reason}); open a new one.")
        self.session_id = session_id
        self.reason = reason


class InvalidResumeToken(SessionError):
    code = "invalid_resume_token"
    http_status = 403

    def __init__(self, session_id: str, missing: bool = False) -> None:
        what = "is required" if missing else "does not match"
        super().__init__(f"The resume token for session '{session_id}' {what}.")
        self.session_id = session_id


class SessionElsewhere(SessionError):
    """The session lives on another node (redis store): the client should go there."""

    code = "session_elsewhere"
    http_status = 409

    def __init__(self, session_id: str, node: str, url: str | None) -> None:
        where = f"node {node}" + (f" ({url})" if url else "")
        super().__init__(f"Session '{session_id}' lives on {where}; reconnect there.", headers={"location": url} if url else None)
        self.session_id = session_id
        self.node = node
        self.url = url


class IllegalTransition(SessionError):
    code = "invalid_session_state"
    http_status = 409

    def __init__(self, session_id: str, state: str, action: str) -> None:
        super().__init__(f"Session '{session_id}' is {state}; cannot {action}.")
        self.session_id = session_id
        self.state = state
        self.action = action


class StaleFence(SessionError):
    """An input carrying the fence of a turn that was cancelled or cleared."""

    code = "stale_fence"
    http_status = 409


class UnknownPipeline(SessionError):
    code = "unknown_pipeline"
    http_status = 404


class RateLimited(SessionLimit):
    """A principal's rate (sessions.rate_limits) is spent for now: 429 with the seconds
    until enough has come back."""

    code = "rate_limit_exceeded"

    def __init__(self, principal: str, what: str, per_minute: float, retry_after_s: int) -> None:
        SessionError.__init__(
            self,
            f"Rate limit reached for {principal!r}: {per_minute:g} {what} per minute; retry in {retry_after_s} s.",
            headers={"retry-after": str(retry_after_s)},
        )
        self.retry_after_s = retry_after_s
