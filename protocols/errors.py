"""The one place where errors become wire errors.

Every adapter reports a failure through these functions, so an `OmniError` means the
same thing on every wire: its `http_status` (+ headers such as `retry-after`) on HTTP,
its OpenAI error object in an `error` event on the JSON sockets, its `ws_close` code
where a protocol ends the socket on errors (OpenPI). Anything that is not an
`OmniError` is a fault of ours: logged here with its traceback, and the client hears
only a generic internal error.
"""

from __future__ import annotations

import logging
from typing import Any

from omni_rt.errors import InternalError, OmniError

log = logging.getLogger("protocols.errors")


def to_omni(exc: BaseException, where: str = "") -> OmniError:
    """`exc` as the error its client is told. Unexpected exceptions are logged with
    their traceback (`where` says what failed)."""
    if isinstance(exc, OmniError):
        return exc
    log.error("unexpected error%s", f" in {where}" if where else "", exc_info=exc)
    return InternalError(f"{type(exc).__name__}: {exc}")


def error_body(exc: OmniError) -> dict[str, Any]:
    """OpenAI's HTTP error body: {"error": {message, type, param, code}}."""
    e = exc.wire()
    return {"error": {"message": e["message"], "type": e["type"], "param": e["param"], "code": e["code"]}}


def error_event(exc: OmniError, event_id: str | None = None) -> dict[str, Any]:
    """The Realtime `error` event (also used by /v1/duplex, /v1/world and the video
    socket): {type: "error", error: {type, code, message, param, event_id}}."""
    return {"type": "error", "error": {**exc.wire(), "event_id": event_id}}


def close_reason(exc: OmniError) -> str:
    """A WebSocket close reason (at most 123 bytes of UTF-8)."""
    return exc.code.encode()[:123].decode(errors="ignore")
