"""The client side of one orchestrator request.

Protocol adapters (and tests) hold a `RequestStream`: they send entry-stage inputs,
read outputs, and abort. Resolving handles into payloads happens here, on the client
side, so the orchestrator itself never carries bytes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from omni_rt import metrics
from omni_rt.errors import InternalError, RequestAborted
from omni_rt.orchestrator import DoneEvent, Event, OutputEvent
from omni_rt.payloads import Payload
from omni_rt.status import RequestStatus

if TYPE_CHECKING:
    from omni_rt.orchestrator import Orchestrator, _RequestState

__all__ = ["RequestAborted", "RequestStream"]


class RequestStream:
    def __init__(self, orch: Orchestrator, state: _RequestState) -> None:
        self._orch = orch
        self._state = state
        self._inputs = 0
        self.dropped_stale = 0
        self.done: DoneEvent | None = None
        self.closed = False

    @property
    def request_id(self) -> str:
        return self._state.request_id

    @property
    def running(self) -> bool:
        return self._state.status is RequestStatus.RUNNING

    # ---- input ---------------------------------------------------------------------
    def send_input(self, payload: Payload, connector: str = "inproc") -> bool:
        """Feed the entry stage. Returns False when the request no longer takes input."""
        conn = self._orch.connectors[connector]
        handle = conn.put(self.request_id, f"input/{self._inputs}", payload)
        self._inputs += 1
        if not self._orch.push_input(self.request_id, handle):
            conn.get(handle)  # consume it again so nothing is left behind
            return False
        return True

    def end_input(self) -> None:
        self._orch.end_input(self.request_id)

    # ---- output --------------------------------------------------------------------
    async def events(self) -> AsyncIterator[Event]:
        """Raw events: handles and the final DoneEvent."""
        while self.done is None:
            ev = await self._state.events.get()
            if isinstance(ev, DoneEvent):
                self.done = ev
            yield ev

    async def payloads(self) -> AsyncIterator[tuple[str, Payload, bool]]:
        """(stage, payload, last) for every client output. A failed request raises the
        error its client is told (an `OmniError`), an aborted one `RequestAborted`."""
        async for ev in self.events():
            if isinstance(ev, OutputEvent):
                current = self._state.current_fence()
                # Last fence check before the client (on the handle, before any read):
                # the epoch may have advanced since the orchestrator routed this chunk.
                if current is not None and ev.handle.fence.is_stale_against(current):
                    self.dropped_stale += 1
                    metrics.DROPPED_STALE.labels(hop="client").inc()
                    continue
                if self._state.status in (RequestStatus.ABORTED, RequestStatus.FAILED):
                    continue  # its keys are already freed; the DoneEvent follows
                payload = await self._orch.connectors[ev.handle.connector].aget(ev.handle)
                yield ev.stage, payload, ev.last
            elif ev.status is RequestStatus.FAILED:
                raise ev.error or InternalError("request failed")
            elif ev.status is RequestStatus.ABORTED:
                raise RequestAborted(ev.reason)

    # ---- lifecycle -----------------------------------------------------------------
    async def abort(self, reason: str = "aborted") -> None:
        await self._orch.abort(self.request_id, reason)

    async def close(self) -> None:
        """Finish with the request: abort it if it still runs, then free its keys."""
        if self._state.status is RequestStatus.RUNNING:
            await self._orch.abort(self.request_id, "client_closed")
        self._orch.release(self.request_id)
        self.closed = True

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
