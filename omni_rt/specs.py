"""Pipeline topology and deploy overlays (pydantic, validated at load).

Two layers: a pipeline file (frozen topology: stages, edges, final-output set, one or
more profiles) and a deploy overlay that changes placement, replicas, connectors,
edge modes, chunking and model paths without touching the pipeline. Every default
lives here, once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from omni_rt.payloads import PayloadKind


class SpecError(ValueError):
    """A pipeline file or deploy overlay that cannot be used. The message names file and key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ChunkingSpec(_Strict):
    """How a chunk edge slices a stream of frames for the consumer.

    Frames are the source's natural unit (a codec frame = 7 codes = 2048 samples for
    SNAC 24 kHz). `left_context_frames` and `lookahead_frames` are decoded again around
    each chunk and trimmed, so a non-causal decoder gives the same samples as a
    one-shot decode of the whole sequence (docs/design.md, invariant 6).
    """

    first_chunk_frames: int = Field(default=1, ge=1, le=4096, description="frames in the first chunk (time to first audio)")
    chunk_frames: int = Field(default=16, ge=1, le=4096, description="frames in every later chunk")
    left_context_frames: int = Field(default=3, ge=0, le=4096, description="already-emitted frames decoded again on the left")
    lookahead_frames: int = Field(default=3, ge=0, le=4096, description="future frames a chunk waits for (right context)")
    refill_ms: int = Field(default=
        250, ge=0, le=60000, description="once less than this much of the emitted audio is left to play (in real time), the frames that "
        "are ready are decoded at once instead of waiting for a full chunk_frames (no hole while the talker keeps up); 0: fixed chunks"
    )
    first_chunk_budget_ms: int = Field(default=
        200, ge=0, le=60000, description="a stream's first chunk is due this long after its frames are ready: the decoder runs it ahead of "
        "chunks of running streams whose playback lasts longer, behind those about to run dry (earliest deadline first)"
    )
    jitter_ms: int = Field(default=
        30, ge=0, le=60000, description="with refill on: the first chunk holds at least first_chunk_frames, and more when the stream's "
        "frames come slowly or decoding is slow: enough audio to play while its next frame is made and decoded, plus this margin"
    )


class EdgeSpec(_Strict):
    src: str
    dst: str
    payload: PayloadKind
    mode: Literal["chunk", "batch"] = Field(default="chunk", description="chunk: stream as produced; batch: hand over when src finishes")
    connector: str = Field(default="inproc", description="name of a connector declared by the deployment (inproc, ray)")
    chunking: ChunkingSpec = ChunkingSpec()

    @property
    def name(self) -> str:
        return f"{self.src}->{self.dst}"


class AuxEngineSpec(_Strict):
    """An extra engine owned by a stage (a fused talker owning its decoder)."""

    engine: Literal["vllm", "torch"]
    model: str
    engine_args: dict[str, Any] = {}


class PlacementSpec(_Strict):
    """Where a stage's replicas run (deploy key `pipelines.P.stages.S.placement`).

    `local` (the default): in the server process. `process`: each replica in a process
    of its own on this machine (GIL isolation), a Ray actor pinned to this node. `ray`:
    each replica a Ray actor anywhere on the cluster that has the resources asked for.
    A replica placed outside the server reads and writes its payloads through
    `connector` (a `ray` connector: small payloads inside the handle, big ones in the
    object store, shared memory on one node), so the edges into and out of it must
    use one."""

    kind: Literal["local", "process", "ray"] = "local"
    num_cpus: float = Field(default=1.0, ge=0, description="CPUs each replica's actor reserves")
    num_gpus: float = Field(default=0.0, ge=0, description="GPUs each replica's actor reserves (fractions share one)")
    resources: dict[str, float] = Field(default={}, description="custom Ray resources each replica needs, e.g. {node_b: 0.01}")
    max_restarts: int = Field(default=-1, ge=-1, description="times Ray restarts a replica's actor that died (-1: always)")
    connector: str = Field(default="ray", description="the connector a remote replica's client input and output go through")

    @property
    def remote(self) -> bool:
        return self.kind != "local"


