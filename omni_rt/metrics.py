"""Prometheus metrics (one registry for the process; served at /metrics)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

REQUESTS = Counter("omni_rt_requests_total", "Pipeline requests by final status", ["pipeline", "status"])
STAGE_SECONDS = Histogram(
    "omni_rt_stage_seconds",
    "Wall time of one request on one stage",
    ["pipeline", "stage"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
TTFP_SECONDS = Histogram(
    "omni_rt_time_to_first_packet_seconds",
    "Time from request to the first output chunk sent to the client",
    ["api"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1, 2, 5, 10),
)
AUDIO_SECONDS = Counter("omni_rt_audio_seconds_total", "Seconds of audio sent to clients", ["api"])
DROPPED_STALE = Counter("omni_rt_dropped_stale_total", "Outputs dropped by a fence check", ["hop"])
ENGINE_BATCH = Histogram(
    "omni_rt_engine_batch_size", "Items per torch engine step", ["engine"], buckets=(1, 2, 4, 8, 16, 32, 64)
)
ENGINE_STEP_SECONDS = Histogram(
    "omni_rt_engine_step_seconds", "Wall time of one torch / diffusers engine step (the whole batch)", ["engine"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
)
ENGINE_LATE = Counter(
    "omni_rt_engine_late_items_total", "Step-engine items that started after their deadline (a stream's playback ran dry first)", ["engine"]
)
DUPLEX_STEP_SECONDS = Histogram(
    "omni_rt_duplex_step_seconds", "One frame step of every live full-duplex conversation of a stage (budget: the 80 ms frame)", ["stage"],
    buckets=(0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5),
)
DUPLEX_FRAMES_LATE = Counter(
    "omni_rt_duplex_frames_late_total", "Conversation frames whose step overran the 80 ms frame", ["stage"]
)
PLAYOUT_UNDERRUN_SECONDS = Histogram(
    "omni_rt_playout_underrun_seconds",
    "Holes in a paced answer: how long a client playing it as it arrives waited for its next audio, by cause (generation: the "
    "audio was not made in time; send: it was there but went out late, the server process did not run; client: the client "
    "did not read, its socket's send waited; only generation and send holes weigh in admission)",
    ["api", "cause"],
    buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
)
EVENT_LOOP_LAG_SECONDS = Histogram(
    "omni_rt_event_loop_lag_seconds",
    "How late the server's event loop (which paces every answer's audio frames) woke a task that slept 20 ms",
    buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
ENGINE_LOAD = Gauge("omni_rt_engine_load", "Requests queued or running per stage", ["stage"])

# ---- requests --------------------------------------------------------------------------
TTFT_SECONDS = Histogram(
    "omni_rt_time_to_first_token_seconds",
    "Time from request to the first text token sent to the client",
    ["api"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1, 2, 5, 10),
)
E2E_SECONDS = Histogram(
    "omni_rt_request_e2e_seconds",
    "Time from request to its last byte sent to the client",
    ["api"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
)

POLICY_INFER_SECONDS = Histogram(
    "omni_rt_policy_infer_seconds",
    "Robot policy calls: observation handed to the pipeline -> action chunk back",
    buckets=(0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.1, 0.2, 0.5, 1, 2),
)

WORLD_BUFFER_BYTES = Gauge("omni_rt_world_buffer_bytes", "Latent history held by world sessions (bytes)")

BARGE_IN_SECONDS = Histogram(
    "omni_rt_barge_in_seconds",
    "Speech start during a response -> the response cancelled and its stages stopped",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
)

TURN_DECISIONS = Counter(
    "omni_rt_turn_decisions_total",
    "semantic_vad's end-of-turn model asked at a pause: end (the turn ended there) or wait (the user is not done)",
    ["decision"],
)

REALTIME_TRUNCATIONS = Counter(
    "omni_rt_realtime_truncations_total",
    "Realtime conversations whose oldest turns were dropped to fit the thinker's context (truncation auto / retention_ratio)",
)

# ---- sessions --------------------------------------------------------------------------
SESSIONS_ACTIVE = Gauge("omni_rt_sessions_active", "Sessions held by this node (active, detached or closing)", ["kind"])
SESSIONS_ADMITTED = Counter("omni_rt_sessions_admitted_total", "Sessions admitted", ["kind"])
SESSIONS_REJECTED = Counter(
    "omni_rt_sessions_rejected_total", "Sessions refused: reason is the full cap (total/kind/principal) or store_unavailable", ["kind", "reason"]
)
SESSIONS_EVICTED = Counter(
    "omni_rt_sessions_evicted_total", "Sessions ended by the server: idle_timeout, disconnect_grace_expired, evicted (pressure)", ["kind", "reason"]
)
SESSIONS_MIGRATED = Counter(
    "omni_rt_sessions_migrated_total", "Sessions moved by a drain: out of this node to the store, in from another node", ["kind", "direction"]
)
SESSIONS_ENDED = Counter("omni_rt_sessions_ended_total", "Sessions ended, by reason", ["kind", "reason"])
SESSION_EVENTS_DROPPED = Counter(
    "omni_rt_session_events_dropped_total", "Events dropped from a detached session's bounded replay buffer", ["kind"]
)
ADMISSION_CPU = Gauge(
    "omni_rt_admission_cpu_busy_fraction",
    "CPU busy fraction load-aware admission last read on this server's cores: own (this server's process tree), outside "
    "(everything else on those cores, or the container quota's fill beyond the server's own), machine (all of it)",
    ["scope"],
)
ADMISSION_THROTTLED = Gauge(
    "omni_rt_admission_cgroup_throttled_fraction", "Fraction of the container cgroup's CPU periods it was throttled in (window)"
)
ADMISSION_REFUSING = Gauge(
    "omni_rt_admission_refusing",
    "1 while load-aware admission refuses new real-time sessions, by why: rtf, cpu (this server's own load), "
    "outside_load (CPU taken by other processes), throttled (the container's CPU quota)",
    ["why"],
)
ADMISSION_SECONDS = Histogram(
    "omni_rt_session_admission_seconds",
    "Time to admit a session (cap check in the store)",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
)


# ---- stages (read at scrape time) -------------------------------------------------------


def _queued(pool: Any) -> int | None:
    """Work items waiting in a stage pool's engines (None: none of them reports it)."""
    known = [d for r in pool.replicas if r.engine is not None and (d := r.engine.queue_depth()) is not None]
    return sum(known) if known else None


