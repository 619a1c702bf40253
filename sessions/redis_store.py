"""Redis session store: caps, slot leases and the directory shared by several nodes.

Slots are members of sorted sets (one for all sessions, one per kind, one per
principal) scored by their lease expiry in Redis server time. Admission is one Lua
script: drop lapsed leases, check every cap, add the slot to every set, all
atomically, so a burst of opens from any number of nodes never exceeds a cap. Each
node renews the leases of the sessions it holds on every reaper tick; a node that
dies without shutting down stops renewing and its slots lapse after one lease TTL.

The directory maps a session to its node, state and lease expiry (one JSON string
per session, expiring with the node's lease), so a node can tell a client where its
session lives.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from sessions.errors import SessionLimit, StoreUnavailable
from sessions.store import Limits, SessionStore, Slot

# KEYS: total, kind, principal sets, directory key. ARGV: session id, lease ms, caps
# (-1 = none), directory record (JSON, may be empty). Returns 0 when admitted, else
# 1/2/3 for the cap (total/kind/principal) that is full.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[2])
for i = 1, 3 do redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now) end
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return -1 end
for i = 1, 3 do
  local cap = tonumber(ARGV[2 + i])
  if cap >= 0 and redis.call('ZCARD', KEYS[i]) >= cap then return i end
end
for i = 1, 3 do
  redis.call('ZADD', KEYS[i], now + lease, ARGV[1])
  redis.call('PEXPIRE', KEYS[i], lease * 2)
end
if ARGV[6] ~= '' then redis.call('SET', KEYS[4], ARGV[6], 'PX', lease) end
return 0
"""

# KEYS: total, kind, principal sets, directory key. ARGV: session id. 1 if held.
_RELEASE = """
local held = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[4])
return held
"""

# KEYS: 3 sets per slot, in order. ARGV: lease ms, then one session id per slot.
# A slot that lapsed (this node stalled longer than a lease) is added back: the node
# still holds the session, so the shared count must say so. Returns how many lapsed.
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
local lapsed = 0
for s = 0, #ARGV - 2 do
  local sid = ARGV[2 + s]
  for i = 1, 3 do
    local key = KEYS[s * 3 + i]
    local added = redis.call('ZADD', key, now + lease, sid)
    if i == 1 then lapsed = lapsed + added end
    redis.call('PEXPIRE', key, lease * 2)
  end
end
return lapsed
"""

# KEYS: total set then one set per kind. Live members of each.
_COUNTS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for i = 1, #KEYS do out[i] = redis.call('ZCOUNT', KEYS[i], '(' .. now, '+inf') end
return out
"""


def redact(url: str) -> str:
    """The URL without its password, for messages and /health."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else "***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


# A token bucket shared by every node (rate limits): refilled by the Redis server's own
# clock (TIME), so nodes' clocks do not matter. KEYS[1] the bucket; ARGV capacity,
# per-second refill, amount, force (1: take into debt). Returns {taken, tokens left}.
_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local cap, rate, amount, force = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local b = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(b[1]) or cap
local at = tonumber(b[2]) or now
tokens = math.min(cap, tokens + math.max(0, now - at) * rate)
local taken = 0
if force == 1 or tokens >= amount then
  tokens = tokens - amount
  taken = 1
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('EXPIRE', KEYS[1], math.ceil((cap - math.min(tokens, 0)) / rate) + 60)
return {taken, tostring(tokens)}
"""