class StageSpec(_Strict):
    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    kind: Literal["ar", "generation", "diffusion"]
    engine: Literal["vllm", "torch", "diffusers", "fake"]
    processor: str = Field(pattern=r"^[\w.]+:\w+$", description="'module:Class' of the stage's processor")
    model: str | None = Field(default=None, description="local checkpoint dir, or 'tiny:<name>' for a built tiny checkpoint")
    engine_args: dict[str, Any] = {}
    processor_args: dict[str, Any] = {}
    aux: dict[str, AuxEngineSpec] = {}
    replicas: int = Field(default=1, ge=1, le=64)
    routing: Literal["least_queue", "round_robin"] = "least_queue"
    input: PayloadKind | None = Field(default=None, description="payload the entry stage takes from the client")
    placement: PlacementSpec = PlacementSpec()


class ProfileSpec(_Strict):
    entry: str
    stages: list[StageSpec]
    edges: list[EdgeSpec] = []
    final_outputs: list[str] = Field(min_length=1)
    voices: dict[str, str] | None = Field(default=None, description="the pipeline's voices when this profile runs (its model's own speakers)")
    name: str = Field(default="", description="the profile's key in its pipeline (set when a deployment resolves it)")

    @model_validator(mode="after")
    def _check_graph(self) -> ProfileSpec:
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate stage names in {names}")
        known = set(names)
        if self.entry not in known:
            raise ValueError(f"entry stage {self.entry!r} is not one of the stages {sorted(known)}")
        for e in self.edges:
            for end in (e.src, e.dst):
                if end not in known:
                    raise ValueError(f"edge {e.name!r} names unknown stage {end!r}")
            if e.dst == self.entry:
                raise ValueError(f"edge {e.name!r} points into the entry stage")
        if len({e.name for e in self.edges}) != len(self.edges):
            raise ValueError("duplicate edges")
        for f in self.final_outputs:
            if f not in known:
                raise ValueError(f"final output {f!r} is not a stage")
        # Acyclic and every stage reachable from the entry, or an entry of its own (it
        # takes a client payload, `input`: e.g. the voice pipeline's asr, which
        # transcription requests enter directly).
        order = _topo_order(names, [(e.src, e.dst) for e in self.edges])
        if order is None:
            raise ValueError("the stage graph has a cycle")
        reach = {self.entry} | {st.name for st in self.stages if st.input is not None and not any(e.dst == st.name for e in self.edges)}
        for n in order:
            if n in reach:
                reach.update(e.dst for e in self.edges if e.src == n)
        unreachable = known - reach
        if unreachable:
            raise ValueError(f"stages not reachable from entry {self.entry!r}: {sorted(unreachable)}")
        return self

    def stage(self, name: str) -> StageSpec:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    # The graph is read on every request: its derived views are computed once per
    # (stages, edges) lists (a model_copy that replaces either gets fresh views).
    @property
    def _graph(self) -> tuple[list[str], dict[str, list[EdgeSpec]], dict[str, list[EdgeSpec]]]:
        key = (id(self.stages), id(self.edges))
        cached = self.__dict__.get("_graph_cache")
        if cached is not None and cached[0] == key:
            return cached[1]
        order = _topo_order([s.name for s in self.stages], [(e.src, e.dst) for e in self.edges])
        assert order is not None
        outs: dict[str, list[EdgeSpec]] = {s.name: [] for s in self.stages}
        ins: dict[str, list[EdgeSpec]] = {s.name: [] for s in self.stages}
        for e in self.edges:
            outs[e.src].append(e)
            ins[e.dst].append(e)
        graph = (order, outs, ins)
        self.__dict__["_graph_cache"] = (key, graph)
        return graph

    def out_edges(self, stage: str) -> list[EdgeSpec]:
        return list(self._graph[1].get(stage, ()))

    def in_edges(self, stage: str) -> list[EdgeSpec]:
        return list(self._graph[2].get(stage, ()))

    def order(self) -> list[str]:
        return list(self._graph[0])


