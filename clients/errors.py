"""The error forms omni-rt's clients raise: an HTTP answer other than 200, and an
`error` event of a WebSocket protocol."""

from __future__ import annotations

from typing import Any

import httpx


class HttpApiError(RuntimeError):
    """The server refused or failed an HTTP call; `code` comes from its
    ``{"error": {...}}`` body when it sent one."""

    def __init__(self, status: int, body: Any) -> None:
        err = body.get("error", {}) if isinstance(body, dict) else {}
        super().__init__(f"{status}: {err.get('message', body)}")
        self.status = status
        self.code = err.get("code")

    @classmethod
    def from_response(cls, r: httpx.Response) -> HttpApiError:
        try:
            body: Any = r.json()
        except ValueError:
            body = r.text
        return cls(r.status_code, body)


class ErrorEvent(RuntimeError):
    """The server sent ``{"type": "error", "error": {"code", "message", ...}}``."""

    def __init__(self, event: dict[str, Any]) -> None:
        err = event.get("error") or {}
        super().__init__(f"{err.get('code')}: {err.get('message')}")
        self.event = event
        self.code = err.get("code")
