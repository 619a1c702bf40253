"""The whole server in-process over fakes: the real aiohttp app, the real pipeline
graphs, orchestrator, connectors, session manager and protocol adapters, with every
model-backed stage swapped for a fake (`FAKES`) and the session leases on a clock the
test moves (`FakeClock`).

    async with serve(["voice"]) as h:
        ws = await h.client.ws_connect("/v1/realtime")
        ...
        h.clock.advance(31); await h.sessions.reap()

This module is a composition root for tests (like `omni_server.app`): it builds the
app, so it may import every layer.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from omni_rt.engines.base import Engine
from omni_rt.engines.fake import FakeArEngine, FakeDiffusionEngine, FakeStepEngine, FakeVideoDiffusionEngine
from omni_rt.runtime import Runtime, import_processor
from omni_rt.specs import ProfileSpec, SpecError, StageSpec, parse_overlay
from omni_rt.stage import StageProcessor
from testkit.clock import FakeClock
from testkit.stages import code2wav_fn, moshi_fn, stt_fn
from testkit.vad import energy_vad


def _velocity(op: str | None, x: Any) -> Any:
    return x * 0.5


@dataclass(frozen=True)
class Speeds:
    token_s: float = 0.002  # per AR engine step (thinker, talker)
    step_s: float = 0.0  # per step-engine item (encoder, vocoder, policy)
    diffusion_step_s: float = 0.0


def _ar(name: str, sp: Speeds) -> Engine:
    return FakeArEngine(name=name, step_ms=sp.token_s * 1000)


# real processor -> (the processor that runs instead, or None for the real one;
# role -> engine factory)
FAKES: dict[str, tuple[str | None, dict[str, Callable[[str, Speeds], Engine]]]] = {
    "pipelines.voice:ThinkerProcessor": ("testkit.stages:FakeThinker", {"main": _ar}),
    "pipelines.tts:TalkerProcessor": ("testkit.stages:FakeTalker", {"main": _ar}),
    "pipelines.tts:Code2WavProcessor": (None, {"main": lambda n, sp: FakeStepEngine(code2wav_fn, n, sp.step_s)}),
    "pipelines.tts:FusedTalkerProcessor": (
        "testkit.stages:FakeFusedTalker",
        {"main": _ar, "decoder": lambda n, sp: FakeStepEngine(code2wav_fn, n, sp.step_s)}),
    "pipelines.asr:AsrProcessor": ("testkit.stages:FakeAsr", {"main": _ar}),
    "pipelines.stt:SttProcessor": ("testkit.stages:FakeStt", {"main": lambda n, sp: FakeStepEngine(stt_fn, n, sp.step_s)}),
    "pipelines.robot:PolicyProcessor": (
        "testkit.stages:FakePolicy", {"main": lambda n, sp: FakeStepEngine(_velocity, n, sp.step_s)}),
    "pipelines.image:ImageProcessor": (None, {"main": lambda n, sp: FakeDiffusionEngine(n, sp.diffusion_step_s)}),
    "pipelines.world:ForcingWorldProcessor": (
        "testkit.stages:FakeWorld", {"main": lambda n, sp: FakeDiffusionEngine(n, sp.diffusion_step_s)}),
    "pipelines.video:ClipProcessor": (None, {"main": lambda n, sp: FakeVideoDiffusionEngine(n, sp.diffusion_step_s)}),
    "pipelines.forcing:ForcingProcessor": (None, {"main": lambda n, sp: FakeVideoDiffusionEngine(n, sp.diffusion_step_s)}),
    "pipelines.moshi:MoshiProcessor": (
        "testkit.stages:FakeMoshi", {"main": lambda n, sp: FakeStepEngine(moshi_fn, n, sp.step_s)}),
}


class FakeRuntime(Runtime):
    """The runtime of the real pipeline graphs with the model-backed pieces faked."""

    def __init__(
        self, profiles: Mapping[str, ProfileSpec], connectors: Mapping[str, Any], resolve_model: Any = None, *, speeds: Speeds = Speeds()
    ) -> None:
        super().__init__(profiles, connectors)
        self.speeds = speeds

    def _fake(self, spec: StageSpec) -> tuple[str | None, dict[str, Callable[[str, Speeds], Engine]]]:
        try:
            return FAKES[spec.processor]
        except KeyError:
            raise SpecError(f"stage {spec.name}: no fake for processor {spec.processor}") from None

    def resolve_stage(self, pipeline: str, s: StageSpec) -> StageSpec:
        return s  # fakes load no weights

    def check_stage(self, pipeline: str, spec: StageSpec) -> None:
        return None  # nor read any model directory

    def processor_class(self, spec: StageSpec) -> type[StageProcessor]:
        return import_processor(self._fake(spec)[0] or spec.processor)

    def make_engine(self, spec: StageSpec, role: str, name: str, processor: type[StageProcessor]) -> Engine:
        return self._fake(spec)[1][role](name, self.speeds)


@dataclass
class Harness:
    app: Any
    client: TestClient
    clock: FakeClock

    @property
    def sessions(self) -> Any:
        from omni_server.app import SESSIONS

        return self.app[SESSIONS]

    @property
    def runtime(self) -> FakeRuntime:
        from omni_server.app import RUNTIME

        rt = self.app[RUNTIME]
        assert isinstance(rt, FakeRuntime)
        return rt

    def url(self, path: str = "", ws: bool = False) -> str:
        u = str(self.client.make_url(path))
        return u.replace("http://", "ws://", 1).replace("https://", "wss://", 1) if ws else u

    def processor(self, stage: str, replica: int = 0) -> Any:
        return self.runtime.pools[stage].replicas[replica].processor

    def engine(self, stage: str, replica: int = 0) -> Any:
        return self.runtime.pools[stage].replicas[replica].engine

    async def expire(self, seconds: float) -> list[str]:
        """Move the lease clock on and run one reaper pass: the sessions it ended."""
        self.clock.advance(seconds)
        ended: list[str] = await self.sessions.reap()
        return ended


class _Server(TestServer):
    """The server as `omni-rt serve` runs it (`omni_server.app.runner_options`): aiohttp's
    test server would cancel a handler when its client goes away; production does not
    (a socket handler hears the disconnect instead)."""

    def __init__(self, app: Any, options: Mapping[str, Any]) -> None:
        super().__init__(app)
        self.options = dict(options)

    async def _make_runner(self, **kwargs: Any) -> Any:
        return await super()._make_runner(**{**kwargs, **self.options})


@contextlib.asynccontextmanager
async def serve(
    pipelines: Iterable[str] = ("voice", "tts"),
    overlay: Mapping[str, Any] | None = None,
    *,
    speeds: Speeds = Speeds(),
    tls: Any = None,
    **options: Any,
) -> AsyncIterator[Harness]:
    """The app serving `pipelines` (the others disabled) over fakes. `overlay` is a
    deploy overlay (dict) merged over the harness defaults; `options` reach the wires
    (e.g. `vad`, `duplex_timing`). The reaper does not run on its own: tests expire
    sessions with `Harness.expire`. `tls`: (server, client) `ssl.SSLContext`s to serve
    https / wss with, as `omni-rt serve --ssl-certfile … --ssl-keyfile …` does."""
    import pipelines as builtin
    from omni_server.app import create_app, runner_options

    wanted = set(pipelines)
    data: dict[str, Any] = {
        "pipelines": {n: {"enabled": n in wanted} for n in builtin.load_all()},
        # Load-aware admission weighs no machine load here (the test process is the server, its
        # clients and the front end at once, and the machine runs other tests) and calibrates
        # nothing (fake stages; tests that want either set them).
        "sessions": {"reaper_interval_s": 60, "realtime_admission": {"calibrate": False, "weigh_outside_load": False, "weigh_front_end": False,
                                                                  "max_throttled_fraction": None}},
    }
    for key, value in (overlay or {}).items():
        if isinstance(value, Mapping) and isinstance(data.get(key), dict):
            merged = dict(data[key])
            for k, v in value.items():
                merged[k] = {**merged[k], **v} if isinstance(v, Mapping) and isinstance(merged.get(k), dict) else v
            data[key] = merged
        else:
            data[key] = value
    clock = FakeClock()
    parsed = parse_overlay(data, "test harness")
    app = create_app(
        parsed,
        "test harness",
        runtime_factory=functools.partial(FakeRuntime, speeds=speeds),
        clock=clock,
        # semantic_vad on its silence thresholds unless a test gives an end-of-turn model
        options={"vad": energy_vad, "turn_model": None, **options},
    )
    server = _Server(app, runner_options(parsed))
    if tls is not None:
        import aiohttp

        await server.start_server(ssl=tls[0])
        client = TestClient(server, connector=aiohttp.TCPConnector(ssl=tls[1]))
    else:
        client = TestClient(server)
    await client.start_server()
    try:
        yield Harness(app, client, clock)
    finally:
        await client.close()
