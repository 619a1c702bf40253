"""Composition root: reads the deploy overlay, builds the runtime, mounts the wires
every served pipeline names (`protocols.registry`) on an aiohttp application."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import pipelines
from omni_rt import metrics, tracing
from omni_rt.runtime import Runtime
from omni_rt.specs import DeployOverlay, PipelineOverlay, PipelineSpec, ProfileSpec, ServerSpec, SessionsSpec, SpecError, apply_overlay
from protocols import models as models_api
from protocols import sessions_api
from protocols.auth import CLIENT_SECRETS, KEYS, ClientSecrets, KeyRing, auth_middleware
from protocols.http import LIMITS, Limits, error_middleware, json_response
from protocols.registry import Mount, Routes, mount
from sessions import SessionManager
from sessions.calibration import calibrate
from ui import dashboard, pages

log = logging.getLogger("omni_server.app")

DEFAULT_MODELS_DIR = "~/.cache/omni-rt/models"
TINY_PREFIX = "tiny:"
RUNTIME = web.AppKey("runtime", Runtime)
SESSIONS = web.AppKey("sessions", SessionManager)


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


def resolve_profiles(overlay: DeployOverlay, source: str) -> tuple[dict[str, ProfileSpec], dict[str, PipelineSpec]]:
    specs = pipelines.load_all()
    for name in overlay.pipelines:
        if name not in specs:
            raise SpecError(f"{source}: pipelines.{name}: unknown pipeline; known: {sorted(specs)}")
    enabled = {n: s for n, s in specs.items() if overlay.pipelines.get(n, PipelineOverlay()).enabled}
    overlay = share_stage_overrides(overlay, enabled, source)
    profiles = {name: apply_overlay(spec, overlay, source) for name, spec in enabled.items()}
    # a profile that speaks with its model's own speakers brings its voices
    enabled = {n: s if profiles[n].voices is None else s.model_copy(update={"voices": profiles[n].voices}) for n, s in enabled.items()}
    return profiles, enabled


def share_stage_overrides(overlay: DeployOverlay, specs: Mapping[str, PipelineSpec], source: str) -> DeployOverlay:
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


async def freeze_startup_objects(app: web.Application) -> None:
    """An `on_startup` hook for a serving process (after the engines started): what
    start-up loaded (models, tokenizers, modules) lives as long as the server, so it
    leaves the collector's generations and full collections on the request path stay
    short. Not for apps made and dropped in one process (tests), whose frozen cycles
    would never be collected."""
    gc.collect()
    gc.freeze()


async def start_thread_pool(threads: int = 8) -> None:
    """Start the loop's thread pool now, not on the first turn that needs a thread
    (starting one waits for the new thread to run: on a busy CPU, a held loop)."""
    await asyncio.gather(*(asyncio.to_thread(time.sleep, 0.01) for _ in range(threads)))


def drain_on_sigterm(timeout_s: float) -> Callable[[web.Application], Awaitable[None]]:
    """An `on_startup` hook for a serving process: SIGTERM (a supervisor stopping it,
    Kubernetes' rolling update) drains first (sessions move to other nodes, at most
    `timeout_s`), then the server stops as on SIGINT. A second SIGTERM stops it at once."""

    async def install(app: web.Application) -> None:
        loop = asyncio.get_running_loop()
        sessions = app[SESSIONS]

        async def drain_then_stop() -> None:
            try:
                await sessions.drain(timeout_s)
            except Exception:  # noqa: BLE001 - stopping must not depend on it
                log.exception("drain on SIGTERM failed")
            finally:
                os.kill(os.getpid(), signal.SIGINT)  # aiohttp's graceful exit

        def on_term() -> None:
            if sessions.draining:
                os.kill(os.getpid(), signal.SIGINT)
                return
            log.info("SIGTERM: draining (at most %.0f s), then stopping", timeout_s)
            task = loop.create_task(drain_then_stop(), name="drain-on-sigterm")
            sessions.background.add(task)
            task.add_done_callback(sessions.background.discard)

        loop.add_signal_handler(signal.SIGTERM, on_term)

    return install


LINGER_S = 1.0


def runner_options(overlay: DeployOverlay) -> dict[str, Any]:
    """aiohttp server settings: a connection that has not sent a whole request within
    `header_timeout_s` (of opening, or of its last reply) is closed; handlers are never
    cancelled when their client goes away (each hears the disconnect itself); the rest
    of a body refused unread (413) is read and dropped for at most `LINGER_S`, so a
    client still sending it can read the refusal. (aiohttp's own 10 s would hold the
    connection that long even after its client left: with handler cancellation off,
    nothing ends that read early, and a stopping server waits for it.)"""
    return {"keepalive_timeout": overlay.server.header_timeout_s, "handler_cancellation": False, "lingering_time": LINGER_S}


def ssl_context(spec: ServerSpec, source: str) -> ssl.SSLContext | None:
    """The TLS context of `server.ssl_certfile` / `ssl_keyfile` (None: plain http). A
    missing, unreadable or malformed file is a start-up error naming it."""
    if spec.ssl_certfile is None or spec.ssl_keyfile is None:
        return None
    paths = {}
    for key, raw, marker in (("server.ssl_certfile", spec.ssl_certfile, "CERTIFICATE-----"), ("server.ssl_keyfile", spec.ssl_keyfile, "PRIVATE KEY-----")):
        path = Path(raw).expanduser()
        try:
            text = path.read_text(encoding="ascii", errors="replace")
        except OSError as exc:
            raise SpecError(f"{source}: {key}: cannot read {raw}: {exc.strerror or exc}") from None
        if marker not in text:
            what = "a PEM certificate" if key.endswith("certfile") else "a PEM private key"
            raise SpecError(f"{source}: {key}: {raw} is not {what} (no '-----BEGIN ...{marker}' block)")
        paths[key] = str(path)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        # an encrypted key would ask for its passphrase on the terminal: refuse it instead
        ctx.load_cert_chain(paths["server.ssl_certfile"], paths["server.ssl_keyfile"], password=lambda: b"")
    except ssl.SSLError as exc:
        raise SpecError(
            f"{source}: server.ssl_certfile / server.ssl_keyfile: {spec.ssl_certfile} and {spec.ssl_keyfile} do not load as a "
            f"certificate and its unencrypted private key ({exc.reason or exc})"
        ) from None
    return ctx


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


# (profiles, connectors, model resolver) -> a Runtime; tests swap in fake engines
RuntimeFactory = Callable[[Mapping[str, ProfileSpec], Mapping[str, Any], Callable[[str, str], str]], Runtime]


def create_app(
    overlay: DeployOverlay | None = None,
    source: str = "deploy overlay",
    *,
    runtime_factory: RuntimeFactory = Runtime,
    clock: Callable[[], float] = time.monotonic,
    options: Mapping[str, Any] | None = None,
) -> web.Application:
    """Validate everything and build (not start) the runtime; raises SpecError on bad
    config. `runtime_factory`, `clock` (leases) and `options` (per-wire hooks, e.g.
    the voice-activity detector) are for tests; serving uses the defaults."""
    overlay = overlay or DeployOverlay()
    profiles, specs = resolve_profiles(overlay, source)
    keys = key_ring(overlay, source)
    if overlay.sessions.store == "redis":
        check_redis(overlay.sessions, source)
    if any(s.placement.remote for p in profiles.values() for s in p.stages):
        from omni_rt.placement import connect

        connect(overlay.server.ray_address)  # stages placed outside this process run on Ray
    runtime = runtime_factory(profiles, overlay.connectors, ModelResolver(models_dir(overlay), overlay.server.build_tiny, source))
    runtime.build()
    assert runtime.orchestrator is not None
    sessions = SessionManager(overlay.sessions, runtime.orchestrator, clock=clock)

    async def lifespan(app: web.Application) -> AsyncIterator[None]:
        import torch

        torch.set_num_threads(overlay.server.torch_threads)
        await sessions.start()
        traces = None
        try:
            traces = tracing.start(tracing.exporter_of(overlay.server.tracing.exporter), overlay.server.tracing.endpoint)
            await runtime.start()
            metrics.STAGES.runtimes.add(runtime)
            metrics.SIGNALS.servers[runtime] = sessions
            await start_thread_pool()
            # what a real-time session costs, measured before the first caller (sessions.calibration)
            await calibrate(sessions, specs)
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
            await asyncio.to_thread(tracing.stop, traces)  # (the last spans are exported off the loop)
            metrics.STAGES.runtimes.discard(runtime)
            metrics.SIGNALS.servers.pop(runtime, None)

    @web.middleware
    async def trace_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        # a W3C traceparent on the request (a WebSocket's upgrade included) parents the
        # spans its handler starts (its session's)
        with tracing.remote_parent(request.headers):
            return await handler(request)

    client_secrets = ClientSecrets()
    srv = overlay.server
    # bodies are read with their route's limit (protocols.http.read_json); aiohttp's own
    # limit (multipart forms) is the largest of them
    app = web.Application(middlewares=[trace_middleware, error_middleware, auth_middleware(keys, client_secrets)], client_max_size=srv.max_upload_bytes)
    app[LIMITS] = Limits(srv.max_body_bytes, srv.max_upload_bytes, srv.send_timeout_s)
    app[CLIENT_SECRETS] = client_secrets
    app[KEYS] = keys
    app[RUNTIME] = runtime
    app[SESSIONS] = sessions
    app.cleanup_ctx.append(lifespan)

    async def health(request: web.Request) -> web.Response:
        assert runtime.orchestrator is not None
        down = runtime.unhealthy_stages()
        body = {
            "status": "draining" if sessions.draining else "ok" if not down else "unhealthy",
            "pipelines": sorted(profiles),
            "running_requests": len(runtime.orchestrator.running()),
            "sessions": sessions.health(),
            **runtime.health(),
        }
        if down:
            body["unhealthy_stages"] = down
        # draining: 503, so a load balancer sends new clients elsewhere
        return json_response(body, status=200 if not down and not sessions.draining else 503)

    def stuck_stages() -> list[str]:
        """Stages down for good in this process: no live replica, and none placed where
        something restarts it (a Ray actor is restarted by Ray; an in-process engine that
        died only comes back with the process)."""
        return [name for name in runtime.unhealthy_stages() if not runtime.pools[name].spec.placement.remote]

    async def livez(request: web.Request) -> web.Response:
        """Liveness: 200 while this process can serve its open sessions — draining
        included (a drain is the server moving its sessions; killing it then would cut
        them). 503 only when a stage is down for good here (a restart is the cure)."""
        stuck = stuck_stages()
        body: dict[str, Any] = {"status": "draining" if sessions.draining else "live" if not stuck else "dead"}
        if stuck:
            body["dead_stages"] = stuck
        return json_response(body, status=503 if stuck else 200)

    async def readyz(request: web.Request) -> web.Response:
        """Readiness: 200 while new sessions are welcome; 503 while draining (until the
        process exits) or while a stage has no live replica."""
        down = runtime.unhealthy_stages()
        status = "draining" if sessions.draining else "unhealthy" if down else "ready"
        body: dict[str, Any] = {"status": status}
        if down:
            body["unhealthy_stages"] = down
        return json_response(body, status=200 if status == "ready" else 503)

    async def metrics_endpoint(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"content-type": CONTENT_TYPE_LATEST})

    routes = Routes()
    routes.add("GET", "/health", health, "server")  # readiness, with the whole state
    routes.add("GET", "/healthz", livez, "server")  # liveness (the conventional name)
    routes.add("GET", "/livez", livez, "server")
    routes.add("GET", "/readyz", readyz, "server")
    routes.add("GET", "/metrics", metrics_endpoint, "server")
    models_api.add_routes(routes, [(m, name) for name, spec in specs.items() for m in spec.models])
    sessions_api.add_routes(routes, sessions, overlay.server.drain_timeout_s)
    pages.add_routes(routes, list(specs))
    dashboard.add_routes(routes, sessions, runtime)
    for name, spec in specs.items():
        pool = runtime.pools[profiles[name].entry]
        for wire in spec.wires:
            mount(Mount(wire, sessions, spec, overlay.server, pool.replicas[0].processor, routes, dict(options or {}), entry_pool=pool))
    pages.add_demos(routes)  # each demo page where the wire it drives is served
    routes.install(app)
    return app
