"""Moving a live session between nodes: the state blob a draining node writes to the
session store and the node the client resumes on reads back.

A blob is msgpack: ``{"format": FORMAT, "version": STATE_VERSION, "session": {...},
"state": {...}}``. ``session`` is what every session has (id, kind, pipeline, params,
principal, the resume token's hash, epoch / turn, the event sequence, the events the
client has not read yet, for replay); ``state`` is what the session's wire keeps (a
duplex conversation's config and items, a world rollout's latents), handed over by
the wire's exporter and given back to its restorer. numpy arrays travel as their
dtype, shape and bytes, so latents come back bit for bit.

A blob is bounded (`sessions.migration_max_bytes`); one over the bound, of another
format or version, or that does not decode is refused with a `MigrationError` and
nothing is restored from it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from omni_rt.errors import SERVER
from omni_rt.payloads import Fence
from sessions.errors import SessionError
from sessions.session import SessionEvent

if TYPE_CHECKING:
    from sessions.session import Session

FORMAT = "omni-rt.session"
STATE_VERSION = 1
_ARRAY = 1  # msgpack ext type of a numpy array: [dtype, shape, bytes]

# A wire's exporter: given the seconds left before the drain's deadline, it waits for a
# clean point (the end of the answer in progress, a world step) and returns the state to
# move, or None when the session ends here instead (nothing worth moving).
Exporter = Callable[[float], Awaitable[dict[str, Any] | None]]
# A wire's restorer: rebuilds the wire's objects in a freshly adopted session from the
# state its exporter returned; raises (ValueError, KeyError, ...) on a state it cannot use.
Restorer = Callable[["Session", dict[str, Any]], None]


class MigrationError(SessionError):
    """A moved session's state cannot be restored here (another version, corrupt, too
    large, a pipeline or wire this node does not serve)."""

    code = "session_not_restorable"
    http_status = 409


class MigrationFailed(MigrationError):
    """Restoring failed on our side; nothing of it was kept."""

    code = "session_restore_failed"
    http_status = 500
    type = SERVER


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError("arrays of Python objects cannot move")
        return msgpack.ExtType(_ARRAY, msgpack.packb([obj.dtype.str, list(obj.shape), np.ascontiguousarray(obj).tobytes()]))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (tuple, set, frozenset)):
        return list(obj)
    raise TypeError(f"{type(obj).__name__} cannot move with a session")


def _ext(code: int, data: bytes) -> Any:
    if code != _ARRAY:
        return msgpack.ExtType(code, data)
    dtype, shape, raw = msgpack.unpackb(data)
    return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()


def events_state(events: list[SessionEvent]) -> list[list[Any]]:
    return [[e.type, dict(e.data), None if e.fence is None else [e.fence.epoch, e.fence.turn], e.seq] for e in events]


def events_of(session_id: str, rows: list[Any]) -> list[SessionEvent]:
    out = []
    for type_, data, fence, seq in rows:
        f = None if fence is None else Fence(session_id, int(fence[0]), int(fence[1]))
        out.append(SessionEvent(str(type_), dict(data), f, int(seq)))
    return out


def encode(session: Mapping[str, Any], state: Mapping[str, Any], max_bytes: int) -> bytes:
    """The blob; MigrationError when it is over `max_bytes` or holds what cannot move."""
    try:
        blob: bytes = msgpack.packb({"format": FORMAT, "version": STATE_VERSION, "session": dict(session), "state": dict(state)}, default=_default)
    except (TypeError, ValueError) as exc:
        raise MigrationError(f"Session '{session.get('id')}' holds state that cannot move: {exc}.") from None
    if len(blob) > max_bytes:
        raise MigrationError(f"Session '{session.get('id')}' state is {len(blob)} bytes, over sessions.migration_max_bytes ({max_bytes}).")
    return blob


def decode(session_id: str, blob: bytes, max_bytes: int) -> dict[str, Any]:
    """The blob read back and checked: its format, version and session id."""
    if len(blob) > max_bytes:
        raise MigrationError(f"Session '{session_id}' state is {len(blob)} bytes, over sessions.migration_max_bytes ({max_bytes}).")
    try:
        doc = msgpack.unpackb(blob, ext_hook=_ext, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - any decoding failure is the same refusal
        raise MigrationError(f"Session '{session_id}' was moved, but its state does not decode ({type(exc).__name__}).") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise MigrationError(f"Session '{session_id}' was moved, but its state is not an omni-rt session state.")
    if doc.get("version") != STATE_VERSION:
        raise MigrationError(
            f"Session '{session_id}' was moved by a node writing session state version {doc.get('version')!r}; this node reads "
            f"version {STATE_VERSION}. Resume it on a node of the same release."
        )
    core, state = doc.get("session"), doc.get("state")
    if not isinstance(core, dict) or core.get("id") != session_id or not isinstance(state, dict):
        raise MigrationError(f"Session '{session_id}' was moved, but its state names another session.")
    return doc
