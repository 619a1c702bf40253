"""Per-principal rate limits (`sessions.rate_limits`): a token bucket per principal and
resource in the session store — one process's memory, or Redis, where every node
shares it (the refill runs on Redis' clock).

- `requests`: one-shot calls, taken when their session opens (refused: 429 with
  `retry-after`);
- `tokens`: thinker tokens (prompt + answer) of chat calls and voice answers, charged
  when the answer's usage is known; a new one is refused while the bucket is spent;
- `audio_seconds`: caller audio a voice session takes, charged as it arrives; refused
  (the protocol's error, once per spell) while spent.

A bucket holds a minute's worth and refills evenly over the minute; charges after the
fact may take it into debt, which the refill pays back before anything is admitted.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from omni_rt.specs import RateLimitSpec, RateLimitsSpec
from sessions.errors import RateLimited, StoreUnavailable

log = logging.getLogger("sessions.ratelimit")
WARN_EVERY_S = 30.0

RESOURCES = {"requests": ("requests_per_minute", "requests"), "tokens": ("tokens_per_minute", "tokens"),
             "audio_seconds": ("audio_seconds_per_minute", "seconds of audio")}


class RateLimiter:
    def __init__(self, spec: RateLimitsSpec, store: Any) -> None:
        self.spec = spec
        self.store = store
        self._warned = 0.0

    async def _take(self, key: str, capacity: float, per_s: float, amount: float, force: bool = False) -> tuple[bool, float]:
        """The store's bucket; with the store unreachable, limits fail open (the service
        goes on; said in the log every WARN_EVERY_S)."""
        try:
            taken: tuple[bool, float] = await self.store.take(key, capacity, per_s, amount, force)
            return taken
        except StoreUnavailable as exc:
            now = time.monotonic()
            if now - self._warned > WARN_EVERY_S:
                self._warned = now
                log.warning("rate limits not enforced: %s", exc.message)
            return True, capacity

    def _rate(self, principal: str, resource: str) -> float | None:
        field, _ = RESOURCES[resource]
        limits: RateLimitSpec = self.spec.of(principal)
        return getattr(limits, field)

    def limited(self, principal: str, resource: str) -> bool:
        return self._rate(principal, resource) is not None

    async def take(self, principal: str, resource: str, amount: float = 1.0) -> None:
        """Take `amount` now, or raise RateLimited (nothing taken)."""
        per_minute = self._rate(principal, resource)
        if per_minute is None:
            return
        per_s = per_minute / 60.0
        taken, left = await self._take(f"{principal}:{resource}", max(per_minute, amount), per_s, amount)
        if not taken:
            raise RateLimited(principal, RESOURCES[resource][1], per_minute, max(1, math.ceil((amount - left) / per_s)))

    async def check(self, principal: str, resource: str) -> None:
        """Raise RateLimited while the bucket is spent (or in debt): nothing is taken."""
        per_minute = self._rate(principal, resource)
        if per_minute is None:
            return
        per_s = per_minute / 60.0
        _, left = await self._take(f"{principal}:{resource}", per_minute, per_s, 0.0)
        if left <= 0:
            raise RateLimited(principal, RESOURCES[resource][1], per_minute, max(1, math.ceil((1e-9 - left) / per_s)))

    async def charge(self, principal: str, resource: str, amount: float) -> None:
        """What was spent (known after the fact), taken even into debt."""
        per_minute = self._rate(principal, resource)
        if per_minute is None or amount <= 0:
            return
        await self._take(f"{principal}:{resource}", per_minute, per_minute / 60.0, amount, force=True)
