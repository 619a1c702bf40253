"""The stage side of a request: processors, their inputs and their outputs.

A `StageProcessor` is pipeline code (in `pipelines/`) that turns input payloads into
output payloads with the help of its replica's engine(s). It sees payloads; the
orchestrator only sees the handles that `StageContext.emit` publishes. The byte work
(connector put/get) happens here, in the stage worker, never in the orchestrator.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omni_rt import metrics
from omni_rt.connectors.base import Connector
from omni_rt.engines.base import Engine
from omni_rt.errors import StageError
from omni_rt.load import LoadMeters, RtfMeter, StreamMeter
from omni_rt.payloads import Fence, Handle, Payload
from omni_rt.specs import ChunkingSpec, SpecError, StageSpec
from omni_rt.status import RequestStatus

if TYPE_CHECKING:
    from omni_rt.orchestrator import _Group, _RequestState

__all__ = ["ProcessorArgs", "SamplingArgs", "StageContext", "StageError", "StageInput", "StageProcessor"]


_EOS = object()


class StageInput:
    """One input of a stage for one request: a stream of payloads ending at EOS.

    `mode` is the edge's mode (`chunk` or `batch`, or `client` for the entry stage's
    input from the client); `chunking` is the edge's chunking spec.
    """

    def __init__(
        self,
        name: str,
        mode: str,
        chunking: ChunkingSpec,
        connectors: Mapping[str, Connector],
        current_fence: Callable[[], Fence | None],
    ) -> None:
        self.name = name
        self.mode = mode
        self.chunking = chunking
        self._connectors = connectors
        self._current_fence = current_fence
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.closed = False
        self.dropped_stale = 0

    # -- orchestrator side (handles only) --
    def feed(self, handle: Handle) -> None:
        self._queue.put_nowait(handle)

    def end(self) -> None:
        if not self.closed:
            self.closed = True
            self._queue.put_nowait(_EOS)

    # -- stage side (payloads) --
    def __aiter__(self) -> AsyncIterator[Payload]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[Payload]:
        while True:
            item = await self._queue.get()
            if item is _EOS:
                return
            handle: Handle = item
            payload = await self._connectors[handle.connector].aget(handle)
            current = self._current_fence()
            # Fence check at the connector-get hop: a chunk from an older epoch never
            # reaches the stage's model.
            if current is not None and payload.fence.is_stale_against(current):
                self.dropped_stale += 1
                continue
            yield payload

    async def read_all(self) -> list[Payload]:
        return [p async for p in self]

    async def handle_batches(self) -> AsyncIterator[tuple[list[Handle], bool]]:
        """The input's handles as the orchestrator fed them, unread (a stage placed
        outside the server reads them itself), in order until EOS: lists of whatever
        has arrived by the time the reader asks (at least one, or none with EOS), each
        with whether EOS follows it. A remote reader sends each list in one call, so
        its calls fall behind the chunks' rate by batching instead of by queueing."""
        while True:
            batch: list[Handle] = []
            item = await self._queue.get()
            while item is not _EOS:
                batch.append(item)
                if self._queue.empty():
                    break
                item = self._queue.get_nowait()
            yield batch, item is _EOS
            if item is _EOS:
                return


class StageContext:
    """What a processor gets for one request on one stage."""

    def __init__(
        self,
        state: _RequestState,
        stage: StageSpec,
        inputs: dict[str, StageInput],
        connectors: Mapping[str, Connector],
        groups: list[_Group],
        route: Callable[[_Group, Handle, bool], None],
        meter: StreamMeter | None = None,
        meters: LoadMeters | None = None,
    ) -> None:
        self._state = state
        # the server's load meters (None in a placed stage's actor), and where the
        # stage's streams report their generation speed: the server's meter, or a placed
        # stage's recorder that sends the reports back with its outputs
        self.meters = meters
        self.meter: StreamMeter = meter if meter is not None else meters.generation if meters is not None else RtfMeter()
        self.stage = stage
        self.inputs = inputs
        self._connectors = connectors
        self._groups = groups
        self._route = route
        self.emitted = 0

    @property
    def request_id(self) -> str:
        return self._state.request_id

    @property
    def fence(self) -> Fence:
        return self._state.fence

    @property
    def params(self) -> Mapping[str, Any]:
        return self._state.params

    def add_usage(self, **counts: int) -> None:
        """Count usage (tokens, frames) reported with the request's completion."""
        usage = self._state.usage
        for k, v in counts.items():
            usage[k] = usage.get(k, 0) + int(v)

    def input(self, name: str | None = None) -> StageInput:
        if name is None:
            if len(self.inputs) != 1:
                raise KeyError(f"stage {self.stage.name} has inputs {sorted(self.inputs)}; name one")
            return next(iter(self.inputs.values()))
        return self.inputs[name]

    def route(self, group: int, handle: Handle, last: bool) -> None:
        """Route a handle a stage placed outside the server published for its
        `group`-th output group (the connector put happened there)."""
        if self._state.status is RequestStatus.RUNNING:
            self._route(self._groups[group], handle, last)
            self.emitted += 1

    @property
    def groups(self) -> list[tuple[str, int]]:
        """(connector, readers) of each output group: where and for how many
        consumers each output is put."""
        return [(g.connector, len(g.consumers)) for g in self._groups]

    async def emit(self, payload: Payload, *, last: bool = False) -> None:
        """Publish one output chunk to every consumer (client and/or next stages).

        One connector put per connector in use; the orchestrator gets only handles.
        """
        if payload.fence != self._state.fence:
            raise StageError(f"stage {self.stage.name} emitted a payload with a foreign fence")
        if self._state.status is not RequestStatus.RUNNING:
            return  # finished or aborted: nothing would read it, so store nothing
        current = self._state.current_fence()
        if current is not None and payload.fence.is_stale_against(current):
            # Engine-output hop: the turn was cancelled; do not even store the bytes.
            metrics.DROPPED_STALE.labels(hop="engine").inc()
            return
        key = f"{self.stage.name}/{self.emitted}"
        for group in self._groups:
            handle = self._connectors[group.connector].put(
                self._state.request_id, key, payload, readers=len(group.consumers)
            )
            self._route(group, handle, last)
        self.emitted += 1
        # Yield to the loop between chunks so one busy stream never starves others.
        await asyncio.sleep(0)


