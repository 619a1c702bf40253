"""Stage replicas placed outside the server: Ray actors (`placement: process | ray`).

A replica placed outside the server is a Ray actor, `StageActor`, that builds the
replica exactly as the server would build it in process (`Runtime.local_replica`: the
same engines and processor) and runs its requests there. The server keeps the
orchestrator, the sessions and a proxy, `RemoteStage`, in the replica's place: a
`StageProcessor` whose `run` forwards one request to the actor and routes what the
actor publishes. Only handles cross: payloads go through a `ray` connector (inside
the handle up to 100 KiB, Ray's object store above), put and read where the stages run.

One request on a remote replica, as the proxy drives it:

- `open`: the request's id, params, fence, its inputs (edge name, mode, chunking) and
  its output groups (connector, readers) — the actor builds a `StageContext` over
  them and starts the processor;
- `outputs`: a Ray streaming generator of what the processor publishes, each output
  put into the group's connector there and yielded as a handle (what has queued up
  by then in one item), then the usage it counted, then the error it failed with (if
  it did);
- `feed`: the handles fed to each input since the last call, in one call, with the
  request's current fence (a chunk of an older turn is dropped there, at the
  connector-get hop, and the engine-output hop checks the same fence) and the input's
  end with its last ones; a client input held in the server's in-process connector is
  put into the replica's connector first;
- `abort`: a cancelled request (abort, barge-in, a client gone) stops the processor
  and its engine work in the actor;
- `release_session`: a session ended (fire and forget).

Fences are checked where an output leaves the engine (in the actor) and again where
the orchestrator routes it. A replica whose actor dies fails the requests running on
it with `stage_unavailable` (503); its session goes on, the pool sends new work to a
live replica, and Ray restarts the actor (`max_restarts`), which builds the replica
anew and rejoins the pool (the proxy's health poll sees it). The proxy reports the
actor's load and liveness to the pool (`load`, `unavailable`), hence to `/health`.

`process` pins the actor to the server's own node (GIL isolation on one machine);
`ray` lets Ray place it wherever `num_cpus`, `num_gpus` and `resources` are offered.
With `server.ray_address` the actors are named and detached (`omni-rt:<pipeline>:<stage>:<i>`
in namespace `omni-rt`): several front ends attach to the same actors, and refuse
to when the running actor's stage definition differs from theirs. Without one, the
server starts a Ray instance of its own and its actors end with it.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import itertools
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from omni_rt.connectors import Connector, make_connector
from omni_rt.connectors.ray import RayConnector
from omni_rt.errors import InternalError, OmniError, StageUnavailable
from omni_rt.payloads import Fence, Handle
from omni_rt.specs import ChunkingSpec, SpecError, StageSpec
from omni_rt.stage import StageContext, StageInput, StageProcessor
from omni_rt.status import RequestStatus

if TYPE_CHECKING:
    from omni_rt.runtime import Runtime

log = logging.getLogger("omni_rt.placement")

NAMESPACE = "omni-rt"
HEALTH_EVERY_S = 1.0
_shared = False  # connected to a cluster of its own address (server.ray_address): actors are shared
START_TIMEOUT_S = 900.0  # loading a model in an actor (a vLLM engine, a diffusion pipeline)


def connect(address: str | None) -> None:
    """Connect this process to Ray: the cluster at `address`, or a Ray instance of
    this server's own. Raises SpecError when the address does not answer."""
    import ray

    global _shared
    if ray.is_initialized():
        return
    from omni_rt.lifeline import server_env

    _shared = bool(address)
    if address:
        _answers(address)
    try:
        if address:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
        else:
            # a new instance ("local": not whatever cluster this machine last ran), whose
            # workers end with this server (omni_rt.lifeline)
            ray.init(address="local", namespace=NAMESPACE, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
                     runtime_env={"env_vars": server_env()})
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise SpecError(f"server.ray_address: the Ray cluster at {address!r} does not answer: {exc}") from None


