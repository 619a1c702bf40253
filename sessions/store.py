"""Session stores: where admission slots and the session directory live.

A store answers three questions atomically: may this session take a slot (caps:
total, per kind, per principal), give this slot back (exactly once), and where does
a session live (the directory). `memory` serves one process; `redis` (in
`sessions.redis_store`) shares slots and the directory between server processes.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sessions.errors import SessionLimit


@dataclass(frozen=True)
class Limits:
    max_total: int
    max_per_kind: Mapping[str, int] = field(default_factory=dict)
    max_per_principal: int | None = None
    retry_after_s: int = 1
    principal_caps: Mapping[str, int] = field(default_factory=dict)

    def caps_for(self, slot: Slot) -> tuple[int, int | None, int | None]:
        """(total, kind, principal) caps that apply to `slot`; None = no cap."""
        principal = self.principal_caps.get(slot.principal, self.max_per_principal)
        return self.max_total, self.max_per_kind.get(slot.kind), principal


@dataclass(frozen=True)
class Slot:
    session_id: str
    kind: str
    principal: str


class SessionStore(abc.ABC):
    name = "store"

    async def connect(self) -> None:  # noqa: B027 - optional hook
        """Check the backend is reachable; raise StoreUnavailable if not."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass

    @abc.abstractmethod
    async def acquire(self, slot: Slot, limits: Limits, record: Mapping[str, Any] | None = None) -> None:
        """Take a slot and write its directory `record`, atomically, or raise
        SessionLimit (StoreUnavailable if the backend is gone)."""

    @abc.abstractmethod
    async def release(self, slot: Slot) -> bool:
        """Give a slot back and drop its directory entry. True if it was held; False if
        it was already returned."""

    @abc.abstractmethod
    async def renew(self, slots: list[Slot]) -> int:
        """Extend the leases of slots this node still holds; returns how many had lapsed."""

    async def take(self, key: str, capacity: float, per_s: float, amount: float, force: bool = False) -> tuple[bool, float]:
        """A token bucket `key` (full at `capacity`, refilled at `per_s`): take `amount`
        if it holds that much (`force`: take it anyway, into debt). Returns (taken, the
        tokens left, negative in debt)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no rate-limit buckets")

    @abc.abstractmethod
    async def counts(self) -> dict[str, Any]:
        """{"total": n, "kinds": {kind: n}} over every node sharing the store."""

    @abc.abstractmethod
    async def publish(self, record: Mapping[str, Any]) -> None:
        """Write a session's directory entry (session → node, state, lease expiry)."""

    async def publish_many(self, records: list[Mapping[str, Any]]) -> None:
        for r in records:
            await self.publish(r)

    @abc.abstractmethod
    async def lookup(self, session_id: str) -> dict[str, Any] | None: ...

    # ---- moved sessions (sessions.migration) -------------------------------------------
    @abc.abstractmethod
    async def put_state(self, session_id: str, blob: bytes, ttl_s: float, record: Mapping[str, Any]) -> None:
        """Keep a moved session's state for `ttl_s`, with its directory entry (`record`:
        state "migrated", no node) for as long."""

    @abc.abstractmethod
    async def get_state(self, session_id: str) -> bytes | None:
        """A moved session's state, or None (never moved, adopted already, or lapsed)."""

    @abc.abstractmethod
    async def drop_state(self, session_id: str) -> None:
        """Forget a moved session's state (the node that adopted it holds it now)."""

    def health(self) -> dict[str, Any]:
        return {"backend": self.name}


class MemoryStore(SessionStore):
    """One process. `acquire` has no await point, so concurrent opens cannot race."""

    name = "memory"

    def __init__(self) -> None:
        self._slots: dict[str, Slot] = {}
        self._per_kind: dict[str, int] = {}
        self._per_principal: dict[str, int] = {}
        self._directory: dict[str, dict[str, Any]] = {}
        self._moved: dict[str, tuple[float, bytes]] = {}  # session id -> (expires at, monotonic; blob)
        self._buckets: dict[str, tuple[float, float]] = {}  # rate-limit buckets: key -> (tokens, monotonic time)

    async def acquire(self, slot: Slot, limits: Limits, record: Mapping[str, Any] | None = None) -> None:
        total, per_kind, per_principal = limits.caps_for(slot)
        if slot.session_id in self._slots:
            raise ValueError(f"session {slot.session_id} already holds a slot")
        checks = (
            ("total", total, len(self._slots)),
            ("kind", per_kind, self._per_kind.get(slot.kind, 0)),
            ("principal", per_principal, self._per_principal.get(slot.principal, 0)),
        )
        for scope, cap, used in checks:
            if cap is not None and used >= cap:
                raise SessionLimit(scope, slot.kind, cap, limits.retry_after_s)
        self._slots[slot.session_id] = slot
        self._per_kind[slot.kind] = self._per_kind.get(slot.kind, 0) + 1
        self._per_principal[slot.principal] = self._per_principal.get(slot.principal, 0) + 1
        if record is not None:
            self._directory[slot.session_id] = dict(record)

    async def release(self, slot: Slot) -> bool:
        self._directory.pop(slot.session_id, None)
        held = self._slots.pop(slot.session_id, None)
        if held is None:
            return False
        for counter, key in ((self._per_kind, held.kind), (self._per_principal, held.principal)):
            counter[key] -= 1
            if counter[key] == 0:
                del counter[key]
        return True

    async def renew(self, slots: list[Slot]) -> int:
        return 0  # memory slots have no lease: the process that holds them is this one

    async def take(self, key: str, capacity: float, per_s: float, amount: float, force: bool = False) -> tuple[bool, float]:
        now = time.monotonic()
        tokens, at = self._buckets.get(key, (capacity, now))
        tokens = min(capacity, tokens + (now - at) * per_s)
        taken = force or tokens >= amount
        if taken:
            tokens -= amount
        self._buckets[key] = (tokens, now)
        return taken, tokens

    async def counts(self) -> dict[str, Any]:
        return {"total": len(self._slots), "kinds": dict(self._per_kind), "principals": dict(self._per_principal)}

    async def publish(self, record: Mapping[str, Any]) -> None:
        self._directory[str(record["session_id"])] = dict(record)

    async def lookup(self, session_id: str) -> dict[str, Any] | None:
        rec = self._directory.get(session_id)
        return dict(rec) if rec is not None else None

    async def put_state(self, session_id: str, blob: bytes, ttl_s: float, record: Mapping[str, Any]) -> None:
        self._moved[session_id] = (time.monotonic() + ttl_s, bytes(blob))
        self._directory[session_id] = dict(record)

    async def get_state(self, session_id: str) -> bytes | None:
        held = self._moved.get(session_id)
        if held is None:
            return None
        if held[0] <= time.monotonic():
            await self.drop_state(session_id)
            return None
        return held[1]

    async def drop_state(self, session_id: str) -> None:
        if self._moved.pop(session_id, None) is not None and self._directory.get(session_id, {}).get("state") == "migrated":
            del self._directory[session_id]
