"""OpenPI policy WebSocket (`openpi-client`'s `WebsocketClientPolicy` works unchanged).

Served at `/v1/openpi` and at the server root `/` (the client connects with no path;
a plain `GET /` still gets the index page). Each connection is a session of kind
`robot` whose episode state lives in the session.

Wire (PROTOCOLS.md §4):
- The server speaks first: one binary frame, the policy's metadata (msgpack).
- Then lockstep: a binary msgpack observation in, a binary msgpack reply out with
  `actions` [horizon, dim] float32, `policy_timing.infer_ms` (the policy stage's own
  time) and `server_timing.infer_ms` (observation handed to the pipeline → actions
  back) plus `prev_total_ms` from the second call on (the previous call's time from
  waiting for the observation to the reply sent), as openpi's server reports them.
- msgpack-numpy as openpi encodes it: arrays are maps with **bytes** keys
  `{__ndarray__, data, dtype, shape}`, numpy scalars `{__npgeneric__, data, dtype}`;
  object, void and complex dtypes are refused. Decoded arrays are read-only views.
- Extension: `{"endpoint": "reset"}` (optionally with `"seed": n`) starts a new
  episode on the same connection; the reply is `{"reset": true, "episode": n, "seed": s}`.
- Query parameters: `layout` (which embodiment's keys and action dims; the metadata
  lists them) and `seed` (the episode's noise seed).
- Errors as openpi does them: a text frame with the message, then close 1011, for
  that connection only. Over the session cap: the text frame, then close 1013. A
  session that ends on the server's side (idle lease, operator) sends the reason as
  text and closes 1001.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Mapping, Protocol

import msgpack
import numpy as np
from fastapi import APIRouter
from starlette.websockets import WebSocket, WebSocketDisconnect

from omni_rt import metrics
from omni_rt.payloads import Payload, PayloadError, PayloadKind
from omni_rt.request import RequestAborted, RequestStream
from omni_rt.stage import StageError
from protocols.auth import principal_of
from protocols.realtime import close_websocket
from protocols.sessions_api import reject_websocket
from sessions import Session, SessionError, SessionManager
from sessions.errors import IllegalTransition

log = logging.getLogger("protocols.openpi")

WS_INTERNAL_ERROR = 1011
WS_GOING_AWAY = 1001
# Observations bigger than this are refused with a clear error (the transport itself
# takes frames up to the server's ws_max_size and closes bigger ones with 1009).
MAX_OBSERVATION_BYTES = 64 * 1024 * 1024
MAX_NDIM = 8
MAX_DEPTH = 8
MAX_LIST_ITEMS = 65536
MAX_MAP_ITEMS = 4096


class ProtocolError(ValueError):
    """Bad input from the client; the message goes to it verbatim."""


class Policy(Protocol):
    """What the adapter needs from the robot pipeline's policy stage."""

    def metadata(self, layout: str | None) -> dict[str, Any]: ...  # KeyError for an unknown layout

    def new_episode(self, seed: int | None = None) -> dict[str, Any]: ...


# ---- msgpack-numpy, as openpi encodes it ------------------------------------------------


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind in ("V", "O", "c"):
        raise TypeError(f"unsupported dtype {obj.dtype}")
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": np.ascontiguousarray(obj).tobytes(), b"dtype": obj.dtype.str, b"shape": obj.shape}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot encode {type(obj).__name__}")


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_pack_default)


def _dtype(raw: Any) -> np.dtype:
    if not isinstance(raw, str):
        raise ProtocolError(f"array dtype must be a string like '<f4', got {type(raw).__name__}")
    try:
        dt = np.dtype(raw)
    except (TypeError, ValueError, SyntaxError):
        raise ProtocolError(f"unknown array dtype {raw!r}") from None
    if dt.kind in ("V", "O", "c") or dt.kind not in "biuf":
        raise ProtocolError(f"array dtype {raw!r} is not accepted (object, void, complex and string arrays are refused)")
    return dt


def _unpack_hook(obj: dict[Any, Any]) -> Any:
    if b"__ndarray__" in obj:
        dt = _dtype(obj.get(b"dtype"))
        shape, data = obj.get(b"shape"), obj.get(b"data")
        if not isinstance(data, bytes):
            raise ProtocolError("array data must be msgpack bin (bytes)")
        if not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ProtocolError(f"array shape must be a list of at most {MAX_NDIM} non-negative ints, got {shape!r}")
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if count * dt.itemsize != len(data):
            raise ProtocolError(f"array of shape {list(shape)} and dtype {dt.str} needs {count * dt.itemsize} bytes, got {len(data)}")
        arr = np.frombuffer(data, dtype=dt).reshape(shape)
        return arr if dt.isnative else arr.astype(dt.newbyteorder("="))
    if b"__npgeneric__" in obj:
        dt = _dtype(obj.get(b"dtype"))
        try:
            return dt.type(obj.get(b"data"))
        except (TypeError, ValueError, OverflowError):
            raise ProtocolError(f"numpy scalar {obj.get(b'data')!r} does not fit dtype {dt.str}") from None
    if "__ndarray__" in obj or "__npgeneric__" in obj:
        raise ProtocolError("array maps need bytes keys (b'__ndarray__', b'data', b'dtype', b'shape') as openpi encodes them; got str keys")
    return obj