E = TypeVar("E")


A = TypeVar("A", bound="ProcessorArgs")


class ProcessorArgs(BaseModel):
    """A processor's `processor_args`: each one's type, range and default, written once
    (`omni-rt check` builds every stage, so a bad value is refused there, naming it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def parse(cls: type[A], args: Mapping[str, Any], what: str, under: Mapping[str, Any] | None = None) -> A:
        """`args` over `under` (say, a checkpoint's own sampling) over the defaults."""
        try:
            return cls.model_validate({**(under or {}), **args})
        except ValidationError as err:
            bad = "; ".join(
                (f"{'.'.join(map(str, e['loc']))}: " if e["loc"] else "") + str(e["msg"]).removeprefix("Value error, ") for e in err.errors()
            )
            raise ValueError(f"{what}: {bad}") from None


class SamplingArgs(ProcessorArgs):
    """A token sampler's settings (vLLM's names; `top_k` -1: off)."""

    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    repetition_penalty: float = Field(default=1.0, gt=0.0)

    def sampling(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "repetition_penalty": self.repetition_penalty}


class StageProcessor(abc.ABC):
    """Pipeline code for one stage, one instance per replica."""

    # A stage whose output must keep pace with playback or a frame clock (a talker, a
    # vocoder, a full-duplex model's step): on a CPU its torch engine computes in
    # float32 whatever dtype it was given (omni_rt.dtypes).
    REALTIME: bool = False

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        self.spec = spec
        self.engine = engine
        self.aux = aux

    @staticmethod
    def torch_module(model_dir: str, role: str) -> Callable[[], Any] | None:
        """For stages on a torch engine: a factory of the `nn.Module` the engine runs,
        built from the stage's model directory (`role`: "main" or an aux engine's name).
        None: the stage cannot run on a torch engine."""
        return None

    @classmethod
    def check_model(cls, model_dir: str) -> None:  # noqa: B027 - optional hook
        """Refuse (StageError) a model directory this stage cannot load, from its config
        and processor files alone (no weights are read): `omni-rt check` and serve
        call it before any engine starts. By default every directory passes."""
        return None

    @classmethod
    def check_spec(cls, spec: StageSpec) -> None:
        """`check_model` for a stage whose check needs more than the model directory
        (its processor_args name another directory, say). By default: check_model."""
        if spec.model is not None:
            cls.check_model(spec.model)

    def engine_as(self, contract: type[E], role: str = "main") -> E:
        """This replica's engine (`role` "main") or aux engine, checked against the
        contract the processor programs against (`omni_rt.engines.base`)."""
        engine = self.engine if role == "main" else self.aux.get(role)
        if not isinstance(engine, contract):
            what = "no engine" if engine is None else f"a {type(engine).__name__}"
            where = "" if role == "main" else f" aux engine {role!r}:"
            raise SpecError(f"stage {self.spec.name}:{where} needs an {contract.__name__} engine, got {what}")
        return engine

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Called once after the replica's engines started (load tokenizers, warm up)."""

    async def stop(self) -> None:  # noqa: B027 - optional hook
        """Called once when the server stops, after the replica's engines stopped."""

    def unavailable(self) -> str | None:
        """Why this replica takes no work, where it is not its engines that say so (a
        replica placed outside the server whose actor is gone); None: it takes work."""
        return None

    def queue_load(self) -> int:
        """Work waiting in or running on this replica, where its engines do not count
        it (a replica placed outside the server)."""
        return 0

    def describe_health(self) -> dict[str, Any] | None:
        """What /health shows of this replica beyond its engines (None: nothing)."""
        return None

    def release_session(self, session_id: str) -> None:  # noqa: B027 - optional hook
        """A session ended: drop any state this replica keeps for it (KV prefixes,
        latent buffers, episode state). Called once per session per replica."""

    @abc.abstractmethod
    async def run(self, ctx: StageContext) -> None:
        """Consume `ctx.inputs`, `await ctx.emit(...)` outputs; return when done.

        Cancellation (abort, disconnect) arrives as CancelledError and must free any
        engine work the processor started (engines' generators do this themselves).
        """
