"""Sessions: the centre of omni-rt. Every workload is a session that is admitted,
leased, fenced and freed by one `SessionManager` (see `sessions.manager`)."""

from sessions.errors import (
    IllegalTransition,
    InvalidResumeToken,
    RateLimited,
    SessionElsewhere,
    SessionError,
    SessionGone,
    SessionLimit,
    SessionNotFound,
    StaleFence,
    StoreUnavailable,
    UnknownPipeline,
)
from sessions.manager import RESTART_REASONS, SessionManager, make_store
from sessions.session import END_EVENTS, SIGNALS, Session, SessionEvent, SessionState
from sessions.store import Limits, MemoryStore, SessionStore, Slot

__all__ = [
    "END_EVENTS",
    "RESTART_REASONS",
    "IllegalTransition",
    "InvalidResumeToken",
    "Limits",
    "RateLimited",
    "MemoryStore",
    "SIGNALS",
    "Session",
    "SessionElsewhere",
    "SessionError",
    "SessionEvent",
    "SessionGone",
    "SessionLimit",
    "SessionManager",
    "SessionNotFound",
    "SessionState",
    "SessionStore",
    "Slot",
    "StaleFence",
    "StoreUnavailable",
    "UnknownPipeline",
    "make_store",
]
