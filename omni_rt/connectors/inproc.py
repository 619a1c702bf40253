"""Same-process connector: hands over the payload object itself, zero copy."""

from __future__ import annotations

import threading
from typing import Any

from omni_rt.connectors.base import Connector, ConnectorError
from omni_rt.payloads import Handle, Payload


class InprocConnector(Connector):
    def __init__(self, name: str = "inproc") -> None:
        self.name = name
        # request_id -> key -> [payload, readers_left]
        self._store: dict[str, dict[str, list[Any]]] = {}
        # put/get may be called from engine threads as well as the event loop.
        self._lock = threading.Lock()
        self.puts = 0
        self.gets = 0

    def put(self, request_id: str, key: str, payload: Payload, readers: int = 1) -> Handle:
        if readers < 1:
            raise ValueError("readers must be >= 1")
        with self._lock:
            keys = self._store.setdefault(request_id, {})
            if key in keys:
                raise ConnectorError(f"key {key!r} already stored for request {request_id!r}")
            keys[key] = [payload, readers]
            self.puts += 1
        return Handle(self.name, request_id, key, payload.kind, payload.fence, payload.nbytes, readers)

    def get(self, handle: Handle) -> Payload:
        with self._lock:
            keys = self._store.get(handle.request_id)
            entry = keys.get(handle.key) if keys else None
            if entry is None:
                raise ConnectorError(f"no payload for {handle.request_id}/{handle.key} (consumed or cleaned up)")
            entry[1] -= 1
            if entry[1] <= 0:
                del keys[handle.key]  # type: ignore[union-attr]
                if not keys:
                    del self._store[handle.request_id]
            self.gets += 1
            return entry[0]

    def cleanup(self, request_id: str) -> int:
        with self._lock:
            keys = self._store.pop(request_id, None)
        return len(keys) if keys else 0

    def live_keys(self) -> int:
        with self._lock:
            return sum(len(k) for k in self._store.values())

    def health(self) -> dict[str, Any]:
        return {"ok": True, "backend": "inproc", "live_keys": self.live_keys(), "requests": len(self._store)}

    def close(self) -> None:
        with self._lock:
            self._store.clear()
