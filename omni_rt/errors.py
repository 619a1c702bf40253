"""omni-rt's errors: one base that says how every wire reports it.

Every error the server raises on purpose is an `OmniError`. It carries

- `code`: the stable machine-readable name that goes on the wire,
- `http_status` (and extra `headers`, e.g. `retry-after`),
- `ws_close`: the WebSocket close code for a protocol whose errors end the socket,
- `type`: OpenAI's error type (`invalid_request_error` for the caller's fault,
  `server_error` for ours),
- `param`: the request field it is about, if any,
- `expose`: whether `message` is safe to show the client.

The protocol adapters map it in one place (`protocols.errors`). It deliberately does not
derive from `RuntimeError`: a transport disconnect is recognised only by the
transport's own exception, never by catching a broad built-in type that core errors
share.

At the engine edge the errors follow vLLM's split:
- `EngineRequestError`: the engine refused this request (bad prompt, bad sampling):
  reported to the client as is.
- `EngineDead`: the engine is gone; the stage is unhealthy (`/health` says so) and new
  work is refused with 503 until it is back.
- anything else raised inside an engine or a stage is an internal error: logged with
  its traceback, and the client hears only a generic message (`InternalError`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# RFC 6455 close codes used by the adapters.
WS_NORMAL = 1000
WS_GOING_AWAY = 1001
WS_POLICY_VIOLATION = 1008
WS_INTERNAL_ERROR = 1011
WS_SERVICE_RESTART = 1012
WS_TRY_AGAIN_LATER = 1013

CLIENT = "invalid_request_error"
SERVER = "server_error"


class OmniError(Exception):
    code: str = "internal_error"
    http_status: int = 500
    ws_close: int = WS_INTERNAL_ERROR
    type: str = SERVER
    expose: bool = True

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        http_status: int | None = None,
        type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers: dict[str, str] = dict(headers or {})
        # instance overrides of the class defaults
        if code is not None:
            self.code = code
        if http_status is not None:
            self.http_status = http_status
        if type is not None:
            self.type = type

    def public_message(self) -> str:
        return self.message if self.expose else "internal error"

    def wire(self) -> dict[str, Any]:
        """The OpenAI error object: {type, code, message, param}."""
        return {"type": self.type, "code": self.code, "message": self.public_message(), "param": self.param}


class ClientError(OmniError):
    """The caller's own fault (bad field, bad frame): reported as is; on sockets that
    stay open it is an error event, on those whose errors end the socket, 1008."""

    code = "invalid_value"
    http_status = 400
    ws_close = WS_POLICY_VIOLATION
    type = CLIENT


class ContextLengthExceeded(ClientError):
    """The prompt does not fit the model's context (OpenAI's code and param)."""

    code = "context_length_exceeded"

    def __init__(self, tokens: int, limit: int) -> None:
        self.tokens, self.limit = tokens, limit
        super().__init__(
            f"This model's maximum context length is {limit} tokens. However, your messages resulted in {tokens} tokens. "
            "Please reduce the length of the messages.",
            param="messages",
        )


class NotFound(ClientError):
    code = "not_found"
    http_status = 404


class InternalError(OmniError):
    """A fault of ours. The real cause is logged; the client hears a generic message."""

    code = "internal_error"
    expose = False


class StageError(OmniError):
    """A stage failed in a way the client should hear about (the message is user-safe;
    often it is the client's own input that the stage could not use)."""

    code = "generation_failed"


class EngineError(OmniError):
    """An engine could not do what was asked (not started, stopped, a failed step).
    Its message names engine internals, so the client hears a generic one."""

    code = "engine_error"
    expose = False


class EngineRequestError(EngineError):
    """The engine refused this request (bad prompt or sampling): reported as is."""

    code = "invalid_request"
    expose = True


class CapacityExceeded(OmniError):
    """A stage's own real-time check refuses one more session (a full-duplex model's
    frame budget): the caller is told `capacity` (429 / close 1013) with retry-after.
    `live`: the sessions it already runs."""

    code = "capacity"
    http_status = 429
    ws_close = WS_TRY_AGAIN_LATER
    type = "requests"

    def __init__(self, message: str, live: int = 0, **kw: Any) -> None:
        kw.setdefault("headers", {"retry-after": "5"})
        super().__init__(message, **kw)
        self.live = live


class EngineDead(EngineError):
    """The engine is gone: its stage refuses new work with 503 until it is back."""

    code = "engine_unavailable"
    http_status = 503
    expose = True
    ws_close = WS_TRY_AGAIN_LATER

    def __init__(self, message: str, **kw: Any) -> None:
        kw.setdefault("headers", {"retry-after": "5"})
        super().__init__(message, **kw)


class StageUnavailable(EngineDead):
    """A stage replica placed outside the server (a Ray actor) is gone or unreachable:
    the request running on it fails with this; the session goes on, and its next
    request goes to a live replica (or the restarted one)."""

    code = "stage_unavailable"


class ConnectorError(OmniError):
    """A handle that cannot be resolved (already consumed, cleaned up, foreign)."""

    code = "connector_error"
    expose = False


class OrchestratorError(OmniError):
    """A request the stage graph cannot take (unknown pipeline, unreachable outputs)."""

    code = "orchestrator_error"
    expose = False


class RequestAborted(OmniError):
    """The request was stopped (cancel, barge-in, the session ended) before it finished."""

    code = "session_closed"
    http_status = 503
    ws_close = WS_GOING_AWAY

    def __init__(self, reason: str | None) -> None:
        super().__init__(f"request aborted ({reason or 'aborted'})")
        self.reason = reason


__all__ = [
    "CapacityExceeded",
    "ClientError",
    "ConnectorError",
    "ContextLengthExceeded",
    "EngineDead",
    "EngineError",
    "EngineRequestError",
    "InternalError",
    "NotFound",
    "OmniError",
    "OrchestratorError",
    "RequestAborted",
    "StageError",
    "StageUnavailable",
    "WS_GOING_AWAY",
    "WS_INTERNAL_ERROR",
    "WS_NORMAL",
    "WS_POLICY_VIOLATION",
    "WS_TRY_AGAIN_LATER",
]
