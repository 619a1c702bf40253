"""Which wire protocols exist, and what a wire gets when it is mounted.

A pipeline names the wires it is served on (`wires:` in its YAML); the composition
root mounts each one with a `Mount`: the session manager, the pipeline, the server
settings, the pipeline's entry stage (read through a contract the wire declares) and
the route table. Adding a pipeline with a wire of its own touches its YAML, its
processors, its protocol module and the table below.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from omni_rt.specs import PipelineSpec, ServerSpec, SpecError
from sessions import SessionManager

# wire name -> "module:function" that mounts it (imported only when a pipeline uses it)
WIRES: dict[str, str] = {
    "speech": "protocols.speech:mount",
    "transcriptions": "protocols.transcriptions:mount",
    "chat": "protocols.chat:mount",
    "realtime": "protocols.realtime:mount",
    "live": "protocols.live:mount",
    "duplex": "protocols.duplex:mount",
    "webrtc": "protocols.webrtc:mount",
    "twilio": "protocols.telephony.twilio:mount",
    "telnyx": "protocols.telephony.twilio:mount_telnyx",
    "images": "protocols.images:mount",
    "world": "protocols.world:mount",
    "videos": "protocols.videos:mount",
    "video_live": "protocols.videos:mount_live",
    "openpi": "protocols.openpi:mount",
    # a full-duplex speech model (Moshi's contract: audio in and out every frame), on
    # /v1/duplex?model= and on WebRTC calls
    "duplex_model": "protocols.duplex.model:mount",
    "webrtc_duplex_model": "protocols.webrtc.model:mount",
    "live_duplex_model": "protocols.live:mount_duplex_model",
}
# names a deploy file may still use for a wire that was renamed
WIRE_ALIASES: dict[str, str] = {"moshi_duplex": "duplex_model", "moshi_webrtc": "webrtc_duplex_model"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
C = TypeVar("C")


@dataclass
class Routes:
    """The server's route table, filled by every wire before the app is built. A
    WebSocket route may share a path with a plain GET page (OpenPI at `/`)."""

    http: dict[tuple[str, str], Handler] = field(default_factory=dict)
    websocket: dict[str, Handler] = field(default_factory=dict)
    # a WebSocket path several pipelines serve, told apart by `?model=` (/v1/duplex):
    # path -> model -> handler; a request naming none of them goes to `websocket[path]`
    by_model: dict[str, dict[str, Handler]] = field(default_factory=dict)
    # the same for HTTP routes (POST /v1/realtime/calls?model=...): (method, path) -> model -> handler
    http_by_model: dict[tuple[str, str], dict[str, Handler]] = field(default_factory=dict)
    index: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, what) for the index page

    def add(self, method: str, path: str, handler: Handler, source: str, model: str | None = None) -> None:
        if model is not None:
            models = self.http_by_model.setdefault((method, path), {})
            if model in models:
                raise SpecError(f"{source}: {method} {path}?model={model} is served by another wire already")
            models[model] = handler
            return
        if (method, path) in self.http:
            raise SpecError(f"{source}: {method} {path} is served by another wire already")
        self.http[(method, path)] = handler

    def add_websocket(self, path: str, handler: Handler, source: str, model: str | None = None) -> None:
        if model is not None:
            models = self.by_model.setdefault(path, {})
            if model in models:
                raise SpecError(f"{source}: the WebSocket {path}?model={model} is served by another wire already")
            models[model] = handler
            return
        if path in self.websocket:
            raise SpecError(f"{source}: the WebSocket {path} is served by another wire already")
        self.websocket[path] = handler

    def install(self, app: web.Application) -> None:
        for key, models in self.http_by_model.items():
            self.http[key] = _by_model(models, self.http.get(key))
        for path in sorted({p for _, p in self.http} | set(self.websocket) | set(self.by_model)):
            ws = self.websocket.get(path)
            if path in self.by_model:
                ws = _by_model(self.by_model[path], ws)
            page = self.http.get(("GET", path))
            if ws is not None:
                app.router.add_get(path, _upgrade_or(ws, page))
            for (method, p), handler in self.http.items():
                if p == path and not (ws is not None and method == "GET"):
                    app.router.add_route(method, path, handler)


def _by_model(models: dict[str, Handler], default: Handler | None) -> Handler:
    """Dispatch a route on `?model=`: a model some pipeline serves here goes to it; any
    other (or none) to `default`, else to the only model's handler."""
    fallback = default if default is not None else next(iter(models.values())) if len(models) == 1 else None

    async def dispatch(request: web.Request) -> web.StreamResponse:
        handler = models.get(request.query.get("model", ""), fallback)
        if handler is None:
            from omni_rt.errors import ClientError

            raise ClientError(f"Name the model with ?model=; served here: {', '.join(sorted(models))}.", param="model")
        return await handler(request)

    return dispatch


def _upgrade_or(ws: Handler, page: Handler | None) -> Handler:
    async def dispatch(request: web.Request) -> web.StreamResponse:
        if request.headers.get("upgrade", "").lower() == "websocket" or page is None:
            return await ws(request)
        return await page(request)

    return dispatch


@dataclass
class Mount:
    """What one wire gets for one pipeline."""

    wire: str
    sessions: SessionManager
    pipeline: PipelineSpec
    server: ServerSpec
    entry_processor: Any  # the pipeline's entry stage processor (any replica: they are configured alike)
    routes: Routes
    options: dict[str, Any] = field(default_factory=dict)  # test hooks (e.g. "vad": a voice-activity detector factory)
    # the entry stage's replicas (`omni_rt.stage_pool.StagePool`): a wire that reserves
    # room on the replica that will run its session picks and pins it there
    entry_pool: Any = None

    @property
    def source(self) -> str:
        return f"pipelines.{self.pipeline.name}.wires.{self.wire}"

    def processor(self, contract: type[C]) -> C:
        """The pipeline's entry stage, read through the contract the wire needs (a
        runtime-checkable Protocol): a clear error at start-up if it does not fit."""
        proc = self.entry_processor
        if not isinstance(proc, contract):
            raise SpecError(f"{self.source}: the entry stage's processor {type(proc).__name__} does not offer {contract.__name__}")
        return proc

    def route(self, method: str, path: str, handler: Handler, what: str | None = None, model: str | None = None) -> None:
        self.routes.add(method, path, handler, self.source, model)
        if what is not None:
            self.routes.index.append((method, path, what))

    def websocket(self, path: str, handler: Handler, what: str | None = None, model: str | None = None) -> None:
        self.routes.add_websocket(path, handler, self.source, model)
        if what is not None:
            self.routes.index.append(("WS", path, what))


def resolve(wire: str, source: str = "deploy") -> str:
    """The "module:function" that mounts `wire` (a renamed wire's old name too)."""
    target = WIRES.get(WIRE_ALIASES.get(wire, wire))
    if target is None:
        raise SpecError(f"{source}: unknown wire {wire!r}; known: {', '.join(sorted(WIRES))}")
    return target


def mount(m: Mount) -> None:
    module, _, fn = resolve(m.wire, m.source).partition(":")
    getattr(importlib.import_module(module), fn)(m)