class RedisStore(SessionStore):
    name = "redis"

    def __init__(self, url: str, *, prefix: str = "omni-rt", lease_ttl_s: float = 15.0, timeout_s: float = 1.0, kinds: tuple[str, ...] = (), max_connections: int = 32) -> None:
        self.url = url
        self.prefix = prefix
        self.lease_ms = max(1, int(lease_ttl_s * 1000))
        self.kinds = kinds
        # A bounded pool that queues callers (for at most the timeout) instead of
        # failing a burst of admissions with "too many connections".
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            decode_responses=True,
        )
        self._redis = aioredis.Redis(connection_pool=pool)
        # moved sessions' state blobs are bytes: a client of their own that does not decode
        raw_pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=4, timeout=timeout_s, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._raw = aioredis.Redis(connection_pool=raw_pool)
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._release = self._redis.register_script(_RELEASE)
        self._renew = self._redis.register_script(_RENEW)
        self._counts = self._redis.register_script(_COUNTS)
        self._take = self._redis.register_script(_TAKE)
        self.last_error: str | None = None

    # ---- keys ----------------------------------------------------------------------
    def _keys(self, slot: Slot) -> list[str]:
        p = self.prefix
        return [f"{p}:slots", f"{p}:slots:kind:{slot.kind}", f"{p}:slots:principal:{slot.principal}"]

    def _dir_key(self, session_id: str) -> str:
        return f"{self.prefix}:session:{session_id}"

    def _state_key(self, session_id: str) -> str:
        return f"{self.prefix}:moved:{session_id}"

    def _unavailable(self, exc: Exception) -> StoreUnavailable:
        self.last_error = f"{type(exc).__name__}: {exc}"
        return StoreUnavailable(f"The session store (Redis at {redact(self.url)}) is unreachable: {exc}")

    async def take(self, key: str, capacity: float, per_s: float, amount: float, force: bool = False) -> tuple[bool, float]:
        try:
            taken, tokens = await self._take(keys=[f"{self.prefix}:rate:{key}"], args=[capacity, per_s, amount, 1 if force else 0])
        except (RedisError, OSError) as exc:
            raise self._unavailable(exc) from None
        return bool(int(taken)), float(tokens)

    # ---- lifecycle -----------------------------------------------------------------
    async def connect(self) -> None:
        try:
            await self._redis.ping()
        except (RedisError, OSError) as exc:
            raise self._unavailable(exc) from None
        self.last_error = None

    async def close(self) -> None:
        await self._redis.aclose(close_connection_pool=True)
        await self._raw.aclose(close_connection_pool=True)

    # ---- slots ---------------------------------------------------------------------
    async def acquire(self, slot: Slot, limits: Limits, record: Mapping[str, Any] | None = None) -> None:
        total, per_kind, per_principal = limits.caps_for(slot)
        caps = [total, per_kind, per_principal]
        doc = json.dumps(dict(record)) if record is not None else ""
        args: list[Any] = [slot.session_id, self.lease_ms, *(-1 if c is None else c for c in caps), doc]
        keys = [*self._keys(slot), self._dir_key(slot.session_id)]
        try:
            res = int(await self._acquire(keys=keys, args=args))
        except (RedisError, OSError) as exc:
            raise self._unavailable(exc) from None
        self.last_error = None
        if res == -1:
            raise ValueError(f"session {slot.session_id} already holds a slot")
        if res:
            scope = ("total", "kind", "principal")[res - 1]
            cap = caps[res - 1]
            assert cap is not None
            raise SessionLimit(scope, slot.kind, cap, limits.retry_after_s)

    async def release(self, slot: Slot) -> bool:
        try:
            keys = [*self._keys(slot), self._dir_key(slot.session_id)]
            return bool(int(await self._release(keys=keys, args=[slot.session_id])))
        except (RedisError, OSError) as exc:
            raise self._unavailable(exc) from None

    async def renew(self, slots: list[Slot]) -> int:
        if not slots:
            return 0
        lapsed = 0
        try:
            # Bounded script size: renew in batches.
            for i in range(0, len(slots), 500):
                batch = slots[i : i + 500]
                keys = [k for s in batch for k in self._keys(s)]
                lapsed += int(await self._renew(keys=keys, args=[self.lease_ms, *(s.session_id for s in batch)]))
        except (RedisError, OSError) as exc:
            raise self._unavailable(exc) from None
        self.last_error = None
        return lapsed

    async def counts(self) -> dict[str, Any]:
        p = self.prefix
        keys = [f"{p}:slots", *(f"{p}:slots:kind:{k}" for k in self.kinds)]
        try:
            res = await self._counts(keys=keys, args=[])
        except (RedisError, OSError) as exc:
            raise self._unavailable(exc) from None
        return {"total": int(res[0]), "kinds": {k: int(n) for k, n in zip(self.kinds, res[1:], strict=True) if int(n)}}

    # ---- directory -----------------------------------------------------------------
    async def publish(self, record: Mapping[str, Any]) -> None:
        try:
            await self._redis.set(self._dir_key(str(record["session_id"])), json.dumps(dict(record)), px=self.lease_ms)
        except (RedisError, OSError) as exc:
            raise self._unavailable(exc) from None

    async def publish_many(self, records: list[Mapping[str, Any]]) -> None:
        if not records:
            return
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for r in records:
                    pipe.set(self._dir_key(str(r["session_id"])), json.dumps(dict(r)), px=self.lease_ms)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise self._unavailable(exc) from None

    async def lookup(self, session_id: str) -> dict[str, Any] | None:
        try:
            raw = await self._redis.get(self._dir_key(session_id))
        except (RedisError, OSError) as exc:
            raise self._unavailable(exc) from None
        return json.loads(raw) if raw else None

    # ---- moved sessions --------------------------------------------------------------
    async def put_state(self, session_id: str, blob: bytes, ttl_s: float, record: Mapping[str, Any]) -> None:
        px = max(1, int(ttl_s * 1000))
        try:
            async with self._raw.pipeline(transaction=True) as pipe:
                pipe.set(self._state_key(session_id), blob, px=px)
                pipe.set(self._dir_key(session_id), json.dumps(dict(record)), px=px)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise self._unavailable(exc) from None

    async def get_state(self, session_id: str) -> bytes | None:
        try:
            raw = await self._raw.get(self._state_key(session_id))
        except (RedisError, OSError) as exc:
            raise self._unavailable(exc) from None
        return raw if isinstance(raw, bytes) else None

    async def drop_state(self, session_id: str) -> None:
        try:
            await self._raw.delete(self._state_key(session_id))
        except (RedisError, OSError) as exc:
            raise self._unavailable(exc) from None

    def health(self) -> dict[str, Any]:
        return {"backend": self.name, "url": redact(self.url), "prefix": self.prefix, "last_error": self.last_error}