def _answers(address: str) -> None:
    """A `host:port` GCS address must take a connection within a few seconds (Ray's
    own client would retry for minutes): a wrong address is a start-up error."""
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # "auto", a ray:// client address: Ray resolves and reports those itself
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            pass
    except OSError as exc:
        raise SpecError(f"server.ray_address: the Ray cluster at {address!r} does not answer: {exc.strerror or exc}") from None


def digest(spec: StageSpec) -> str:
    """What two front ends must agree on to share a stage's actors."""
    return hashlib.sha256(spec.model_dump_json().encode()).hexdigest()[:16]


def _feasible(spec: StageSpec) -> None:
    """Refuse, naming the stage and the resource, a placement no node can take (Ray
    would keep the actor pending forever)."""
    import ray

    p = spec.placement
    need = {"CPU": p.num_cpus, "GPU": p.num_gpus, **p.resources}
    need = {k: v for k, v in need.items() if v > 0}
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if any(all(res.get(k, 0) >= v for k, v in need.items()) for res in nodes):
        return
    short = sorted({k for k, v in need.items() if not any(res.get(k, 0) >= v for res in nodes)}) or sorted(need)
    raise SpecError(f"stage {spec.name}: no node of the Ray cluster offers {', '.join(f'{k}={need[k]:g}' for k in short)} "
                    f"(placement {p.kind}; nodes offer {[{k: v for k, v in r.items() if not k.startswith('node:')} for r in nodes]})")


class _RemoteState:
    """What a `StageContext` reads of a request, in the actor."""

    def __init__(self, request_id: str, fence: Fence, params: Mapping[str, Any]) -> None:
        self.request_id = request_id
        self.fence = fence
        self.latest = fence
        self.params = dict(params)
        self.usage: dict[str, int] = {}
        self.status = RequestStatus.RUNNING

    def current_fence(self) -> Fence:
        return self.latest


HOST = socket.gethostname()


class _MeterRecorder:
    """A placed stage's generation meter: its reports go back to the server with the
    stage's outputs (`StageActor.outputs`), replayed there into the server's meter."""

    def __init__(self, out: asyncio.Queue[Any]) -> None:
        self.out = out
        self._keys = itertools.count()

    def new_stream(self) -> int:
        return next(self._keys)

    def chunk(self, key: int, audio_s: float, now: float | None = None) -> None:
        self.out.put_nowait(("chunk", key, audio_s, time.monotonic() if now is None else now))

    def sample(self, key: int, rtf: float, now: float | None = None) -> None:
        self.out.put_nowait(("sample", key, rtf, time.monotonic() if now is None else now))


