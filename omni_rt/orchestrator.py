"""The orchestrator: admits requests into a stage graph and tracks their lifecycle.

It picks replicas, starts stage tasks, routes the *handles* each stage publishes (to
the client, to the next stage, or both), and completes a request when every stage of
its final-output set is done. It never reads or writes payload bytes: connectors do
that, called from the stage side (`omni_rt.stage`) and the client side
(`omni_rt.request`).

Edges: `chunk` edges start the destination at admission and forward every handle as
it is published; `batch` edges buffer handles and start the destination when the
source finishes. Streaming input: the entry stage's `client` input stays open until
`end_input`; inputs for unknown or finished ids are dropped (tombstones keep a late
chunk from reviving a cancelled request).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omni_rt import metrics, tracing
from omni_rt.connectors.base import Connector
from omni_rt.errors import InternalError, OmniError, OrchestratorError
from omni_rt.load import LoadMeters
from omni_rt.payloads import SPEECH_STAGES, Fence, Handle, Payload
from omni_rt.specs import ChunkingSpec, EdgeSpec, ProfileSpec
from omni_rt.stage import StageContext, StageInput
from omni_rt.stage_pool import Replica, StagePool
from omni_rt.status import RequestStatus

if TYPE_CHECKING:
    from omni_rt.request import RequestStream

log = logging.getLogger("omni_rt.orchestrator")

CLIENT = "client"  # consumer / input name for the client side


# ---- events the client side receives --------------------------------------------------


@dataclass(frozen=True, slots=True)
class OutputEvent:
    stage: str
    handle: Handle
    last: bool


@dataclass(frozen=True, slots=True)
class DoneEvent:
    status: RequestStatus  # completed | aborted | failed
    reason: str | None = None  # why it was aborted
    error: OmniError | None = None  # why it failed (what the client is told)
    usage: Mapping[str, int] | None = None


Event = OutputEvent | DoneEvent


@dataclass
class _Group:
    """One put per connector: every consumer that reads through it."""

    connector: str
    consumers: list[EdgeSpec | str]  # EdgeSpec, or CLIENT


@dataclass
class _RequestState:
    request_id: str
    pipeline: str
    profile: ProfileSpec
    entry: str
    fence: Fence
    params: Mapping[str, Any]
    affinity: str | None
    active: set[str]
    finals: set[str]
    fence_source: Callable[[], Fence] | None
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    inputs: dict[str, dict[str, StageInput]] = field(default_factory=dict)
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    replicas: dict[str, Replica] = field(default_factory=dict)
    groups: dict[str, list[_Group]] = field(default_factory=dict)
    batch_buffers: dict[str, list[Handle]] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    status: RequestStatus = RequestStatus.RUNNING
    started_at: float = field(default_factory=time.monotonic)
    stage_started: dict[str, float] = field(default_factory=dict)
    dropped_stale: int = 0
    usage: dict[str, int] = field(default_factory=dict)
    connectors_used: set[str] = field(default_factory=set)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    span: Any = None  # the request's trace span (omni_rt.tracing)
    stage_spans: dict[str, Any] = field(default_factory=dict)
    first_out: set[str] = field(default_factory=set)  # final stages whose first output went out

    def current_fence(self) -> Fence | None:
        return self.fence_source() if self.fence_source is not None else None


class Orchestrator:
    def __init__(
        self,
        pipelines: Mapping[str, ProfileSpec],
        pools: Mapping[str, StagePool],
        connectors: Mapping[str, Connector],
        tombstone_limit: int = 10_000,
        meters: LoadMeters | None = None,
    ) -> None:
        self.pipelines = dict(pipelines)
        # this server's load meters: its stages report to them, admission reads them
        self.meters = meters if meters is not None else LoadMeters()
        self.pools = dict(pools)
        self.connectors = dict(connectors)
        self._requests: dict[str, _RequestState] = {}
        self._tombstones: OrderedDict[str, str] = OrderedDict()
        self._tombstone_limit = tombstone_limit
        self._ids = itertools.count()
        self.stats = {"submitted": 0, "completed": 0, "aborted": 0, "failed": 0, "dropped_inputs": 0, "dropped_stale": 0}

    # ---- admission -------------------------------------------------------------------

    def submit(
        self,
        pipeline: str,
        *,
        fence: Fence,
        params: Mapping[str, Any] | None = None,
        request_id: str | None = None,
        outputs: set[str] | None = None,
        affinity: str | None = None,
        fence_source: Callable[[], Fence] | None = None,
        entry: str | None = None,
        trace_parent: Any = None,
    ) -> RequestStream:
        """Admit a request. Inputs for the entry stage follow through the stream.
        `trace_parent`: the span its trace span is a child of (its session's).

        `entry` starts the request at a later stage than the profile's entry (a
        text-only chat turn has nothing for the audio encoder: it enters at the
        thinker). Only stages on a path from it to the requested outputs run.
        """
        from omni_rt.request import RequestStream

        profile = self.pipelines.get(pipeline)
        if profile is None:
            raise OrchestratorError(f"unknown pipeline {pipeline!r}")
        rid = request_id or f"req-{next(self._ids)}-{time.monotonic_ns():x}"
        if rid in self._requests or rid in self._tombstones:
            raise OrchestratorError(f"request id {rid!r} is already in use")
        finals = set(profile.final_outputs) if outputs is None else set(outputs)
        unknown = finals - set(profile.final_outputs)
        if not finals or unknown:
            raise OrchestratorError(f"outputs {sorted(unknown) or '[]'} are not final outputs of {pipeline!r}")
        entry = entry or profile.entry
        if entry not in {s.name for s in profile.stages}:
            raise OrchestratorError(f"entry {entry!r} is not a stage of {pipeline!r}")
        active = _active_stages(profile, finals, entry)
        if not finals <= active:
            raise OrchestratorError(f"outputs {sorted(finals - active)} cannot be reached from entry {entry!r}")
        for e in profile.edges:
            if e.dst in active and e.dst != entry and e.src not in active:
                raise OrchestratorError(f"stage {e.dst!r} takes input from {e.src!r}, which does not run for a request entering at {entry!r}")
        state = _RequestState(
            request_id=rid,
            pipeline=pipeline,
            profile=profile,
            entry=entry,
            fence=fence,
            params=dict(params or {}),
            affinity=affinity,
            active=active,
            finals=finals,
            fence_source=fence_source,
        )
        state.span = tracing.span(f"request {pipeline}", trace_parent, **{
            "omni_rt.request.id": rid, "omni_rt.pipeline": pipeline, "omni_rt.entry": entry, "omni_rt.outputs": sorted(finals)})
        self._requests[rid] = state
        self.stats["submitted"] += 1
        for name in profile.order():
            if name in state.active:
                state.groups[name] = self._plan_groups(state, name)
        # Entry stage and every stage fed by a chunk edge start now; batch-fed stages
        # start when all their batch sources have finished.
        try:
            for name in profile.order():
                if name not in state.active:
                    continue
                in_edges = [e for e in profile.in_edges(name) if e.src in state.active]
                if name == entry or any(e.mode == "chunk" for e in in_edges):
                    self._start_stage(state, name)
        except BaseException:
            # Nothing may stay registered for a request its caller never got.
            self._finish(state, RequestStatus.FAILED, error=InternalError("request could not start"))
            self.release(rid)
            raise
        return RequestStream(self, state)

    def _plan_groups(self, state: _RequestState, stage: str) -> list[_Group]:
        groups: dict[str, _Group] = {}
        consumers: list[tuple[str, EdgeSpec | str]] = []
        if stage in state.finals:
            # Output to the client travels through the connector of the stage's first
            # out edge if there is one, else in-process.
            # (A stage placed outside the server puts it into its own connector.)
            out = [e for e in state.profile.out_edges(stage) if e.dst in state.active]
            placement = self.pools[stage].spec.placement
            consumers.append((out[0].connector if out else placement.connector if placement.remote else "inproc", CLIENT))
        for e in state.profile.out_edges(stage):
            if e.dst in state.active:
                consumers.append((e.connector, e))
        for conn, consumer in consumers:
            groups.setdefault(conn, _Group(conn, [])).consumers.append(consumer)
            state.connectors_used.add(conn)
        return list(groups.values())

    def _start_stage(self, state: _RequestState, name: str) -> None:
        if name in state.tasks:
            return
        spec = state.profile.stage(name)
        pool = self.pools[name]
        replica = pool.pick(state.affinity)
        replica.active += 1
        state.replicas[name] = replica
        inputs = state.inputs.setdefault(name, {})
        if name == state.entry:
            inputs.setdefault(CLIENT, StageInput(CLIENT, "client", ChunkingSpec(), self.connectors, state.current_fence))
        for e in state.profile.in_edges(name):
            if e.src in state.active:
                inputs.setdefault(e.name, StageInput(e.name, e.mode, e.chunking, self.connectors, state.current_fence))
        ctx = StageContext(state, spec, inputs, self.connectors, state.groups[name], self._on_published(state, name), meters=self.meters)
        state.stage_started[name] = time.monotonic()
        state.stage_spans[name] = tracing.span(f"stage {name}", state.span, **{"omni_rt.stage": name, "omni_rt.replica": replica.index})
        task = asyncio.get_running_loop().create_task(replica.processor.run(ctx), name=f"{state.request_id}:{name}")
        state.tasks[name] = task
        task.add_done_callback(functools.partial(self._on_stage_done, state, name))

    # ---- routing (handles only) ------------------------------------------------------

    def _on_published(self, state: _RequestState, stage: str) -> Callable[[_Group, Handle, bool], None]:
        def route(group: _Group, handle: Handle, last: bool) -> None:
            if state.status is not RequestStatus.RUNNING:
                return
            current = state.current_fence()
            if current is not None and handle.fence.is_stale_against(current):
                # Stale turn: nothing of it goes anywhere. Its bytes are freed with
                # the request's connector cleanup.
                state.dropped_stale += 1
                self.stats["dropped_stale"] += 1
                metrics.DROPPED_STALE.labels(hop="orchestrator").inc()
                return
            for consumer in group.consumers:
                if consumer == CLIENT:
                    if stage not in state.first_out:
                        state.first_out.add(stage)
                        if state.span is not None and state.span.is_recording():
                            what = "first_audio" if stage in SPEECH_STAGES else "first_token" if stage == "thinker" else "first_output"
                            state.span.add_event(what, {"omni_rt.stage": stage, "omni_rt.seconds": round(time.monotonic() - state.started_at, 4)})
                    state.events.put_nowait(OutputEvent(stage, handle, last))
                else:
                    assert isinstance(consumer, EdgeSpec)
                    if consumer.mode == "chunk":
                        state.inputs[consumer.dst][consumer.name].feed(handle)
                    else:
                        state.batch_buffers.setdefault(consumer.name, []).append(handle)

        return route

    def _on_stage_done(self, state: _RequestState, name: str, task: asyncio.Task[None]) -> None:
        # A done-callback's exception would be swallowed by the loop and leave the
        # request running forever: any failure here ends the request as failed.
        try:
            self._stage_done(state, name, task)
        except Exception as exc:  # noqa: BLE001 - reported through the request
            log.error("request %s: finishing stage %s failed", state.request_id, name, exc_info=exc)
            self._finish(state, RequestStatus.FAILED, error=_client_error(exc, state.request_id, name))

    def _stage_done(self, state: _RequestState, name: str, task: asyncio.Task[None]) -> None:
        replica = state.replicas.get(name)
        if replica is not None:
            replica.active -= 1
        metrics.STAGE_SECONDS.labels(pipeline=state.pipeline, stage=name).observe(
            time.monotonic() - state.stage_started.get(name, state.started_at)
        )
        tracing.end(state.stage_spans.pop(name, None), None if task.cancelled() else task.exception())
        if state.status is not RequestStatus.RUNNING:
            return
        if task.cancelled():
            return  # abort path already settled the request
        exc = task.exception()
        if exc is not None:
            self._finish(state, RequestStatus.FAILED, error=_client_error(exc, state.request_id, name))
            return
        state.done.add(name)
        for e in state.profile.out_edges(name):
            if e.dst not in state.active:
                continue
            if e.mode == "chunk":
                state.inputs[e.dst][e.name].end()
            elif e.dst in state.tasks:
                # the destination already runs (another edge feeds it chunk by chunk):
                # this batch input is complete now
                self._hand_over(state, e)
            elif all(x.src in state.done for x in state.profile.in_edges(e.dst) if x.src in state.active and x.mode == "batch"):
                # the last batch source of a destination that waits for all of them
                self._start_stage(state, e.dst)
                for be in state.profile.in_edges(e.dst):
                    if be.mode == "batch" and be.src in state.active:
                        self._hand_over(state, be)
        if state.finals <= state.done:
            self._finish(state, RequestStatus.COMPLETED)

    def _hand_over(self, state: _RequestState, edge: EdgeSpec) -> None:
        """A finished batch source's buffered handles to its (running) destination."""
        inp = state.inputs[edge.dst][edge.name]
        for h in state.batch_buffers.pop(edge.name, []):
            inp.feed(h)
        inp.end()

    # ---- streaming input ---------------------------------------------------------------

    def push_input(self, request_id: str, handle: Handle) -> bool:
        """Feed one entry-stage input. False (dropped) for unknown, finished or closed ids."""
        state = self._requests.get(request_id)
        if state is None or state.status is not RequestStatus.RUNNING:
            self.stats["dropped_inputs"] += 1
            return False
        inp = state.inputs.get(state.entry, {}).get(CLIENT)
        if inp is None or inp.closed:
            self.stats["dropped_inputs"] += 1
            return False
        current = state.current_fence()
        if current is not None and handle.fence.is_stale_against(current):
            self.stats["dropped_inputs"] += 1
            return False
        state.connectors_used.add(handle.connector)
        inp.feed(handle)
        return True

    def end_input(self, request_id: str) -> bool:
        state = self._requests.get(request_id)
        if state is None or state.status is not RequestStatus.RUNNING:
            return False
        inp = state.inputs.get(state.entry, {}).get(CLIENT)
        if inp is not None:
            inp.end()
        return True

    def is_tombstoned(self, request_id: str) -> bool:
        return request_id in self._tombstones

    # ---- completion, abort -------------------------------------------------------------

    def _finish(self, state: _RequestState, status: RequestStatus, reason: str | None = None, error: OmniError | None = None) -> None:
        if state.status is not RequestStatus.RUNNING:
            return
        state.status = status
        self.stats[status.value] += 1
        metrics.REQUESTS.labels(pipeline=state.pipeline, status=status.value).inc()
        for task in state.tasks.values():
            if not task.done():
                task.cancel()
        for stage_inputs in state.inputs.values():
            for inp in stage_inputs.values():
                inp.end()
        self._tombstone(state.request_id, status.value)
        if status is not RequestStatus.COMPLETED:
            # Nothing more will be read: free every key now.
            self._cleanup_connectors(state)
        state.events.put_nowait(DoneEvent(status, reason=reason, error=error, usage=dict(state.usage)))
        state.finished.set()
        if state.span is not None and state.span.is_recording():
            state.span.set_attribute("omni_rt.request.status", status.value)
            for k, v in state.usage.items():
                state.span.set_attribute(f"omni_rt.usage.{k}", v)
        tracing.end(state.span, error)

    async def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Cancel every stage of a request, wait for them to stop, free connector keys."""
        state = self._requests.get(request_id)
        if state is None:
            return False
        if state.status is RequestStatus.RUNNING:
            self._finish(state, RequestStatus.ABORTED, reason=reason)
        tasks = [t for t in state.tasks.values() if not t.done()]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        return True

    def release(self, request_id: str) -> None:
        """The client side is done with a request: free whatever it still holds."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        self._cleanup_connectors(state)

    def _cleanup_connectors(self, state: _RequestState) -> None:
        for name in state.connectors_used | {"inproc"}:
            conn = self.connectors.get(name)
            if conn is not None:
                conn.cleanup(state.request_id)

    def _tombstone(self, request_id: str, status: str) -> None:
        self._tombstones[request_id] = status
        while len(self._tombstones) > self._tombstone_limit:
            self._tombstones.popitem(last=False)

    def release_session(self, session_id: str) -> None:
        """A session ended: stages drop what they keep for it, replicas forget its
        affinity, and connector keys stored under the session id are freed."""
        for pool in self.pools.values():
            pool.release_affinity(session_id)
            for replica in pool.replicas:
                try:
                    replica.processor.release_session(session_id)
                except Exception:  # noqa: BLE001 - free the rest regardless
                    log.exception("stage %s: release_session(%s) failed", pool.spec.name, session_id)
        for conn in self.connectors.values():
            conn.cleanup(session_id)

    # ---- introspection ---------------------------------------------------------------

    def running(self) -> list[str]:
        return [rid for rid, s in self._requests.items() if s.status is RequestStatus.RUNNING]

    def running_by_pipeline(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self._requests.values():
            if s.status is RequestStatus.RUNNING:
                out[s.pipeline] = out.get(s.pipeline, 0) + 1
        return out

    def engine_load(self) -> dict[str, int]:
        return {name: pool.load() for name, pool in self.pools.items()}


def _client_error(exc: BaseException, request_id: str, stage: str) -> OmniError:
    """What the client hears of a stage failure: one of our errors as it is (logged at
    info when it is shown to the client: often its own bad input), anything else as a
    generic internal error, logged with its traceback."""
    if isinstance(exc, OmniError):
        if exc.expose:
            log.info("request %s stage %s failed: %s", request_id, stage, exc)
        else:
            log.error("request %s stage %s failed: %s", request_id, stage, exc, exc_info=exc)
        return exc
    log.error("request %s stage %s failed", request_id, stage, exc_info=exc)
    return InternalError(f"stage {stage} failed: {type(exc).__name__}")


def _active_stages(profile: ProfileSpec, finals: set[str], entry: str) -> set[str]:
    """Stages on some path from `entry` to a requested final output.

    This is the skip hook: a text-only request of a voice pipeline names only the
    thinker as its output, so talker and code2wav never start; one with no audio
    input enters at the thinker, so the audio encoder does not start either.
    """
    reach = {entry}
    changed = True
    while changed:
        changed = False
        for e in profile.edges:
            if e.src in reach and e.dst not in reach:
                reach.add(e.dst)
                changed = True
    needed = set(finals) & reach
    changed = True
    while changed:
        changed = False
        for e in profile.edges:
            if e.dst in needed and e.src in reach and e.src not in needed:
                needed.add(e.src)
                changed = True
    return needed


__all__ = ["Orchestrator", "OrchestratorError", "OutputEvent", "DoneEvent", "Event", "CLIENT", "Payload", "RequestStatus"]
