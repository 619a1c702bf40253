"""`/dashboard`: what an operator watches — the sessions, the admission's decisions,
the stages' queues and steps, time to first packet — refreshed live.

- `GET /dashboard`: the page (`static/dashboard.html`; open like the other pages: it
  holds no data, what it calls needs an admin key when keys are on).
- `GET /v1/dashboard`: one snapshot (JSON, admin).
- `GET /v1/dashboard/events?interval=S`: Server-Sent Events, a `snapshot` event every
  `S` seconds (default 1, 0.25–10), admin. Windowed figures (step time, batch size,
  TTFP) are over the viewer's last `WINDOW_S` seconds; the first snapshot of a stream
  (and the one-shot JSON) gives them over the server's lifetime.

Everything comes from the server's own state: the session manager (sessions, the
last admission decisions and what the load-aware admission measured), the runtime's
stage pools (in flight, queue depth) and the Prometheus metrics this process keeps
(`omni_rt_engine_step_seconds`, `omni_rt_engine_batch_size`,
`omni_rt_time_to_first_packet_seconds`).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections import deque
from typing import Any

from aiohttp import web

from omni_rt import metrics
from omni_rt.errors import ClientError
from protocols.auth import principal_of
from protocols.http import json_response, sse
from protocols.registry import Routes
from sessions import SessionManager
from ui.pages import page

WINDOW_S = 60.0
MAX_LISTED = 200  # sessions listed one by one (the counts cover all)
RECENT_DECISIONS = 20

Buckets = dict[tuple[str, ...], list[tuple[float, float]]]  # labels -> [(upper bound, cumulative count)]


def histogram_buckets(hist: Any) -> tuple[Buckets, dict[tuple[str, ...], tuple[float, float]]]:
    """A Prometheus histogram's cumulative buckets and (sum, count), per label set."""
    buckets: Buckets = {}
    totals: dict[tuple[str, ...], list[float]] = {}
    for family in hist.collect():
        for s in family.samples:
            labels = tuple(v for k, v in sorted(s.labels.items()) if k != "le")
            if s.name.endswith("_bucket"):
                buckets.setdefault(labels, []).append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_sum"):
                totals.setdefault(labels, [0.0, 0.0])[0] = s.value
            elif s.name.endswith("_count"):
                totals.setdefault(labels, [0.0, 0.0])[1] = s.value
    for b in buckets.values():
        b.sort()
    return buckets, {k: (v[0], v[1]) for k, v in totals.items()}


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The q-quantile of cumulative buckets, interpolated inside its bucket as
    Prometheus' histogram_quantile does (the last finite bound where it falls in +Inf)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lo_bound, lo_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lo_bound
            if count == lo_count:
                return bound
            return lo_bound + (bound - lo_bound) * (rank - lo_count) / (count - lo_count)
        lo_bound, lo_count = bound, count
    return lo_bound


def _minus(now: list[tuple[float, float]], then: list[tuple[float, float]] | None) -> list[tuple[float, float]]:
    if not then:
        return now
    old = dict(then)
    return [(b, c - old.get(b, 0.0)) for b, c in now]


class Window:
    """Histogram readings over the last `span_s` seconds, per viewer: each reading is
    kept with its time, figures are the newest minus the oldest still in the span."""

    def __init__(self, span_s: float = WINDOW_S) -> None:
        self.span_s = span_s
        self._readings: deque[tuple[float, dict[str, Any]]] = deque()

    def take(self, now: float, reading: dict[str, Any]) -> dict[str, Any] | None:
        """Keep `reading`; return the oldest one in the span (None on the first)."""
        self._readings.append((now, reading))
        while len(self._readings) > 2 and now - self._readings[1][0] >= self.span_s:
            self._readings.popleft()
        return self._readings[0][1] if len(self._readings) > 1 else None


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 2)


