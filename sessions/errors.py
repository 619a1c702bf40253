"""Session errors. Each names the problem; protocol adapters map them to wire errors."""

from __future__ import annotations


class SessionError(Exception):
    """Base class. `code` is the stable machine-readable name adapters put on the wire."""

    code = "session_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class SessionLimit(SessionError):
    """Admission refused: a cap is full. `scope` is total, kind or principal."""

    code = "session_limit"

    def __init__(self, scope: str, kind: str, cap: int, retry_after_s: int) -> None:
        what = {"total": "sessions in total", "kind": f"'{kind}' sessions", "principal": "sessions for this principal"}[scope]
        super().__init__(f"Session limit reached: at most {cap} {what} may be open at once; retry later.")
        self.scope = scope
        self.kind = kind
        self.cap = cap
        self.retry_after_s = retry_after_s


class StoreUnavailable(SessionError):
    """The session store (Redis) cannot be reached: no new admissions."""

    code = "session_store_unavailable"


class SessionNotFound(SessionError):
    code = "session_not_found"

    def __init__(self, session_id: str) -> None:
        super().__init__(f"No session '{session_id}' exists.")
        self.session_id = session_id


class SessionGone(SessionError):
    """The session existed but is over (closed, expired, evicted)."""

    code = "session_gone"

    def __init__(self, session_id: str, reason: str) -> None:
        super().__init__(f"Session '{session_id}' is over ({reason}); open a new one.")
        self.session_id = session_id
        self.reason = reason


class InvalidResumeToken(SessionError):
    code = "invalid_resume_token"

    def __init__(self, session_id: str, missing: bool = False) -> None:
        what = "is required" if missing else "does not match"
        super().__init__(f"The resume token for session '{session_id}' {what}.")
        self.session_id = session_id


class SessionElsewhere(SessionError):
    """The session lives on another node (redis store): the client should go there."""

    code = "session_elsewhere"

    def __init__(self, session_id: str, node: str, url: str | None) -> None:
        where = f"node {node}" + (f" ({url})" if url else "")
        super().__init__(f"Session '{session_id}' lives on {where}; reconnect there.")
        self.session_id = session_id
        self.node = node
        self.url = url


class IllegalTransition(SessionError):
    code = "invalid_session_state"

    def __init__(self, session_id: str, state: str, action: str) -> None:
        super().__init__(f"Session '{session_id}' is {state}; cannot {action}.")
        self.session_id = session_id
        self.state = state
        self.action = action


class StaleFence(SessionError):
    """An input carrying the fence of a turn that was cancelled or cleared."""

    code = "stale_fence"


class UnknownPipeline(SessionError):
    code = "unknown_pipeline"
