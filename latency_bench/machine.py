"""What the machine did while a bench level ran, beside the server.

- `Burner`: processes that each spin one core (a noisy neighbour), outside the
  server's process tree, started and stopped around a level.
- `LoopStalls`: when the bench's own event loop ran late. A gap the client measured
  while it was itself stalled (the machine stopped every process, or the bench had no
  core) says nothing of the server, and is reported apart from the server's gaps.
- `steal_seconds()`: the CPU time the hypervisor took from this machine (psutil).
- `HealthPoller`: the server's own account polled from `/health` every second (load-
  aware admission: sessions, RTF, its CPU, the outside load, why it refuses).
- `underruns(metrics_text)`: the server's count of holes in paced answers, by cause.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

# one core spinning until killed (or after an hour, should the bench be killed first)
_SPIN = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 3600: pass"


class Burner:
    """`n` processes that each spin one core until `stop()`."""

    def __init__(self, n: int = 1) -> None:
        self.n = n
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(self.n)]

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []

    def __enter__(self) -> Burner:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LoopStalls:
    """Intervals (start, end) in which this event loop woke over `threshold_s` late."""

    def __init__(self, threshold_s: float = 0.05, tick_s: float = 0.01) -> None:
        self.threshold_s = threshold_s
        self.tick_s = tick_s
        self.intervals: list[tuple[float, float]] = []
        self._task: asyncio.Task[None] | None = None

    async def _watch(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(self.tick_s)
            now = time.monotonic()
            if now - t - self.tick_s > self.threshold_s:
                self.intervals.append((t + self.tick_s, now))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def overlaps(self, start: float, end: float) -> bool:
        return any(a < end and start < b for a, b in self.intervals)


def steal_seconds() -> float | None:
    """CPU seconds stolen by the hypervisor since boot, all CPUs (None where the
    platform does not count them)."""
    import psutil

    return getattr(psutil.cpu_times(), "steal", None)


HEALTH_KEYS = ("open", "sessions", "new_sessions", "rtf_now", "predicted_rtf", "predicted_rtf_cold", "predicted_rtf_live", "session_cost_rtf",
               "cost_from", "predicted_cpu", "cpu_own", "cpu_outside", "machine_busy", "throttled", "why", "refusing", "loop_lag_ms_now")


class HealthPoller:
    """Polls the server's `/health` every `every_s` into `polls` (load-aware admission's figures)."""

    def __init__(self, base: str, key: str | None, every_s: float = 1.0) -> None:
        self.base = base
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.every_s = every_s
        self.polls: list[dict[str, Any]] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        import httpx

        async with httpx.AsyncClient(timeout=5) as http:
            while not self._stop.is_set():
                try:
                    h = (await http.get(self.base + "/health", headers=self.headers)).json()
                    adm = h.get("sessions", {}).get("realtime_admission", {})
                    now = adm.get("machine_now") or {}
                    self.polls.append({"t": time.monotonic(), **{k: adm.get(k) for k in HEALTH_KEYS}, "machine_busy_now": now.get("machine_busy")})
                except (httpx.HTTPError, ValueError):
                    pass
                try:
                    await asyncio.wait_for(self._stop.wait(), self.every_s)
                except asyncio.TimeoutError:
                    pass

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    def outside_load(self) -> dict[str, Any]:
        """What the server saw of the machine over the polls: at its admission decisions,
        the share of its CPUs other processes took (`cpu_outside`) and why it refused;
        between them, the whole machine's busy fraction (`machine_busy_now`); the worst
        generation RTF of its recent streams (`rtf_now`) over the polls."""
        outside = [p["cpu_outside"] for p in self.polls if p.get("cpu_outside") is not None]
        busy = [p["machine_busy_now"] for p in self.polls if p.get("machine_busy_now") is not None]
        why = sorted({w for p in self.polls for w in (p.get("why") or [])})
        rtf = sorted(p["rtf_now"] for p in self.polls if p.get("rtf_now") is not None)
        return {"polls": len(self.polls), "cpu_outside_max": max(outside, default=None),
                "server_rtf_now_p50": rtf[len(rtf) // 2] if rtf else None, "server_rtf_now_max": rtf[-1] if rtf else None,
                "machine_busy_now_max": max(busy, default=None),
                "machine_busy_now_mean": round(sum(busy) / len(busy), 3) if busy else None, "refusing_why": why}


async def admission_view(base: str, key: str | None, since: float | None = None) -> dict[str, Any] | None:
    """What load-aware admission weighed with (`/v1/dashboard`; None where it cannot be
    read): each pipeline's cost and start-up calibration, and the figures behind every
    refusal since `since` (the server's wall clock: this one's, on the same machine),
    oldest first, and behind every session admitted although its prediction refused it
    (`min_sessions`). The dashboard keeps the last 20 decisions: a level of more sessions
    sees its newest 20 (`decisions` says how many were read)."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.get(base + "/v1/dashboard", headers={"Authorization": f"Bearer {key}"} if key else {})
            if r.status_code != 200:
                return None
            adm = r.json().get("admission") or {}
    except (httpx.HTTPError, ValueError):
        return None
    keep = ("sessions", "new_sessions", "rtf_now", "cost", "predicted_rtf_cold", "predicted_rtf_live", "front_end_cores_per_session",
            "cpu_outside", "machine_busy", "why")
    level = [d for d in reversed(adm.get("recent") or []) if d.get("load") and (since is None or d.get("time", 0) >= since)]
    refused = [{k: d["load"].get(k) for k in keep} for d in level if not d.get("admitted")]
    past = [{k: d["load"].get(k) for k in (*keep, "admitted_past_target")} for d in level if d.get("admitted") and d["load"].get("admitted_past_target")]
    return {"target_rtf": adm.get("target_rtf"), "costs": adm.get("costs"), "calibration": adm.get("calibration"), "decisions": len(level),
            "refused": refused, "admitted_past_target": past}