def unpackb(data: bytes) -> Any:
    try:
        # bounded containers: an observation is a few maps of arrays, never millions of items
        return msgpack.unpackb(data, object_hook=_unpack_hook, raw=False, strict_map_key=True,
                               max_array_len=MAX_LIST_ITEMS, max_map_len=MAX_MAP_ITEMS)
    except ProtocolError:
        raise
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ProtocolError(f"frame is not one msgpack message: {exc}") from None
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"frame is not valid msgpack for this protocol: {exc}") from None


def flatten(obs: Mapping[Any, Any]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A (nested) observation -> arrays and strings by '/'-joined key path."""
    arrays: dict[str, np.ndarray] = {}
    texts: dict[str, str] = {}

    def walk(node: Mapping[Any, Any], prefix: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise ProtocolError(f"observation nests deeper than {MAX_DEPTH} maps")
        for key, value in node.items():
            if not isinstance(key, str):
                raise ProtocolError(f"observation keys are strings; got {type(key).__name__} key {key!r}")
            path = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, path + "/", depth + 1)
            elif isinstance(value, str):
                texts[path] = value
            elif isinstance(value, np.ndarray):
                arrays[path] = value
            elif isinstance(value, (bool, int, float, np.generic, list, tuple)):
                try:
                    arr = np.asarray(value)
                except (ValueError, OverflowError):
                    raise ProtocolError(f"observation {path!r}: not a numeric array") from None
                if arr.dtype.kind not in "biuf":
                    raise ProtocolError(f"observation {path!r}: not a numeric array (dtype {arr.dtype})")
                arrays[path] = arr
            elif value is None:
                continue
            else:
                raise ProtocolError(f"observation {path!r}: unsupported value of type {type(value).__name__}")

    walk(obs, "", 0)
    return arrays, texts


# ---- the connection -----------------------------------------------------------------------


class _Refusal(Exception):
    """End this connection: send `message` as text, then close with `code`."""

    def __init__(self, message: str, code: int = WS_INTERNAL_ERROR) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def _seed(raw: Any) -> int | None:
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, (int, str, np.integer)):
        raise ProtocolError(f"seed must be an integer, got {raw!r}")
    try:
        seed = int(raw)
    except ValueError:
        raise ProtocolError(f"seed must be an integer, got {raw!r}") from None
    if not 0 <= seed < 2**32:
        raise ProtocolError(f"seed must be in 0..2^32-1, got {seed}")
    return seed


class PolicyConnection:
    def __init__(self, ws: WebSocket, session: Session, policy: Policy, layout: str) -> None:
        self.ws = ws
        self.session = session
        self.policy = policy
        self.layout = layout
        self.episodes = 0
        self.prev_total_ms: float | None = None
        self.waiting = False  # between calls, waiting for the next observation
        self.told = False  # the robot was told its session ended

    def reset(self, seed: int | None) -> dict[str, Any]:
        self.session.data["episode"] = self.policy.new_episode(seed)
        self.episodes += 1
        self.session.touch()
        return {"reset": True, "episode": self.episodes, "seed": self.session.data["episode"]["seed"]}

    async def handle(self, data: bytes) -> tuple[bytes, RequestStream | None]:
        """The reply to one frame, and the request still winding down (if any): it is
        finished after the reply went out, off the robot's critical path."""
        if len(data) > MAX_OBSERVATION_BYTES:
            raise ProtocolError(f"observation frame of {len(data)} bytes exceeds the {MAX_OBSERVATION_BYTES}-byte limit")
        obj = unpackb(data)
        if not isinstance(obj, dict):
            raise ProtocolError(f"an observation is a msgpack map, got {type(obj).__name__}")
        if "endpoint" in obj:
            if obj["endpoint"] != "reset":
                raise ProtocolError(f"unknown endpoint {obj['endpoint']!r}; this server knows 'reset'")
            return packb(self.reset(_seed(obj.get("seed")))), None
        arrays, texts = flatten(obj)
        reply, stream = await self.infer(arrays, texts)
        return packb(reply), stream

    async def infer(self, arrays: dict[str, np.ndarray], texts: dict[str, str]) -> tuple[dict[str, Any], RequestStream]:
        s = self.session
        t0 = time.perf_counter()
        stream = s.submit({"layout": self.layout, "episode": s.data["episode"]})
        try:
            try:
                payload = Payload(PayloadKind.OBSERVATION, s.fence, arrays=arrays, meta={"text": texts})
            except PayloadError as exc:
                raise ProtocolError(f"observation: {exc}") from None
            s.send_input(stream, payload)
            stream.end_input()
            result: Payload | None = None
            async for _stage, p, last in stream.payloads():
                result = p
                if last:
                    break  # the chunk is complete; the request winds down after the reply
            if result is None:
                raise StageError("the policy returned no actions")
        except BaseException:
            await stream.close()
            raise
        s.data["episode"] = result.meta["episode"]
        infer_ms = (time.perf_counter() - t0) * 1000.0
        metrics.POLICY_INFER_SECONDS.observe(infer_ms / 1000.0)
        server_timing = {"infer_ms": infer_ms}
        if self.prev_total_ms is not None:
            server_timing["prev_total_ms"] = self.prev_total_ms
        reply = {
            "actions": result.arrays["actions"],
            "policy_timing": {"infer_ms": float(result.meta["infer_ms"])},
            "server_timing": server_timing,
        }
        return reply, stream

    @staticmethod
    async def finish(stream: RequestStream) -> None:
        """Let a request whose result was sent complete, then free it."""
        try:
            async for _ in stream.events():
                pass
        finally:
            await stream.close()

    def _ended(self) -> "_Refusal":
        return _Refusal(f"session ended by the server ({self.session.close_reason or 'aborted'})", WS_GOING_AWAY)

    async def _watch(self) -> None:
        """A session ended by the server (idle lease, operator) while the robot is
        between calls: tell it why and close. (During a call the aborted request
        reports it.)"""
        await self.session.closed.wait()
        if self.waiting:
            self.told = True
            await _refuse(self.ws, self._ended())

    async def serve(self) -> None:
        watcher = asyncio.ensure_future(self._watch())
        try:
            while True:
                t_wait = time.perf_counter()
                self.waiting = True
                if self.session.closed.is_set():  # ended while the last reply went out
                    raise self._ended()
                msg = await self.ws.receive()
                self.waiting = False
                if msg["type"] == "websocket.disconnect" or self.told:
                    return  # the client left, or was told the session ended
                if msg.get("bytes") is None:
                    raise ProtocolError("openpi frames are binary msgpack; got a text frame")
                try:
                    reply, stream = await self.handle(msg["bytes"])
                except (RequestAborted, IllegalTransition):
                    raise self._ended() from None
                try:
                    await self.ws.send_bytes(reply)
                    self.prev_total_ms = (time.perf_counter() - t_wait) * 1000.0
                finally:
                    if stream is not None:
                        await self.finish(stream)
        finally:
            watcher.cancel()


def build_openpi_router(sessions: SessionManager, pipeline: str, policy: Callable[[], Policy]) -> APIRouter:
    """`policy()` gives the running policy stage's processor (metadata, new episodes)."""
    router = APIRouter()

    async def endpoint(ws: WebSocket) -> None:
        pol = policy()
        try:
            layout = ws.query_params.get("layout")
            meta = pol.metadata(layout)
            seed = _seed(ws.query_params.get("seed"))
        except (KeyError, ProtocolError) as exc:
            await ws.accept()
            await _refuse(ws, _Refusal(str(exc.args[0] if isinstance(exc, KeyError) else exc)))
            return
        try:
            session = await sessions.open("robot", pipeline, params={}, principal=principal_of(ws).name)
        except SessionError as exc:
            await reject_websocket(ws, exc, lambda e: f"{e.code}: {e.message}")
            return
        conn = PolicyConnection(ws, session, pol, meta["layout"])
        reason = "client_disconnected"
        try:
            session.data["episode"] = pol.new_episode(seed)
            await ws.accept()
            await ws.send_bytes(packb({**meta, "session_id": session.id, "seed": session.data["episode"]["seed"], "extensions": ["reset"]}))
            await conn.serve()
        except ProtocolError as exc:
            reason = "bad_input"
            await _refuse(ws, _Refusal(str(exc)))
        except StageError as exc:
            reason = "bad_input"
            await _refuse(ws, _Refusal(str(exc)))
        except _Refusal as exc:
            reason = session.close_reason or "ended"
            await _refuse(ws, exc)
        except (WebSocketDisconnect, ConnectionError, RuntimeError):
            pass
        except Exception:  # noqa: BLE001 - this connection only
            log.exception("openpi session %s failed", session.id)
            reason = "error"
            await _refuse(ws, _Refusal("internal error in the policy server"))
        finally:
            await sessions.end(session, reason)
            await close_websocket(ws, 1000)

    router.add_api_websocket_route("/v1/openpi", endpoint)
    router.add_api_websocket_route("/", endpoint)
    return router


async def _refuse(ws: WebSocket, exc: _Refusal) -> None:
    try:
        await ws.send_text(exc.message)
        await ws.close(exc.code, exc.message.encode()[:120].decode(errors="ignore"))
    except (RuntimeError, ConnectionError, WebSocketDisconnect):
        pass