def _with_ages(batch: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """A batch of the actor's outputs as sent: a meter report's time becomes its age (the
    server's clock is not this process's on another node), and the process's CPU
    seconds so far go with it (`LoadMeters.placed_cpu`: a process on the server's host
    is weighed as the server's own load)."""
    import psutil

    now = time.monotonic()
    out = [(k, a, b, now - c) if k in ("chunk", "sample") else (k, a, b, c) for k, a, b, c in batch]
    try:
        t = psutil.Process().cpu_times()
        out.append(("cpu", HOST, os.getpid(), t.user + t.system))
    except psutil.Error:
        pass
    return out


class _Group:
    """An output group as the actor sees it: where to put, for how many readers."""

    def __init__(self, connector: str, readers: int) -> None:
        self.connector = connector
        self.consumers = [None] * readers


class StageActor:
    """One stage replica in a Ray actor (see the module docstring)."""

    def __init__(self, pipeline: str, spec_json: str, index: int, backends: Mapping[str, str], runtime: str, stage_digest: str) -> None:
        from omni_rt.lifeline import watch_server

        watch_server()  # in a Ray instance of a server's own: end with that server
        module, _, cls = runtime.partition(":")
        rt_cls: type[Runtime] = getattr(importlib.import_module(module), cls)
        self.pipeline = pipeline
        self.spec = StageSpec.model_validate_json(spec_json)
        self.digest = stage_digest
        self.connectors: dict[str, Connector] = {n: make_connector(b, n) for n, b in backends.items() if b != "inproc"}
        rt = rt_cls({}, {})
        rt.check_stage(pipeline, self.spec)  # the model directory, where the replica runs
        self.replica = rt.local_replica(pipeline, self.spec, index)
        self.requests: dict[str, tuple[_RemoteState, dict[str, StageInput], asyncio.Queue[Any], asyncio.Task[None]]] = {}
        self._start: asyncio.Task[dict[str, Any]] | None = None
        self.served = 0

    async def start(self) -> dict[str, Any]:
        """Start the engines and the processor (once; a second front end attaching
        waits for the same start). What this actor is."""
        if self._start is None:
            self._start = asyncio.get_running_loop().create_task(self._start_replica())
        return await asyncio.shield(self._start)

    async def _start_replica(self) -> dict[str, Any]:
        import ray

        for eng in self.replica.engines():
            await eng.start()
        await self.replica.processor.start()
        return {"digest": self.digest, "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}

    async def open(self, request_id: str, params: Mapping[str, Any], fence: Fence, inputs: list[tuple[str, str, str]],
                   groups: list[tuple[str, int]]) -> None:
        state = _RemoteState(request_id, fence, params)
        ins = {n: StageInput(n, mode, ChunkingSpec.model_validate_json(chunking), self.connectors, state.current_fence)
               for n, mode, chunking in inputs}
        gs = [_Group(c, r) for c, r in groups]
        out: asyncio.Queue[Any] = asyncio.Queue()

        def route(group: Any, handle: Handle, last: bool) -> None:
            out.put_nowait(("out", gs.index(group), handle, last))

        ctx = StageContext(state, self.spec, ins, self.connectors, gs, route, _MeterRecorder(out))  # type: ignore[arg-type]
        task = asyncio.get_running_loop().create_task(self.replica.processor.run(ctx), name=f"{request_id}:{self.spec.name}")
        task.add_done_callback(lambda _t: out.put_nowait(("end",)))
        self.requests[request_id] = (state, ins, out, task)
        self.replica.active += 1
        self.served += 1

    async def outputs(self, request_id: str) -> AsyncIterator[tuple[Any, ...]]:
        """What the request publishes, its usage, then its error if it failed."""
        entry = self.requests.get(request_id)
        if entry is None:
            yield ("error", StageUnavailable(f"stage {self.spec.name}: request {request_id} is not open on this replica (restarted?)"))
            return
        state, _ins, out, task = entry
        try:
            ended = False
            while not ended:  # what has queued up by now, in one item: fewer returns under load
                batch = [await out.get()]
                while not out.empty():
                    batch.append(out.get_nowait())
                if batch[-1][0] == "end":
                    batch.pop()
                    ended = True
                if batch:
                    yield ("outs", _with_ages(batch))
            yield ("usage", dict(state.usage))
            if not task.cancelled() and task.exception() is not None:
                exc = task.exception()
                yield ("error", exc if isinstance(exc, OmniError) else InternalError(f"stage {self.spec.name} failed: {type(exc).__name__}: {exc}"))
        finally:
            await self._close(request_id)

    async def feed(self, request_id: str, name: str, handles: list[Handle], fence: Fence | None, last: bool) -> None:
        """The next handles of one input (in order; a call carries whatever the
        input had gathered), and its end if `last`."""
        entry = self.requests.get(request_id)
        if entry is None:
            return  # finished or aborted: a late chunk is dropped (as the orchestrator drops it)
        state, ins, _out, _task = entry
        if fence is not None:
            state.latest = fence
        for handle in handles:
            ins[name].feed(handle)
        if last:
            ins[name].end()

    async def abort(self, request_id: str) -> None:
        await self._close(request_id)

    async def _close(self, request_id: str) -> None:
        entry = self.requests.pop(request_id, None)
        if entry is None:
            return
        state, ins, _out, task = entry
        self.replica.active -= 1
        state.status = RequestStatus.ABORTED if not task.done() else RequestStatus.COMPLETED
        for inp in ins.values():
            inp.end()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def cleanup(self, request_id: str) -> None:
        """The server is done with a request: free the objects put for it here."""
        for conn in self.connectors.values():
            conn.cleanup(request_id)

    async def release_session(self, session_id: str) -> None:
        self.replica.processor.release_session(session_id)
        for conn in self.connectors.values():
            conn.cleanup(session_id)

    async def health(self) -> dict[str, Any]:
        return {"load": self.replica.load(), "dead": self.replica.dead, "inflight": len(self.requests), "served": self.served,
                "digest": self.digest, "pid": os.getpid()}


class RemoteStage(StageProcessor):
    """The server's side of a stage replica placed in a Ray actor."""

    def __init__(self, pipeline: str, spec: StageSpec, index: int, connectors: Mapping[str, Connector], backends: Mapping[str, str],
                 runtime: type[Runtime]) -> None:
        super().__init__(spec, None, {})
        self.pipeline = pipeline
        self.index = index
        self.connectors = connectors  # the server's: client inputs are read from them, handles routed
        self.backends = dict(backends)
        self.runtime = f"{runtime.__module__}:{runtime.__qualname__}"
        self.digest = digest(spec)
        self.actor: Any = None
        self.owned = True
        self.info: dict[str, Any] = {}
        self._health: dict[str, Any] = {}
        self._why: str | None = "not started"
        self._poll: asyncio.Task[None] | None = None

    @property
    def actor_name(self) -> str:
        return f"omni-rt:{self.pipeline}:{self.spec.name}:{self.index}"

    def _options(self, shared: bool) -> dict[str, Any]:
        import ray

        p = self.spec.placement
        opts: dict[str, Any] = {"num_cpus": p.num_cpus, "num_gpus": p.num_gpus, "resources": dict(p.resources),
                                "max_restarts": p.max_restarts, "max_task_retries": 0, "max_concurrency": 10_000,
                                "name": self.actor_name, "namespace": NAMESPACE}
        if p.kind == "process":
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        if shared:  # several front ends attach to one set of stage actors, which outlive any of them
            opts.update(lifetime="detached", get_if_exists=True)
        return opts

    async def start(self) -> None:
        import ray

        shared = _shared
        try:
            existing = ray.get_actor(self.actor_name, namespace=NAMESPACE)
        except ValueError:
            existing = None
        if existing is not None:
            self.actor, self.owned = existing, False
        else:
            _feasible(self.spec)
            actor_cls = ray.remote(StageActor)
            self.actor = actor_cls.options(**self._options(shared)).remote(
                self.pipeline, self.spec.model_dump_json(), self.index, self.backends, self.runtime, self.digest
            )
            self.owned = not shared
        try:
            self.info = await asyncio.wait_for(self.actor.start.remote(), START_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the actor's own failure, named with the stage
            raise SpecError(f"stage {self.spec.name} replica {self.index} ({self.spec.placement.kind}) failed to start: {exc}") from None
        if self.info.get("digest") != self.digest:
            raise SpecError(f"stage {self.spec.name}: the running actor {self.actor_name} serves another definition of this stage "
                            f"than this server's deployment (stop it, or deploy the same pipeline)")
        self._why = None
        self._poll = asyncio.get_running_loop().create_task(self._watch(), name=f"health:{self.actor_name}")
        log.info("stage %s replica %d runs in Ray actor %s (pid %s)", self.spec.name, self.index, self.actor_name, self.info.get("pid"))

    async def stop(self) -> None:
        import ray

        if self._poll is not None:
            self._poll.cancel()
            await asyncio.gather(self._poll, return_exceptions=True)
        if self.actor is not None and self.owned:
            ray.kill(self.actor, no_restart=True)
        self.actor = None

    async def _watch(self) -> None:
        """Liveness and load of the actor, for the pool and /health."""
        while True:
            try:
                self._health = await asyncio.wait_for(self.actor.health.remote(), 5.0)
                self._why = self._health.get("dead")
            except Exception as exc:  # noqa: BLE001 - dead, restarting or unreachable
                self._why = f"actor {self.actor_name} unavailable: {type(exc).__name__}"
            await asyncio.sleep(HEALTH_EVERY_S)

    def unavailable(self) -> str | None:
        return self._why

    def queue_load(self) -> int:
        return int(self._health.get("load", 0))

    def describe_health(self) -> dict[str, Any]:
        return {"placement": self.spec.placement.kind, "actor": self.actor_name, "alive": self._why is None, **self._health}

    def release_session(self, session_id: str) -> None:
        if self.actor is not None and self._why is None:
            self.actor.release_session.remote(session_id)

    def _unavailable(self, exc: BaseException) -> StageUnavailable:
        self._why = f"actor {self.actor_name} unavailable: {type(exc).__name__}"
        return StageUnavailable(f"stage {self.spec.name} is unavailable (replica {self.index}, {self.spec.placement.kind}): "
                                f"{type(exc).__name__}; retry later")

    async def run(self, ctx: StageContext) -> None:
        from ray.exceptions import RayError

        if self.actor is None:
            raise StageUnavailable(f"stage {self.spec.name} replica {self.index} is not running")
        rid = ctx.request_id
        inputs = [(n, i.mode, i.chunking.model_dump_json()) for n, i in ctx.inputs.items()]
        finished = False
        keys: dict[int, int] = {}  # the actor's stream keys -> this server's meter's

        def replay(what: str, a: Any, b: Any, c: Any) -> None:
            """A report of the placed stage's into this server's meters."""
            if what == "cpu":
                if a == HOST and ctx.meters is not None:
                    ctx.meters.placed_cpu(int(b), float(c))
                return
            key = keys.get(a)
            if key is None:
                key = keys[a] = ctx.meter.new_stream()
            (ctx.meter.chunk if what == "chunk" else ctx.meter.sample)(key, float(b), time.monotonic() - float(c))
        feeders: list[asyncio.Task[None]] = []
        actor = self.actor
        for conn, _readers in ctx.groups:  # its outputs are freed there with the request, here
            c = self.connectors[conn]
            if isinstance(c, RayConnector):
                c.on_cleanup(rid, lambda: actor.cleanup.remote(rid))
                break
        try:
            try:
                await self.actor.open.remote(rid, dict(ctx.params), ctx.fence, inputs, ctx.groups)
            except RayError as exc:
                raise self._unavailable(exc) from None
            outputs = self.actor.outputs.remote(rid)
            feeders = [asyncio.get_running_loop().create_task(self._feed(ctx, n, i)) for n, i in ctx.inputs.items()]
            try:
                async for ref in outputs:
                    item = await ref
                    if item[0] == "outs":
                        for what, a, b, c in item[1]:
                            if what == "out":
                                ctx.route(a, b, c)
                            else:
                                replay(what, a, b, c)
                    elif item[0] == "usage":
                        ctx.add_usage(**item[1])
                    elif item[0] == "error":
                        raise item[1]
            except RayError as exc:
                raise self._unavailable(exc) from None
            finished = True
        finally:
            for t in feeders:
                t.cancel()
            if feeders:
                await asyncio.gather(*feeders, return_exceptions=True)
            if not finished and self.actor is not None:
                self.actor.abort.remote(rid)  # stop its engine work there; nothing waits for it

    async def _feed(self, ctx: StageContext, name: str, inp: StageInput) -> None:
        """The handles of one input to the actor; a client input held by the server's
        in-process connector is put into the replica's connector first."""
        here = self.spec.placement.connector
        k = 0
        async for batch, last in inp.handle_batches():
            sent: list[Handle] = []
            for handle in batch:
                if self.backends.get(handle.connector) != "ray":
                    payload = await self.connectors[handle.connector].aget(handle)
                    handle = self.connectors[here].put(ctx.request_id, f"{self.spec.name}/in/{name}/{k}", payload)
                    k += 1
                sent.append(handle)
            # one call at a time keeps the order (an async actor may run calls out of order)
            await self.actor.feed.remote(ctx.request_id, name, sent, ctx._state.current_fence(), last)


__all__ = ["NAMESPACE", "RemoteStage", "StageActor", "connect", "digest"]
