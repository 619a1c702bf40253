"""OpenPI policy WebSocket (`openpi-client`'s `WebsocketClientPolicy` works unchanged).

Served at `/v1/openpi` and at the server root `/` (the client connects with no path;
a plain `GET /` still gets the index page). Each connection is a session of kind
`robot` whose episode state lives in the session.

Wire (described for users in docs/api/openpi.md):
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
  lists them), `seed` (the episode's noise seed), and `control_hz` (the robot's
  control rate) with `replan_steps` (actions it executes from each chunk; default the
  policy's `action_horizon`): a robot that declares its rate is weighed by load-aware
  admission — each call must come back within `replan_steps / control_hz` — and is
  refused (text, close 1013) when the policy could not keep that pace with it. The
  metadata then carries `realtime {control_hz, replan_steps, budget_ms}`.
- Errors as openpi does them: a text frame with the message, then close 1011, for
  that connection only. Over the session cap, or when the policy engine is dead: the
  text frame, then close 1013. A
  session that ends on the server's side (idle lease, operator) sends the reason as
  text and closes 1001.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol, runtime_checkable

import numpy as np
from aiohttp import web

from omni_rt import metrics
from omni_rt.errors import WS_GOING_AWAY, WS_INTERNAL_ERROR, WS_NORMAL, WS_SERVICE_RESTART, WS_TRY_AGAIN_LATER, ClientError, RequestAborted, StageError
from omni_rt.load import RtfMeter
from omni_rt.payloads import Payload, PayloadError, PayloadKind
from omni_rt.request import RequestStream
from protocols.auth import principal_of
from protocols.errors import to_omni
from protocols.openpi.codec import ProtocolError, flatten, packb, unpackb
from protocols.registry import Mount
from protocols.ws import DISCONNECTED, Socket, accept, reject
from sessions import RESTART_REASONS, IllegalTransition, Session, SessionError, SessionManager

log = logging.getLogger("protocols.openpi")

# Observations bigger than this are refused with a clear error (the transport itself
# takes frames up to its limit and closes bigger ones with 1009).
MAX_OBSERVATION_BYTES = 64 * 1024 * 1024
DECODE_OFF_LOOP_BYTES = 1 << 20  # frames over 1 MiB are decoded off the event loop


@runtime_checkable
class Policy(Protocol):
    """What the adapter needs from the robot pipeline's policy stage."""

    def metadata(self, layout: str | None) -> dict[str, Any]: ...  # KeyError for an unknown layout

    def new_episode(self, seed: int | None = None) -> dict[str, Any]: ...


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


def _pace(query: Any, horizon: int) -> dict[str, Any] | None:
    """The declared control rate (`control_hz`, `replan_steps`) and the time each call
    has (`budget_ms`), or None when the robot declared none."""
    raw_hz, raw_steps = query.get("control_hz"), query.get("replan_steps")
    if raw_hz is None:
        if raw_steps is not None:
            raise ProtocolError("replan_steps needs control_hz (the robot's control rate)")
        return None
    try:
        hz = float(raw_hz)
    except ValueError:
        raise ProtocolError(f"control_hz must be a number of control steps a second, got {raw_hz!r}") from None
    if not 0 < hz <= 10_000:
        raise ProtocolError(f"control_hz must be in (0, 10000], got {raw_hz}")
    steps = horizon
    if raw_steps is not None:
        if not raw_steps.isdigit() or not 1 <= int(raw_steps) <= horizon:
            raise ProtocolError(f"replan_steps must be an integer in 1..{horizon} (the action horizon), got {raw_steps!r}")
        steps = int(raw_steps)
    return {"control_hz": hz, "replan_steps": steps, "budget_ms": 1000.0 * steps / hz}