class PipelineSpec(_Strict):
    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    description: str = ""
    models: list[str] = Field(min_length=1, description="model ids this pipeline answers to (first is canonical)")
    wires: list[str] = Field(default=[], description="the wire protocols this pipeline is served on (protocols.registry)")
    voices: dict[str, str] = Field(default={}, description="accepted voice name -> voice the model speaks")
    default_profile: str
    profiles: dict[str, ProfileSpec]

    @model_validator(mode="after")
    def _check_profile(self) -> PipelineSpec:
        if self.default_profile not in self.profiles:
            raise ValueError(f"default_profile {self.default_profile!r} is not one of {sorted(self.profiles)}")
        return self


# ---- deploy overlay --------------------------------------------------------------------


class ChunkingOverlay(_Strict):
    first_chunk_frames: int | None = Field(default=None, ge=1, le=4096)
    chunk_frames: int | None = Field(default=None, ge=1, le=4096)
    left_context_frames: int | None = Field(default=None, ge=0, le=4096)
    lookahead_frames: int | None = Field(default=None, ge=0, le=4096)
    refill_ms: int | None = Field(default=None, ge=0, le=60000)
    jitter_ms: int | None = Field(default=None, ge=0, le=60000)


class EdgeOverlay(_Strict):
    mode: Literal["chunk", "batch"] | None = None
    connector: str | None = None
    chunking: ChunkingOverlay | None = None


class AuxOverlay(_Strict):
    model: str | None = None
    engine_args: dict[str, Any] = Field(default={}, description="merged over the aux engine's engine_args")


class StageOverlay(_Strict):
    model: str | None = None
    replicas: int | None = Field(default=None, ge=1, le=64)
    routing: Literal["least_queue", "round_robin"] | None = None
    engine_args: dict[str, Any] = Field(default={}, description="merged over the pipeline's engine_args")
    processor_args: dict[str, Any] = Field(default={}, description="merged over the pipeline's processor_args")
    aux: dict[str, AuxOverlay] = Field(default={}, description="per aux engine: model / engine_args overrides")
    placement: PlacementSpec | None = Field(default=None, description="where the stage's replicas run (local, process, ray)")


class PipelineOverlay(_Strict):
    enabled: bool = True
    profile: str | None = None
    stages: dict[str, StageOverlay] = {}
    edges: dict[str, EdgeOverlay] = {}


class ConnectorSpec(_Strict):
    backend: Literal["inproc", "ray"]


class ApiKeySpec(_Strict):
    key: str = Field(min_length=8, description="the secret the client sends (Bearer or Api-Key)")
    principal: str = Field(min_length=1, max_length=128, description="who the key belongs to (per-principal caps)")
    admin: bool = Field(default=False, description="may list and close every session (/v1/sessions)")


class TracingSpec(_Strict):
    """OpenTelemetry tracing (deploy key `server.tracing`; omni_rt.tracing)."""

    exporter: Literal["otlp", "console", "none"] | None = Field(default=
        None, description="otlp (OTLP/HTTP), console, or none; unset: the standard OTEL_TRACES_EXPORTER variable decides (off when it is unset)"
    )
    endpoint: str | None = Field(default=
        None, pattern=r"^https?://", description="the OTLP/HTTP traces URL (default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT, "
        "else http://localhost:4318/v1/traces)"
    )


