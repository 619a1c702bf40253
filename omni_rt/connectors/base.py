"""The narrow connector interface: put / get / cleanup / health.

A connector moves payload bytes between stages. It never interprets what it carries;
only the `Handle` it returns travels through the orchestrator's control queues.
"""

from __future__ import annotations

import abc
from typing import Any

from omni_rt.errors import ConnectorError
from omni_rt.payloads import Handle, Payload

__all__ = ["Connector", "ConnectorError"]


class Connector(abc.ABC):
    """Moves payloads between stages.

    `readers` is how many `get` calls will be made for a handle; the payload is freed
    after the last one. `cleanup(request_id)` frees whatever a request still holds
    (abort, disconnect, eviction) and returns how many keys it freed.
    """

    name: str

    @abc.abstractmethod
    def put(self, request_id: str, key: str, payload: Payload, readers: int = 1) -> Handle: ...

    @abc.abstractmethod
    def get(self, handle: Handle) -> Payload: ...

    async def aget(self, handle: Handle) -> Payload:
        """`get` for the event loop: a backend whose read may wait (a transfer from
        another node) waits without blocking the loop. By default, `get`."""
        return self.get(handle)

    @abc.abstractmethod
    def cleanup(self, request_id: str) -> int: ...

    @abc.abstractmethod
    def health(self) -> dict[str, Any]: ...

    def close(self) -> None:  # noqa: B027 - optional hook: most backends hold nothing to free
        """Free everything (server shutdown)."""
