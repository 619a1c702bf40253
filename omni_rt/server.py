"""Composition root: reads the deploy overlay, builds the runtime, mounts the protocols."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import pipelines
from omni_rt import metrics
from omni_rt.runtime import Runtime
from omni_rt.specs import DeployOverlay, PipelineOverlay, ProfileSpec, SessionsSpec, SpecError, apply_overlay
from protocols.auth import AuthMiddleware, KeyRing
from protocols.openai_http import (
    APIError,
    SpeechService,
    api_error_handler,
    build_router,
    error_body,
    validation_error_handler,
)
from protocols.chat import ChatService, build_chat_router
from protocols.duplex import build_duplex_router
from protocols.images import ImageService, build_images_router
from protocols.openpi import build_openpi_router
from protocols.videos import build_videos_router
from protocols.world import build_world_router
from protocols.pages import build_pages_router
from protocols.webrtc import build_webrtc_router, configure_ice
from protocols.realtime import build_realtime_router
from protocols.sessions_api import build_sessions_router
from sessions import SessionManager

log = logging.getLogger("omni_rt.server")

DEFAULT_MODELS_DIR = "~/.cache/omni-rt/models"
TINY_PREFIX = "tiny:"


def models_dir(overlay: DeployOverlay) -> Path:
    raw = overlay.server.models_dir or os.environ.get("OMNI_RT_MODELS_DIR") or DEFAULT_MODELS_DIR
    return Path(raw).expanduser()


class ModelResolver:
    """Maps a stage's `model` to a local directory; builds tiny checkpoints on demand."""

    def __init__(self, root: Path, build: bool, source: str) -> None:
        self.root = root
        self.build = build
        self.source = source
        self._tiny: dict[str, Path] | None = None

    def __call__(self, model: str, key: str) -> str:
        if model.startswith(TINY_PREFIX):
            name = model[len(TINY_PREFIX):]
            if self._tiny is None:
                from pipelines.tiny import build_tiny, tiny_status

                if not self.build and not tiny_status(self.root):
                    raise SpecError(
                        f"{self.source}: tiny checkpoints are missing under {self.root} and server.build_tiny is false; "
                        "run `omni-rt models build-tiny`"
                    )
                self._tiny = {k: Path(v) for k, v in build_tiny(self.root).items()}
            if name not in self._tiny:
                raise SpecError(f"{self.source}: {key}: unknown tiny checkpoint {model!r}; known: {sorted(self._tiny)}")
            return str(self._tiny[name])
        path = Path(model).expanduser()
        if not path.is_dir():
            raise SpecError(f"{self.source}: {key}: model directory {model!r} does not exist (weights load from local directories)")
        return str(path)


def resolve_profiles(overlay: DeployOverlay, source: str) -> tuple[dict[str, ProfileSpec], dict[str, Any]]:
    specs = pipelines.load_all()
    for name in overlay.pipelines:
        if name not in specs:
            raise SpecError(f"{source}: pipelines.{name}: unknown pipeline; known: {sorted(specs)}")
    enabled = {n: s for n, s in specs.items() if overlay.pipelines.get(n, PipelineOverlay()).enabled}
    overlay = share_stage_overrides(overlay, enabled, source)
    profiles = {name: apply_overlay(spec, overlay, source) for name, spec in enabled.items()}
    return profiles, enabled


def share_stage_overrides(overlay: DeployOverlay, specs: dict[str, Any], source: str) -> DeployOverlay:
    """A stage that several pipelines share (the voice pipeline's talker and code2wav
    are the tts pipeline's) is one pool: an override given under one pipeline applies
    to every pipeline that has the stage. Different overrides of one stage are an error."""
    stage_sets = {}
    for name, spec in specs.items():
        po = overlay.pipelines.get(name, PipelineOverlay())
        profile = spec.profiles[po.profile or spec.default_profile]
        stage_sets[name] = {st.name for st in profile.stages}
    given: dict[str, tuple[str, Any]] = {}
    for name in specs:
        for stage, so in overlay.pipelines.get(name, PipelineOverlay()).stages.items():
            prev = given.get(stage)
            if prev is not None and prev[1] != so:
                raise SpecError(
                    f"{source}: pipelines.{name}.stages.{stage}: stage {stage!r} is shared with pipeline {prev[0]}, "
                    f"which overrides it differently; give the override once (it applies to both)"
                )
            given[stage] = (name, so)
    pipelines = dict(overlay.pipelines)
    for name in specs:
        po = pipelines.get(name, PipelineOverlay())
        extra = {st: so for st, (_, so) in given.items() if st in stage_sets[name] and st not in po.stages}
        if extra:
            pipelines[name] = po.model_copy(update={"stages": {**po.stages, **extra}})
    return overlay.model_copy(update={"pipelines": pipelines})


def key_ring(overlay: DeployOverlay, source: str) -> KeyRing:
    entries = [(k.key, k.principal, k.admin) for k in overlay.server.api_keys]
    if overlay.server.api_key:
        entries.append((overlay.server.api_key, "default", True))
    try:
        return KeyRing(entries)
    except ValueError as exc:
        raise SpecError(f"{source}: server.api_keys: {exc}") from None


