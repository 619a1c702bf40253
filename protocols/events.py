"""JSON event sockets in the style of the Realtime API (`/v1/world`, the live video
socket): client events are JSON objects with a string `type`; errors go back as
`error` events in OpenAI's shape and the socket stays open."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omni_rt.errors import ClientError, OmniError
from protocols.errors import error_event
from protocols.wire_json import load_json


class EventError(ClientError):
    """A bad client event: `message`, `code` and the field it is about."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None) -> None:
        super().__init__(message, code=code, param=param)


def prompt_token_error(count: Callable[[str], int] | None, limit: int | None, prompt: str) -> str | None:
    """Why `prompt` is refused (longer than the model's text encoder reads), or None.
    `count` is the stage's `prompt_tokens` (None where the stage does not say)."""
    if count is None or not limit or not prompt:
        return None
    n = count(prompt)
    if n <= limit:
        return None
    return f"The prompt is {n} text tokens; this model reads at most {limit} (its max_sequence_length). Shorten the prompt."


class JsonEvents:
    """Reading client events and answering errors, for adapters with an
    `emit(type, **data)`."""

    def emit(self, type: str, **data: Any) -> None:
        raise NotImplementedError

    def error(self, err: OmniError, event_id: Any = None) -> None:
        self.emit("error", error=error_event(err, event_id)["error"])

    def read_event(self, raw: str | bytes) -> dict[str, Any] | None:
        """The event, or None once the client has been told why it is not one."""
        try:
            ev = load_json(raw)
        except ClientError as err:
            self.error(err)
            return None
        if not isinstance(ev, dict) or not isinstance(ev.get("type"), str):
            self.error(EventError("An event is a JSON object with a string 'type'.", "invalid_event", "type"))
            return None
        return ev