class ServerSpec(_Strict):
    ray_address: str | None = Field(default=
        None, description="the Ray cluster stages placed `process`/`ray` run on (several front ends share its stage actors); "
        "none: a Ray instance of this server's own, started when a stage needs one"
    )
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    models_dir: str | None = Field(default=None, description="where tiny checkpoints are built (default ~/.cache/omni-rt/models)")
    build_tiny: bool = Field(default=True, description="build missing tiny checkpoints at start-up")
    api_key: str | None = Field(default=
        None, min_length=8, description="one admin key (principal 'default'): 'Authorization: Bearer <key>' or 'Api-Key <key>'"
    )
    api_keys: list[ApiKeySpec] = Field(default=[], description="keys mapped to principals; any key set turns auth on")
    max_input_chars: int = Field(default=4096, ge=1)
    torch_threads: int = Field(default=1, ge=1, le=256, description="intra-op threads for torch engines in this process")
    drain_timeout_s: float = Field(default=
        30.0, ge=0, le=3600, description="on SIGTERM the server drains (sessions move to other nodes) for at most this long, then exits"
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    tracing: TracingSpec = Field(default_factory=TracingSpec)
    webrtc_host_addresses: list[str] | None = Field(default=
        None, description="addresses WebRTC calls offer as host candidates (default: 127.0.0.1 when host is loopback, else every non-loopback address)"
    )
    webrtc_ice_servers: list[str] = Field(default=[], description="STUN/TURN URLs for WebRTC calls, e.g. stun:stun.example.org:3478")
    call_webhook_url: str | None = Field(default=
        None, pattern=r"^https?://", description="phone calls under call control: each new call is POSTed here as a "
        "realtime.call.incoming webhook and waits for POST /v1/realtime/calls/{call_id}/accept (unset: calls are accepted at once)"
    )
    call_webhook_secret: str | None = Field(default=
        None, pattern=r"^whsec_[A-Za-z0-9+/=]+$", description="the Standard Webhooks secret (whsec_<base64>) the call webhooks are signed with"
    )
    call_accept_timeout_s: float = Field(default=15.0, gt=0, le=300, description="a call not accepted within this long is rejected")
    turn_model: str = Field(default=
        "smart-turn-v3", min_length=1, description="the end-of-turn model semantic_vad runs: smart-turn-v3 (the ONNX the pipecat-ai wheel "
        "ships), a path to a Smart Turn v3 ONNX file, or none (semantic_vad ends turns on its eagerness's silence: 300 / 700 / 1500 ms)"
    )
    max_body_bytes: int = Field(default=
        4 << 20, ge=1024, description="largest HTTP request body (JSON, SDP); a bigger one is refused with 413 before it is read"
    )
    max_upload_bytes: int = Field(default=
        64 << 20, ge=1024, description="largest body of a request that carries media (chat completions with input audio)"
    )
    header_timeout_s: float = Field(default=
        15.0, gt=0, description="a connection that has not sent a whole request (its headers) this long after it opened or after its last reply is closed"
    )
    send_timeout_s: float = Field(default=
        30.0, gt=0, description="a streamed reply (speech audio, SSE) the client stops reading for this long is ended and its session freed"
    )
    ssl_certfile: str | None = Field(default=
        None, description="serve https and wss on every route with this PEM certificate (chain); needs ssl_keyfile"
    )
    ssl_keyfile: str | None = Field(default=None, description="the PEM private key of ssl_certfile (unencrypted)")

    @model_validator(mode="after")
    def _tls_pair(self) -> ServerSpec:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            given, missing = ("ssl_certfile", "ssl_keyfile") if self.ssl_certfile is not None else ("ssl_keyfile", "ssl_certfile")
            raise ValueError(f"{given} is set but {missing} is not: TLS needs both the certificate and its key")
        if self.call_webhook_url is not None and self.call_webhook_secret is None:
            raise ValueError("call_webhook_url is set but call_webhook_secret is not: call webhooks are signed (whsec_<base64>)")
        if self.call_webhook_secret is not None:
            import base64
            import binascii

            try:
                key = base64.b64decode(self.call_webhook_secret.removeprefix("whsec_"), validate=True)
            except (binascii.Error, ValueError):
                key = b""
            if len(key) < 16:
                raise ValueError("call_webhook_secret must be whsec_ and the base64 of at least 16 random bytes")
        if self.turn_model not in ("smart-turn-v3", "none") and not Path(self.turn_model).expanduser().is_file():
            raise ValueError(f"turn_model: no ONNX file at {self.turn_model} (smart-turn-v3, none, or the path of a Smart Turn v3 ONNX file)")
        return self


SESSION_KINDS = ("oneshot", "realtime", "duplex", "webrtc", "robot", "world", "video")


RealtimeKind = Literal["realtime", "duplex", "webrtc", "robot"]
REALTIME_KINDS: tuple[RealtimeKind, ...] = ("realtime", "duplex", "webrtc", "robot")


class PipelineCostSpec(_Strict):
    """What real-time sessions of one pipeline cost in generation real-time factor, stated
    instead of calibrated (deploy key `sessions.realtime_admission.pipeline_costs.<pipeline>`)."""

    base_rtf: float = Field(gt=0, le=10.0, description="the RTF of one answer generated alone")
    per_session_rtf: float = Field(gt=0, le=10.0, description="what each more answer generating at the same time adds to it")


class RealtimeAdmissionSpec(_Strict):
    """Load-aware admission of real-time sessions (deploy key
    `sessions.realtime_admission`): besides the static caps, refuse a new voice session,
    or a robot that declares its control rate, when admitting it would push generation
    past real time (docs/deployment.md)."""

    enabled: bool = Field(default=True, description="refuse a new real-time session the stages cannot serve in real time")
    kinds: list[RealtimeKind] = Field(default=
        list(REALTIME_KINDS), description="session kinds it applies to (robot: only robots that declare control_hz)"
    )
    target_rtf: float = Field(default=
        0.65, gt=0, le=1.0, description="the generation real-time factor admitted sessions must stay under (1.0: exactly real time); "
        "an answer's mean RTF hides its slow stretches (another caller's prompt prefilled mid-answer), so the default leaves a third of "
        "real time spare: on the 2-core reference machine a burst predicted at 0.7 stalled, at 0.58 it did not"
    )
    hysteresis: float = Field(default=
        0.1, ge=0, lt=1.0, description="once refusing, admit again only when the prediction is this far under target_rtf"
    )
    calibrate: bool = Field(default=
        True, description="measure each real-time voice pipeline's cost when the server starts (one answer alone, then "
        "calibrate_sessions at once), so a burst at a cold server admits what fits"
    )
    calibrate_sessions: int = Field(default=4, ge=2, le=64, description="answers generated at once by the calibration's second level")
    calibrate_max_sessions: int = Field(default=
        16, ge=2, le=256, description="the most answers at once the calibration's third level measures (the burst the first two say fits)"
    )
    calibrate_tokens: int = Field(default=24, ge=4, le=512, description="max_output_tokens of each calibration answer")
    pipeline_costs: dict[str, PipelineCostSpec] = Field(default=
        {}, description="per pipeline: its cost stated instead of calibrated, e.g. {voice: {base_rtf: 0.2, per_session_rtf: 0.07}}"
    )
    weigh_front_end: bool = Field(default=
        True, description="count the front end's CPU (VAD, resampling, pacing, framing) per open session against the calibrated cost"
    )
    front_end_cpu_per_session: float = Field(default=
        0.1, ge=0, le=16.0, description="CPU cores the server's front end (VAD, resampling, pacing, framing) spends per open real-time "
        "session until it has measured it: the calibration measured the engines alone, and n sessions' front end takes its share of the cores"
    )
    session_cost_rtf: float = Field(default=
        0.05, gt=0, le=1.0, description="what one session costs in RTF when its pipeline was neither calibrated nor stated (the prior)"
    )
    min_session_cost_rtf: float = Field(default=
        0.01, gt=0, le=1.0, description="the measured per-session cost is never taken as lower than this"
    )
    window_s: float = Field(default=4.0, gt=0, le=600, description="streams that emitted audio this recently are the load now")
    new_session_s: float = Field(default=
        10.0, ge=0, le=600, description="a session open less than this long has not shown its load yet: it is charged the per-session cost "
        "on top of what is measured (and left out of the fit)"
    )
    max_cpu_utilisation: float | None = Field(default=
        None, gt=0, le=1.0, description="the busy fraction of this server's CPUs (its engine processes included) one more session may "
        "bring it to; null (default): not weighed, generation fills idle cores by design and busy cores say nothing of real-time slack"
    )
    weigh_outside_load: bool = Field(default=
        True, description="count CPU taken by other processes on this server's cores (and a container's CPU quota) against "
        "max_cpu_utilisation, not only this server's own share"
    )
    max_throttled_fraction: float | None = Field(default=
        0.05, ge=0, le=1.0, description="refuse while the container's cgroup was throttled in more than this fraction of its CPU "
        "periods over the window; null: not weighed"
    )
    session_cost_cpu: float = Field(default=
        0.05, gt=0, le=1.0, description="what one more session adds to the CPU busy fraction (with max_cpu_utilisation)"
    )
    max_hole_ms: int | None = Field(default=
        100, ge=1, le=60000, description="a hole this long in a paced answer (its client, playing the audio as it came, ran dry), heard "
        "within window_s, refuses new sessions (why late_audio) when the server caused it (late generation, a late writer); a client "
        "that does not read causes its own; none: not weighed"
    )
    min_sessions: int = Field(default=1, ge=0, description="this many sessions are always admitted, whatever is measured")
    retry_after_s: int = Field(default=5, ge=1, le=3600, description="retry-after sent with a capacity refusal")


class RateLimitSpec(_Strict):
    """One principal's rates (a token bucket each: a minute's worth may be spent at once,
    refilled evenly over the minute); null: no limit."""

    requests_per_minute: float | None = Field(default=None, gt=0, description="one-shot calls (speech, chat, transcriptions, images, videos)")
    tokens_per_minute: float | None = Field(default=None, gt=0, description="thinker tokens (prompt + answer) of chat calls and voice answers")
    audio_seconds_per_minute: float | None = Field(default=None, gt=0, description="caller audio taken by voice sessions")


class RateLimitsSpec(_Strict):
    """Per-principal rate limits (deploy key `sessions.rate_limits`), shared by every node
    through Redis when the session store is Redis."""

    default: RateLimitSpec = Field(default_factory=RateLimitSpec, description="every principal's rates unless named below")
    principals: dict[str, RateLimitSpec] = Field(default={}, description="rates of named principals, e.g. {trial: {requests_per_minute: 10}}")

    def of(self, principal: str) -> RateLimitSpec:
        return self.principals.get(principal, self.default)


class SessionsSpec(_Strict):
    """Admission caps, leases and the session store (deploy key `sessions`)."""

    max_total: int = Field(default=256, ge=1, description="sessions admitted at once, all kinds together (cluster-wide with redis)")
    max_per_kind: dict[str, int] = Field(default={}, description="cap per session kind, e.g. {realtime: 32, oneshot: 200}")
    max_per_principal: int | None = Field(default=None, ge=1, description="cap per principal (API key owner); none = no cap")
    principal_caps: dict[str, int] = Field(default={}, description="per-principal caps that override max_per_principal, e.g. {trial: 2}")
    idle_ttl_s: float = Field(default=600.0, gt=0, description="an attached session with no activity and no running request expires")
    disconnect_grace_s: float = Field(default=30.0, ge=0, description="a detached session stays resumable this long")
    reaper_interval_s: float = Field(default=1.0, gt=0, le=60, description="how often leases are checked and renewed")
    evict_detached_under_pressure: bool = Field(default=
        False, description="when a cap is hit, evict the longest-detached session (same scope) to admit a new one"
    )
    retry_after_s: int = Field(default=1, ge=1, le=3600, description="retry-after sent with a session_limit rejection")
    replay_buffer_events: int = Field(default=256, ge=0, le=1_000_000, description="events kept for a detached session")
    max_pending_events: int = Field(default=
        4096, ge=16, le=10_000_000, description="events queued for an attached client that is not reading; over it the session ends (slow_consumer)"
    )
    realtime_admission: RealtimeAdmissionSpec = Field(default_factory=RealtimeAdmissionSpec)
    rate_limits: RateLimitsSpec = Field(default_factory=RateLimitsSpec)
    store: Literal["memory", "redis"] = Field(default="memory", description="memory: one process; redis: caps shared by nodes")
    redis_url: str = Field(default="redis://127.0.0.1:6379/0", description="used when store is redis")
    redis_prefix: str = Field(default="omni-rt", pattern=r"^[\w.:-]+$", description="key prefix; nodes sharing caps use the same one")
    redis_timeout_s: float = Field(default=1.0, gt=0, le=30, description="per-command timeout; a slower Redis counts as lost")
    slot_lease_ttl_s: float = Field(default=
        15.0, gt=0, description="redis: a slot not renewed this long is returned (a node that died gives capacity back)"
    )
    node_id: str | None = Field(default=None, pattern=r"^[\w.:-]+$", description="this node's name in the directory (default host:pid)")
    advertise_url: str | None = Field(default=None, description="URL other nodes give clients whose session lives here")
    resume_url: str | None = Field(default=
        None, description="where a client whose session moved off a draining node resumes (the service's address, e.g. its load "
        "balancer); none: the address it used"
    )
    migration_ttl_s: float = Field(default=120.0, gt=0, le=86400, description="a moved session's state waits this long for its client")
    migration_max_bytes: int = Field(default=
        32 << 20, ge=1 << 16, description="largest state one session may move with (its conversation, its latents)"
    )

    @model_validator(mode="after")
    def _check(self) -> SessionsSpec:
        for kind, cap in self.max_per_kind.items():
            if kind not in SESSION_KINDS:
                raise ValueError(f"max_per_kind.{kind}: unknown session kind; known: {', '.join(SESSION_KINDS)}")
            if cap < 1:
                raise ValueError(
                    f"max_per_kind.{kind}: cap must be at least 1, got {cap} (to turn a workload off, disable its pipeline)"
                )
        for principal, cap in self.principal_caps.items():
            if cap < 1:
                raise ValueError(f"principal_caps.{principal}: cap must be at least 1, got {cap} (to lock a principal out, remove its key)")
        if self.store == "redis" and self.slot_lease_ttl_s < 3 * self.reaper_interval_s:
            raise ValueError(
                f"slot_lease_ttl_s ({self.slot_lease_ttl_s}) must be at least 3 x reaper_interval_s "
                f"({self.reaper_interval_s}) so live nodes renew their slots in time"
            )
        return self


class DeployOverlay(_Strict):
    server: ServerSpec = ServerSpec()
    sessions: SessionsSpec = SessionsSpec()
    connectors: dict[str, ConnectorSpec] = Field(
        default={"inproc": ConnectorSpec(backend="inproc"), "ray": ConnectorSpec(backend="ray")},
        description="named connectors that edges refer to",
    )
    pipelines: dict[str, PipelineOverlay] = {}


# ---- loading ---------------------------------------------------------------------------


def _topo_order(nodes: list[str], edges: list[tuple[str, str]]) -> list[str] | None:
    indeg = {n: 0 for n in nodes}
    for _, d in edges:
        indeg[d] += 1
    ready = [n for n in nodes if indeg[n] == 0]
    out: list[str] = []
    while ready:
        n = ready.pop(0)
        out.append(n)
        for s, d in edges:
            if s == n:
                indeg[d] -= 1
                if indeg[d] == 0:
                    ready.append(d)
    return out if len(out) == len(nodes) else None


def _format_validation(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
        lines.append(f"{source}: {loc}: {msg}")
    return "\n".join(lines)


# libyaml's loader where PyYAML was built with it (the wheels are): the same safe
# subset of YAML, parsed some ten times faster (every app start reads every pipeline).
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.load(text, Loader=_YAML_LOADER)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise SpecError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    return {} if data is None else data


def parse_pipeline(data: Any, source: str) -> PipelineSpec:
    try:
        return PipelineSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(_format_validation(err, source)) from None


def load_pipeline(path: str | Path) -> PipelineSpec:
    p = Path(path)
    return parse_pipeline(_read_yaml(p), str(p))


def parse_overlay(data: Any, source: str) -> DeployOverlay:
    try:
        return DeployOverlay.model_validate(data)
    except ValidationError as err:
        raise SpecError(_format_validation(err, source)) from None


def load_overlay(path: str | Path | None) -> DeployOverlay:
    if path is None:
        return DeployOverlay()
    p = Path(path)
    return parse_overlay(_read_yaml(p), str(p))


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    out.update(over)
    return out


def apply_overlay(pipeline: PipelineSpec, overlay: DeployOverlay, source: str = "deploy overlay") -> ProfileSpec:
    """The profile a deployment runs: the pipeline's chosen profile with overrides applied.

    Names in the overlay that match nothing (a stage, edge or profile that does not
    exist, a connector that is not declared) are errors naming the key.
    """
    po = overlay.pipelines.get(pipeline.name, PipelineOverlay())
    base_key = f"{source}: pipelines.{pipeline.name}"
    profile_name = po.profile or pipeline.default_profile
    if profile_name not in pipeline.profiles:
        raise SpecError(f"{base_key}.profile: unknown profile {profile_name!r}; known: {sorted(pipeline.profiles)}")
    profile = pipeline.profiles[profile_name]
    stage_names = {s.name for s in profile.stages}
    for name in po.stages:
        if name not in stage_names:
            raise SpecError(f"{base_key}.stages.{name}: no such stage in profile {profile_name!r}; known: {sorted(stage_names)}")
    edge_names = {e.name for e in profile.edges}
    for name in po.edges:
        if name not in edge_names:
            raise SpecError(f"{base_key}.edges.{name}: no such edge in profile {profile_name!r}; known: {sorted(edge_names)}")

    stages = []
    for s in profile.stages:
        so = po.stages.get(s.name)
        if so is None:
            stages.append(s)
            continue
        aux = dict(s.aux)
        for aux_name, aux_over in so.aux.items():
            if aux_name not in aux:
                raise SpecError(f"{base_key}.stages.{s.name}.aux.{aux_name}: no such aux engine; known: {sorted(aux)}")
            cur = aux[aux_name]
            aux[aux_name] = cur.model_copy(
                update={
                    "model": aux_over.model if aux_over.model is not None else cur.model,
                    "engine_args": _merge(cur.engine_args, aux_over.engine_args),
                }
            )
        stages.append(
            s.model_copy(
                update={
                    "model": so.model if so.model is not None else s.model,
                    "replicas": so.replicas or s.replicas,
                    "routing": so.routing or s.routing,
                    "engine_args": _merge(s.engine_args, so.engine_args),
                    "processor_args": _merge(s.processor_args, so.processor_args),
                    "aux": aux,
                    "placement": so.placement or s.placement,
                }
            )
        )
    edges = []
    for e in profile.edges:
        eo = po.edges.get(e.name)
        if eo is None:
            edges.append(e)
            continue
        chunking = e.chunking
        if eo.chunking is not None:
            chunking = chunking.model_copy(update=eo.chunking.model_dump(exclude_none=True))
        edges.append(
            e.model_copy(
                update={"mode": eo.mode or e.mode, "connector": eo.connector or e.connector, "chunking": chunking}
            )
        )
    for e in edges:
        if e.connector not in overlay.connectors:
            raise SpecError(
                f"{base_key}.edges.{e.name}.connector: connector {e.connector!r} is not declared; "
                f"known: {sorted(overlay.connectors)}"
            )
    remote = {s.name: s for s in stages if s.placement.remote}
    for s in remote.values():
        c = overlay.connectors.get(s.placement.connector)
        if c is None or c.backend != "ray":
            raise SpecError(f"{base_key}.stages.{s.name}.placement.connector: {s.placement.connector!r} is not a declared ray connector")
    for e in edges:
        if (e.src in remote or e.dst in remote) and overlay.connectors[e.connector].backend != "ray":
            placed = e.src if e.src in remote else e.dst
            raise SpecError(
                f"{base_key}.edges.{e.name}.connector: stage {placed} runs outside the server ({remote[placed].placement.kind}), "
                f"so its edges need a ray connector; {e.connector!r} is {overlay.connectors[e.connector].backend}"
            )
    try:
        return ProfileSpec.model_validate(
            {"entry": profile.entry, "stages": stages, "edges": edges, "final_outputs": profile.final_outputs, "voices": profile.voices,
             "name": profile_name}
        )
    except ValidationError as err:
        raise SpecError(_format_validation(err, base_key)) from None
