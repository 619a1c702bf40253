"""Ray object-store connector: payloads travel as Ray objects, handles carry their
`ObjectRef`.

`put` stores the payload with `ray.put` (numpy arrays out of band: a reader on the same
node maps them from the node's shared-memory object store without a copy, one on
another node gets them by Ray's transfer) and returns a handle holding the reference.
`get` / `aget` read it. A payload of at most `inline_max_bytes` (Ray's own limit for
inlining task arguments and returns, 100 KiB) travels inside its handle instead, as Ray
itself carries small objects inside the calls that pass them: a chunk of codec tokens
or of audio then costs no object-store round trip (create, seal, a reader's fetch
through the raylet) on either side. The process that put an object owns it and keeps its reference
until `cleanup(request_id)`: Ray frees an object once its owner and every borrower
dropped it, and a reference that only travels inside another object (a handle
streamed back by a stage's actor) may reach its reader after the owner let go
(Ray reports a ReferenceCountingAssertionError then). A request's objects put in
other processes are freed with it too: `on_cleanup` registers what to call there (a
remote stage's actor frees its own). Every process that puts or gets must be
connected to Ray (the server connects when a stage is placed outside it,
`omni_rt.placement`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from omni_rt.connectors.base import Connector, ConnectorError
from omni_rt.payloads import Handle, Payload

log = logging.getLogger("omni_rt.connectors.ray")

GET_TIMEOUT_S = 60.0  # an object that does not arrive in this long is reported lost
INLINE_MAX_BYTES = 100 * 1024  # Ray's max_direct_call_object_size


class RayConnector(Connector):
    def __init__(self, name: str = "ray", inline_max_bytes: int = INLINE_MAX_BYTES) -> None:
        self.name = name
        self.inline_max_bytes = inline_max_bytes
        self._lock = threading.Lock()
        self._held: dict[str, dict[str, Any]] = {}  # request_id -> key -> ObjectRef (None: inline), until cleanup
        self._on_cleanup: dict[str, list[Callable[[], Any]]] = {}
        self.puts = 0
        self.inlined = 0
        self.gets = 0

    def put(self, request_id: str, key: str, payload: Payload, readers: int = 1) -> Handle:
        import ray

        if readers < 1:
            raise ValueError("readers must be >= 1")
        if not ray.is_initialized():
            raise ConnectorError(f"connector {self.name}: this process is not connected to Ray")
        inline = payload.nbytes <= self.inline_max_bytes
        ref = None if inline else ray.put(payload)
        with self._lock:
            keys = self._held.setdefault(request_id, {})
            if key in keys:
                raise ConnectorError(f"key {key!r} already stored for request {request_id!r}")
            keys[key] = ref
            self.puts += 1
            if inline:
                self.inlined += 1
        locator = {"payload": payload} if inline else {"ref": ref}
        return Handle(self.name, request_id, key, payload.kind, payload.fence, payload.nbytes, readers, locator=locator)

    def _inline(self, handle: Handle) -> Payload | None:
        return (handle.locator or {}).get("payload")

    def _ref(self, handle: Handle) -> Any:
        ref = (handle.locator or {}).get("ref")
        if ref is None:
            raise ConnectorError(f"connector {self.name}: handle {handle.request_id}/{handle.key} carries no object reference")
        return ref

    def _got(self, handle: Handle, payload: Any) -> Payload:
        if not isinstance(payload, Payload):
            raise ConnectorError(f"connector {self.name}: {handle.request_id}/{handle.key} is not a payload")
        with self._lock:
            self.gets += 1
        return payload

    def _lost(self, handle: Handle, exc: BaseException) -> ConnectorError:
        # the owner died and the object was lost, or it never arrived: the reader is told which
        return ConnectorError(f"connector {self.name}: {handle.request_id}/{handle.key} could not be read: {type(exc).__name__}: {exc}")

    def get(self, handle: Handle) -> Payload:
        import ray

        if (inline := self._inline(handle)) is not None:
            return self._got(handle, inline)
        try:
            payload = ray.get(self._ref(handle), timeout=GET_TIMEOUT_S)
        except ConnectorError:
            raise
        except Exception as exc:  # noqa: BLE001 - see _lost
            raise self._lost(handle, exc) from None
        return self._got(handle, payload)

    async def aget(self, handle: Handle) -> Payload:
        if (inline := self._inline(handle)) is not None:
            return self._got(handle, inline)
        try:
            payload = await asyncio.wait_for(self._ref(handle), GET_TIMEOUT_S)  # an ObjectRef is awaitable
        except ConnectorError:
            raise
        except Exception as exc:  # noqa: BLE001 - see _lost
            raise self._lost(handle, exc) from None
        return self._got(handle, payload)

    def on_cleanup(self, request_id: str, fn: Callable[[], Any]) -> None:
        """Call `fn` when the request is cleaned up (it frees the request's objects put
        in another process)."""
        with self._lock:
            self._on_cleanup.setdefault(request_id, []).append(fn)

    def cleanup(self, request_id: str) -> int:
        with self._lock:
            held = self._held.pop(request_id, None)
            calls = self._on_cleanup.pop(request_id, [])
        for fn in calls:
            try:
                fn()
            except Exception:  # noqa: BLE001 - a peer that is gone holds nothing any more
                log.debug("connector %s: a cleanup call for %s failed", self.name, request_id, exc_info=True)
        return len(held) if held else 0

    def live_keys(self) -> int:
        with self._lock:
            return sum(len(k) for k in self._held.values())

    def close(self) -> None:
        with self._lock:
            self._held.clear()
            self._on_cleanup.clear()

    def health(self) -> dict[str, Any]:
        import ray

        return {"ok": ray.is_initialized(), "backend": "ray", "live_keys": self.live_keys(), "requests": len(self._held), "puts": self.puts,
                "inlined": self.inlined, "gets": self.gets}