async def metrics_text(base: str, key: str | None) -> str | None:
    import httpx

    try:
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.get(base + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
            return r.text if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def histogram(text: str | None, name: str, **labels: str) -> dict[Any, float]:
    """A Prometheus histogram of a /metrics text (prometheus_client's parser), summed
    over the series whose labels include `labels`: {le (float): cumulative count,
    "_sum": …, "_count": …}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[Any, float] = {}
    for family in text_string_to_metric_families(text or ""):
        for s in family.samples:
            if not s.name.startswith(name) or any(s.labels.get(k) != v for k, v in labels.items()):
                continue
            key: Any = float(s.labels["le"]) if s.name == name + "_bucket" else s.name[len(name):] if s.name in (name + "_sum", name + "_count") else None
            if key is not None:
                out[key] = out.get(key, 0.0) + s.value
    return out


def bucket_bound(buckets: dict[Any, float], q: float) -> float | None:
    """The upper bucket bound under which a fraction q of a histogram's observations
    fall ({le: cumulative count}, as `histogram` gives; other keys are skipped)."""
    les = sorted((le, n) for le, n in buckets.items() if isinstance(le, float))
    if not les or les[-1][1] <= 0:
        return None
    total = les[-1][1]
    return next(le for le, n in les if n >= q * total)


def underruns(text: str | None, over_s: float = 0.1) -> dict[str, dict[str, float]]:
    """From a /metrics text: per cause, the paced-answer holes counted and those over
    `over_s` (the histogram's `le` bucket at `over_s` must exist)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    name = "omni_rt_playout_underrun_seconds"
    for family in text_string_to_metric_families(text or ""):
        for sample in family.samples:
            if not sample.name.startswith(name) or sample.labels.get("api") != "duplex":
                continue
            row = out.setdefault(sample.labels["cause"], {"count": 0.0, "le": 0.0})
            if sample.name == name + "_count":
                row["count"] = sample.value
            elif sample.name == name + "_bucket" and float(sample.labels["le"]) == over_s:
                row["le"] = sample.value
    return {c: {"holes": r["count"], "over_100ms": r["count"] - r["le"]} for c, r in out.items()}


def loop_lag(text: str | None) -> dict[float, float]:
    """From a /metrics text: the server's event-loop lag histogram, {le: cumulative count}."""
    return {le: n for le, n in histogram(text, "omni_rt_event_loop_lag_seconds").items() if isinstance(le, float)}


def loop_lag_between(before: str | None, after: str | None) -> dict[str, Any]:
    """The server's own event-loop lag between two /metrics texts (its 20 ms probe,
    `omni_rt.load.LoopLag`): ticks, those late by more than 20 / 50 / 100 ms, and the
    bucket bound the worst tick fell under (the server measures itself: a stall of the
    bench's own loop is not in it)."""
    a, b = loop_lag(before), loop_lag(after)
    if not b:
        return {}
    d = {le: n - a.get(le, 0.0) for le, n in b.items()}
    total = d.get(float("inf"), 0.0)
    worst = next((le for le in sorted(d) if d[le] >= total), None)
    return {"ticks": int(total), "over_20ms": int(total - d.get(0.02, total)), "over_50ms": int(total - d.get(0.05, total)),
            "over_100ms": int(total - d.get(0.1, total)), "worst_le_ms": None if worst is None or worst == float("inf") else worst * 1000}


def underruns_between(before: str | None, after: str | None) -> dict[str, dict[str, float]]:
    a, b = underruns(before), underruns(after)
    return {c: {k: v - a.get(c, {}).get(k, 0.0) for k, v in row.items()} for c, row in b.items()}