class _StageCollector:
    """Per-stage in-flight requests and engine queue depth of every live runtime."""

    def __init__(self) -> None:
        self.runtimes: weakref.WeakSet[Any] = weakref.WeakSet()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        inflight = GaugeMetricFamily("omni_rt_stage_inflight_requests", "Requests placed on a stage's replicas", labels=["stage"])
        queued = GaugeMetricFamily(
            "omni_rt_stage_queue_depth", "Work items waiting in a stage's engines (engines that report it)", labels=["stage"]
        )
        for rt in list(self.runtimes):
            for name, pool in rt.pools.items():
                inflight.add_metric([name], sum(r.active for r in pool.replicas))
                depth = _queued(pool)
                if depth is not None:
                    queued.add_metric([name], depth)
        yield inflight
        yield queued

    def describe(self) -> list[Any]:
        return []


STAGES = _StageCollector()
REGISTRY.register(STAGES)


class _SignalsCollector:
    """What an autoscaler and a router read (the shape of vLLM's
    `num_requests_waiting` / `num_requests_running`), per pipeline and per session kind,
    computed at scrape time from every live server in the process:

    - `omni_rt_requests_running{pipeline}`: requests the orchestrator is running;
    - `omni_rt_requests_waiting{pipeline}`: work items queued in the engines of the
      pipeline's stages (engines that report a queue; a stage two pipelines share counts
      in both);
    - `omni_rt_admission_headroom_sessions{kind}`: how many more sessions of a
      load-weighed kind admission would take now, one after the other, bounded by the
      session caps (total and per kind) on this node.
    """

    def __init__(self) -> None:
        self.servers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # runtime -> session manager

    def collect(self) -> Iterator[GaugeMetricFamily]:
        running = GaugeMetricFamily("omni_rt_requests_running", "Requests the orchestrator is running, per pipeline", labels=["pipeline"])
        waiting = GaugeMetricFamily("omni_rt_requests_waiting", "Work items queued in the engines of a pipeline's stages", labels=["pipeline"])
        headroom = GaugeMetricFamily("omni_rt_admission_headroom_sessions",
                                     "More real-time sessions admission would take now (load-aware check and caps)", labels=["kind"])
        for rt, sessions in list(self.servers.items()):
            orch = rt.orchestrator
            if orch is None:
                continue
            counts = orch.running_by_pipeline()
            for name, profile in orch.pipelines.items():
                running.add_metric([name], counts.get(name, 0))
                pools = [rt.pools[s] for s in {s.name for s in profile.stages} if s in rt.pools]
                waiting.add_metric([name], sum(_queued(p) or 0 for p in pools))
            if sessions is not None:
                for kind, room in sessions.headroom().items():
                    headroom.add_metric([kind], room)
        yield running
        yield waiting
        yield headroom

    def describe(self) -> list[Any]:
        return []


SIGNALS = _SignalsCollector()
REGISTRY.register(SIGNALS)

WEBRTC_FRAME_GAP_SECONDS = Histogram(
    "omni_rt_webrtc_frame_gap_seconds",
    "Time between consecutive outbound 20 ms audio frames of a WebRTC call (pacing)",
    buckets=(0.005, 0.01, 0.015, 0.019, 0.021, 0.025, 0.03, 0.04, 0.06, 0.1, 0.25, 1.0),
)

WEBRTC_BARGE_IN_SILENT_SECONDS = Histogram(
    "omni_rt_webrtc_barge_in_silent_seconds",
    "WebRTC barge-in: the user's speech start detected by the server -> the first silent outbound frame",
    buckets=(0.005, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0),
)