def check_redis(spec: SessionsSpec, source: str) -> None:
    """Refuse to start when Redis was asked for and cannot be reached (no silent
    fallback to the memory store)."""
    import redis

    from sessions.redis_store import redact

    client = redis.Redis.from_url(spec.redis_url, socket_timeout=spec.redis_timeout_s, socket_connect_timeout=spec.redis_timeout_s)
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        raise SpecError(
            f"{source}: sessions.redis_url: the session store Redis at {redact(spec.redis_url)} is unreachable ({exc}); "
            "start Redis, fix the URL, or set sessions.store: memory"
        ) from None
    finally:
        client.close()


def create_app(overlay: DeployOverlay | None = None, source: str = "deploy overlay") -> FastAPI:
    """Validate everything and build (not start) the runtime; raises SpecError on bad config."""
    overlay = overlay or DeployOverlay()
    profiles, specs = resolve_profiles(overlay, source)
    keys = key_ring(overlay, source)
    if overlay.sessions.store == "redis":
        check_redis(overlay.sessions, source)
    runtime = Runtime(profiles, overlay.connectors, ModelResolver(models_dir(overlay), overlay.server.build_tiny, source))
    runtime.build()
    assert runtime.orchestrator is not None
    sessions = SessionManager(overlay.sessions, runtime.orchestrator)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        import torch

        torch.set_num_threads(overlay.server.torch_threads)
        await sessions.start()
        try:
            await runtime.start()
            metrics.STAGES.runtimes.add(runtime)
            log.info(
                "omni-rt ready: pipelines %s; sessions: store %s, max_total %d",
                ", ".join(profiles) or "(none)",
                overlay.sessions.store,
                overlay.sessions.max_total,
            )
            yield
        finally:
            await sessions.stop()
            await runtime.stop()
            metrics.STAGES.runtimes.discard(runtime)

    app = FastAPI(title="omni-rt", lifespan=lifespan)
    app.state.runtime = runtime
    app.state.sessions = sessions
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_middleware(AuthMiddleware, keys=keys)

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(
            error_body(f"Unknown path {request.url.path}", "invalid_request_error", None, "not_found"), status_code=404
        )

    @app.exception_handler(405)
    async def bad_method(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(
            error_body(f"Method {request.method} is not allowed on {request.url.path}", "invalid_request_error", None, "method_not_allowed"),
            status_code=405,
        )

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body("Internal server error.", "server_error", None, "internal_error"), status_code=500)

    @app.get("/health")
    @app.get("/healthz")
    async def health() -> dict[str, Any]:
        assert runtime.orchestrator is not None
        return {
            "status": "ok",
            "pipelines": sorted(profiles),
            "running_requests": len(runtime.orchestrator.running()),
            "sessions": sessions.health(),
            **runtime.health(),
        }

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return PlainTextResponse(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    speech = None
    if "tts" in profiles:
        speech = SpeechService(sessions, specs["tts"], overlay.server.max_input_chars)
    model_ids = [(m, name) for name, spec in specs.items() for m in spec.models]
    app.include_router(build_router(speech, model_ids))
    app.include_router(build_sessions_router(sessions))
    app.include_router(build_pages_router(list(specs)))
    if "voice" in profiles:
        app.include_router(build_realtime_router(sessions, specs["voice"]))
        app.include_router(build_duplex_router(sessions, specs["voice"]))
        hosts = overlay.server.webrtc_host_addresses
        if hosts is None and overlay.server.host in ("127.0.0.1", "localhost"):
            hosts = ["127.0.0.1"]  # a loopback server: offer loopback candidates (aioice skips them)
        configure_ice(hosts)
        app.include_router(build_webrtc_router(sessions, specs["voice"], overlay.server.webrtc_ice_servers))
        app.include_router(build_chat_router(ChatService(sessions, specs["voice"])))
    if "image" in profiles:
        dit = runtime.pools[profiles["image"].entry]
        limits = lambda: dit.replicas[0].processor.limits()  # type: ignore[attr-defined]  # noqa: E731
        app.include_router(build_images_router(ImageService(sessions, specs["image"], limits)))
    if "world" in profiles:
        wdit = runtime.pools[profiles["world"].entry]
        describe = lambda: wdit.replicas[0].processor.describe()  # type: ignore[attr-defined]  # noqa: E731
        app.include_router(build_world_router(sessions, "world", describe))
    if "video_edit" in profiles:
        vdit = runtime.pools[profiles["video_edit"].entry]
        vdescribe = lambda: vdit.replicas[0].processor.describe()  # type: ignore[attr-defined]  # noqa: E731
        app.include_router(build_videos_router(sessions, specs["video_edit"], vdescribe))
    if "robot" in profiles:
        entry = runtime.pools[profiles["robot"].entry]
        app.include_router(build_openpi_router(sessions, "robot", lambda: entry.replicas[0].processor))  # type: ignore[arg-type]
    return app