class Dashboard:
    def __init__(self, manager: SessionManager, runtime: Any) -> None:
        self.manager = manager
        self.runtime = runtime
        self.started = time.time()

    def _reading(self) -> dict[str, Any]:
        step_b, step_t = histogram_buckets(metrics.ENGINE_STEP_SECONDS)
        batch_b, batch_t = histogram_buckets(metrics.ENGINE_BATCH)
        ttfp_b, ttfp_t = histogram_buckets(metrics.TTFP_SECONDS)
        return {"step": (step_b, step_t), "batch": (batch_b, batch_t), "ttfp": (ttfp_b, ttfp_t)}

    def snapshot(self, window: Window | None = None) -> dict[str, Any]:
        now = time.time()
        reading = self._reading()
        old = window.take(time.monotonic(), reading) if window is not None else None
        span = "window" if old is not None else "lifetime"
        return {
            "object": "dashboard.snapshot",
            "time": round(now, 3),
            "node": self.manager.node_id,
            "uptime_s": round(now - self.started, 1),
            "figures_over": {"span": span, **({"seconds": window.span_s} if window is not None and old is not None else {})},
            "sessions": self._sessions(),
            "admission": self._admission(),
            "stages": self._stages(reading, old),
            "ttfp": self._ttfp(reading, old),
            "load": self._load(),
        }

    def _sessions(self) -> dict[str, Any]:
        live = self.manager.sessions()
        by: dict[str, dict[str, int]] = {"kind": {}, "state": {}, "principal": {}, "pipeline": {}}
        for s in live:
            for key, value in (("kind", s.kind), ("state", s.state.value), ("principal", s.principal), ("pipeline", s.pipeline or "-")):
                by[key][value] = by[key].get(value, 0) + 1
        newest = sorted(live, key=lambda s: s.created_at, reverse=True)[:MAX_LISTED]
        return {"total": len(live), **{f"by_{k}": v for k, v in by.items()}, "data": [s.info() for s in newest]}

    def _admission(self) -> dict[str, Any]:
        m = self.manager
        return {
            **m.admission.health(),
            "open_realtime": m.realtime_sessions(),
            "admitted_total": m.stats["admitted"],
            "refused_total": m.stats["rejected"],
            "recent": list(reversed(list(m.decisions)[-RECENT_DECISIONS:])),
        }

    def _stages(self, reading: dict[str, Any], old: dict[str, Any] | None) -> list[dict[str, Any]]:
        step_b, step_t = reading["step"]
        batch_b, batch_t = reading["batch"]
        o_step_b, o_step_t = old["step"] if old else ({}, {})
        o_batch_b, o_batch_t = old["batch"] if old else ({}, {})
        out = []
        for name, pool in self.runtime.pools.items():
            engines = []
            for engine in {id(e): e for r in pool.replicas for e in r.engines()}.values():
                key = (engine.name,)
                s_sum, s_n = step_t.get(key, (0.0, 0.0))
                os_sum, os_n = o_step_t.get(key, (0.0, 0.0))
                b_sum, b_n = batch_t.get(key, (0.0, 0.0))
                ob_sum, ob_n = o_batch_t.get(key, (0.0, 0.0))
                steps = s_n - os_n
                entry: dict[str, Any] = {"engine": engine.name, "type": type(engine).__name__, "load": engine.load(),
                                         "queue_depth": engine.queue_depth(), "steps": int(steps)}
                if key in step_b:
                    window_b = _minus(step_b[key], o_step_b.get(key))
                    entry.update(step_ms_mean=_ms((s_sum - os_sum) / steps) if steps else None,
                                 step_ms_p50=_ms(quantile(window_b, 0.5)), step_ms_p99=_ms(quantile(window_b, 0.99)))
                if b_n - ob_n > 0:
                    entry["batch_mean"] = round((b_sum - ob_sum) / (b_n - ob_n), 2)
                engines.append(entry)
            depths = [d for e in engines if (d := e["queue_depth"]) is not None]
            out.append({"stage": name, "healthy": pool.healthy, "replicas": len(pool.replicas),
                        "in_flight": sum(r.active for r in pool.replicas), "queue_depth": sum(depths) if depths else None,
                        "engines": engines})
        return out

    def _ttfp(self, reading: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
        buckets, totals = reading["ttfp"]
        o_buckets, o_totals = old["ttfp"] if old else ({}, {})
        out = {}
        for key, b in buckets.items():
            w = _minus(b, o_buckets.get(key))
            n = totals.get(key, (0.0, 0.0))[1] - o_totals.get(key, (0.0, 0.0))[1]
            out[key[0] if key else "all"] = {"count": int(n), "p50_ms": _ms(quantile(w, 0.5)), "p99_ms": _ms(quantile(w, 0.99))}
        return out

    def _load(self) -> dict[str, Any]:
        meters = self.manager.meters
        rtfs = meters.generation.rtfs()
        busy = meters.cpu_now  # the latest sample (taken off the loop)
        return {
            "server_cpu_busy": None if busy is None else round(busy, 4),
            "machine_cpu_percent": None if meters.machine_now is None else round(100 * meters.machine_now.busy, 1),
            "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()],
            "cpus": meters.cpu.cpus,
            "loop_lag_ms": round(meters.loop.worst() * 1000, 1),
            "generating_streams": len(rtfs),
            "worst_rtf": None if not rtfs else round(max(rtfs), 3),
        }


def _admin(request: web.Request) -> None:
    if not principal_of(request).admin:
        raise ClientError("The dashboard's data is for admin keys only.", code="forbidden", http_status=403)


def _interval(request: web.Request) -> float:
    raw = request.query.get("interval", "1")
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.25 <= value <= 10:
        raise ClientError(f"interval must be a number of seconds from 0.25 to 10, got {raw!r}", param="interval")
    return value




def add_routes(routes: Routes, manager: SessionManager, runtime: Any) -> None:
    board = Dashboard(manager, runtime)

    async def dashboard_page(request: web.Request) -> web.Response:
        return page("dashboard.html")

    async def snapshot(request: web.Request) -> web.Response:
        _admin(request)
        return json_response(board.snapshot())

    async def events(request: web.Request) -> web.StreamResponse:
        _admin(request)
        interval = _interval(request)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache", "x-accel-buffering": "no"})
        await resp.prepare(request)
        window = Window()
        try:
            while request.transport is not None and not request.transport.is_closing():
                await resp.write(sse(board.snapshot(window), "snapshot"))
                await asyncio.sleep(interval)
        except (ConnectionResetError, ConnectionError):
            pass  # the viewer left
        return resp

    routes.add("GET", "/dashboard", dashboard_page, "server")
    routes.add("GET", "/v1/dashboard", snapshot, "server")
    routes.add("GET", "/v1/dashboard/events", events, "server")
    routes.index.append(("GET", "/v1/dashboard/events", "live server state, Server-Sent Events (admin)"))