class PolicyConnection:
    def __init__(self, sock: Socket, session: Session, policy: Policy, layout: str, pace: dict[str, Any] | None = None,
                 meter: RtfMeter | None = None) -> None:
        self.sock = sock
        self.session = session
        self.policy = policy
        self.layout = layout
        # a robot with a declared rate reports each call's share of its budget to the
        # meter load-aware admission reads (as the audio streams report theirs)
        self.budget_s = None if pace is None else pace["budget_ms"] / 1000.0
        self.meter = meter if meter is not None else RtfMeter()  # the server's (SessionManager.meters.generation)
        self.meter_key = self.meter.new_stream() if pace is not None else 0
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
        if len(data) > DECODE_OFF_LOOP_BYTES:
            # a large frame is decoded in a worker thread: other robots' replies do not wait on it
            obj = await asyncio.to_thread(unpackb, data)
        else:
            obj = unpackb(data)
        if not isinstance(obj, dict):
            raise ProtocolError(f"an observation is a msgpack map, got {type(obj).__name__}")
        if "endpoint" in obj:
            if obj["endpoint"] != "reset":
                raise ProtocolError(f"unknown endpoint {obj['endpoint']!r}; this server knows 'reset'")
            return packb(self.reset(_seed(obj.get("seed")))), None
        arrays, texts = await asyncio.to_thread(flatten, obj) if len(data) > DECODE_OFF_LOOP_BYTES else flatten(obj)
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
        if self.budget_s is not None:
            self.meter.sample(self.meter_key, infer_ms / 1000.0 / self.budget_s)
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

    def _ended(self) -> _Refusal:
        why = self.session.close_reason
        # a drain (the node restarts): 1012, the robot reconnects and another node serves it
        return _Refusal(f"session ended by the server ({why or 'aborted'})", WS_SERVICE_RESTART if why in RESTART_REASONS else WS_GOING_AWAY)

    async def _watch(self) -> None:
        """A session ended by the server (idle lease, operator) while the robot is
        between calls: tell it why and close. (During a call the aborted request
        reports it.)"""
        await self.session.closed.wait()
        if self.waiting:
            self.told = True
            await _refuse(self.sock, self._ended())

    async def serve(self) -> None:
        watcher = asyncio.ensure_future(self._watch())
        # Requests whose actions went out wind down in the background: the robot's next
        # observation is read while the last request is still being freed.
        winding: set[asyncio.Task[None]] = set()
        try:
            while True:
                t_wait = time.perf_counter()
                self.waiting = True
                if self.session.closed.is_set():  # ended while the last reply went out
                    raise self._ended()
                data = await self.sock.receive()
                self.waiting = False
                if data is None or self.told:
                    return  # the client left, or was told the session ended
                if isinstance(data, str):
                    raise ProtocolError("openpi frames are binary msgpack; got a text frame")
                try:
                    reply, stream = await self.handle(data)
                except (RequestAborted, IllegalTransition):
                    raise self._ended() from None
                try:
                    await self.sock.send(reply)
                    self.prev_total_ms = (time.perf_counter() - t_wait) * 1000.0
                finally:
                    if stream is not None:
                        task = asyncio.ensure_future(self.finish(stream))
                        winding.add(task)
                        task.add_done_callback(self._wound_down)
                        task.add_done_callback(winding.discard)
        finally:
            watcher.cancel()
            if winding:
                await asyncio.gather(*winding, return_exceptions=True)

    def _wound_down(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            # its actions were delivered; what failed is the request's teardown
            log.warning("openpi session %s: a request failed after its reply", self.session.id, exc_info=task.exception())


async def serve(request: web.Request, sessions: SessionManager, pipeline: str, pol: Policy) -> web.StreamResponse:
    try:
        layout = request.query.get("layout")
        meta = pol.metadata(layout)
        seed = _seed(request.query.get("seed"))
        pace = _pace(request.query, int(meta["action_horizon"]))
    except (KeyError, ProtocolError) as exc:
        refused = await accept(request)
        await _refuse(refused, _Refusal(str(exc.args[0] if isinstance(exc, KeyError) else exc)))
        return refused.ws
    try:
        session = await sessions.open("robot", pipeline, params={}, principal=principal_of(request).name,
                                      control_hz=None if pace is None else pace["control_hz"])
    except SessionError as exc:
        return await reject(request, exc, lambda e: f"{e.code}: {e.message}")
    reason = "client_disconnected"
    sock: Socket | None = None
    try:
        session.data["episode"] = pol.new_episode(seed)
        sock = await accept(request)
        conn = PolicyConnection(sock, session, pol, meta["layout"], pace, sessions.meters.generation)
        await sock.send(packb({**meta, "session_id": session.id, "seed": session.data["episode"]["seed"], "extensions": ["reset"],
                               **({"realtime": pace} if pace is not None else {})}))
        await conn.serve()
    except _Refusal as exc:
        reason = session.close_reason or "ended"
        if sock is not None:
            await _refuse(sock, exc)
    except DISCONNECTED:
        pass
    except Exception as exc:  # noqa: BLE001 - this connection only
        err = to_omni(exc, f"openpi session {session.id}")
        # the client's own bad input (a bad frame, an observation the policy cannot
        # use) is reported as is; a fault of ours as a generic message
        reason = "bad_input" if isinstance(err, (ClientError, StageError)) else "error"
        # a dead policy engine is "try again later" (1013); anything else ends the
        # connection as openpi's server does (1011)
        code = WS_TRY_AGAIN_LATER if err.ws_close == WS_TRY_AGAIN_LATER else WS_INTERNAL_ERROR
        if sock is not None:
            await _refuse(sock, _Refusal(err.message if err.expose else "internal error in the policy server", code))
    finally:
        await sessions.end(session, reason)
        if sock is not None:
            await sock.close(WS_NORMAL)
    return sock.ws if sock is not None else web.Response(status=500)


async def _refuse(sock: Socket, exc: _Refusal) -> None:
    try:
        await sock.send(exc.message)
    except DISCONNECTED:
        pass
    await sock.close(exc.code, exc.message.encode()[:120].decode(errors="ignore"))


def mount(m: Mount) -> None:
    """`/v1/openpi` and the server root `/` (a plain GET of `/` still gets the index)."""
    pol = m.processor(Policy)

    async def endpoint(request: web.Request) -> web.StreamResponse:
        return await serve(request, m.sessions, m.pipeline.name, pol)

    m.websocket("/v1/openpi", endpoint, "OpenPI policy (openpi-client; also at /)")
    m.websocket("/", endpoint)


__all__ = ["MAX_OBSERVATION_BYTES", "Policy", "PolicyConnection", "mount", "serve"]
