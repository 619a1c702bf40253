"""Load-aware admission: refuse a real-time session the server cannot serve in real time.

Weighed: voice sessions (`realtime`, `duplex`, `webrtc`) and robots that declare their
control rate (`robot`, `control_hz`; a robot's real-time factor is each call's time
over how long its last chunk of actions lasts at that rate).

The static caps (`max_total`, `max_per_kind`) say how many sessions a box may hold;
they cannot say whether the next voice session will still hear an unbroken answer.
`RealtimeAdmission` decides that from what the streams measure (`omni_rt.load`):

- `now`: the worst generation real-time factor among the streams that emitted audio
  in the last `window_s` (None when nothing spoke lately);
- the per-session cost: the slope of that RTF against the number of real-time
  sessions admitted, fitted by least squares over the samples of the last
  `window_s × 6` (one a reaper pass, and one at each decision), once they span at
  least two session counts and the fit is positive; until then the prior
  `session_cost_rtf`. The slope folds in how much of the time sessions speak (a
  duty cycle the server observes rather than assumes), and never counts for less than
  `min_session_cost_rtf`.

A session open less than `new_session_s` has not shown its load yet (its user is
still speaking the first turn): it is left out of the fit and charged the cost on top
of what is measured. One more session is admitted when `now + cost × (new + 1)` (or
`(n + new + 1) × cost` when nothing was measured lately) stays under `target_rtf`.

The same prediction is made for the CPU busy fraction of the server's process tree
(`CpuMeter`, the mean of the last `CPU_WINDOW_S`; its own fitted cost, prior
`session_cost_cpu`) against `max_cpu_utilisation`: generation speed holds until the
cores saturate and then falls off a cliff a straight-line RTF fit does not foresee.
The CPU figure is the larger of the server's own share and the whole machine's busy
fraction on the server's cores (`MachineMeter`; a container's quota fill counts too), so
CPU taken by other processes is in the prediction (`weigh_outside_load`); the fitted
per-session cost stays the server's own. While the container's cgroup is throttled in
more than `max_throttled_fraction` of its CPU periods, nothing is admitted. Each refusal
says why (`rtf`, `cpu`, `outside_load`, `throttled`) in its message, in `/health`
(`realtime_admission.why`) and in the `omni_rt_admission_refusing{why}` gauge.
Once it refuses, it admits again only under each bound less `hysteresis`, so a server
at the edge does not flap between admitting and refusing. Only attached sessions are
weighed. The first `min_sessions` sessions are always admitted. A
refusal is `CapacityLimit`: the `session_limit` family's 429 / close 1013 with code
`capacity`, its own `retry-after` and the `omni_rt_sessions_rejected_total{reason=
"capacity"}` metric.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from omni_rt import metrics
from omni_rt.load import GENERATION, PLAYOUT, CpuMeter, HoleMeter, MachineLoad, MachineMeter, RtfMeter
from omni_rt.specs import RealtimeAdmissionSpec
from sessions.errors import CapacityLimit

__all__ = ["CPU_WINDOW_S", "RealtimeAdmission"]

# The CPU busy fraction is the mean over this span: voice load comes in turns, so a
# shorter one reads a lull between turns as room (and a single turn's prefill burst as
# saturation); its busiest reading instead refused at three sessions.
CPU_WINDOW_S = 10.0


def _slope(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of y against x, None until x takes two values."""
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        return None
    ys = [y for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


class RealtimeAdmission:
    def __init__(
        self,
        spec: RealtimeAdmissionSpec,
        meter: RtfMeter | None = None,
        clock: Callable[[], float] = time.monotonic,
        cpu: CpuMeter | None = None,
        machine: MachineMeter | None = None,
        holes: HoleMeter | None = None,
    ) -> None:
        self.spec = spec
        self.meter = meter if meter is not None else GENERATION
        self.holes = holes if holes is not None else PLAYOUT
        self.cpu = cpu if cpu is not None else CpuMeter(CPU_WINDOW_S)
        self.machine = machine if machine is not None else MachineMeter(CPU_WINDOW_S)
        self.machine_load: MachineLoad | None = None
        self.clock = clock
        self.kinds = frozenset(spec.kinds)
        # (time, established sessions, worst rtf or None, cpu busy fraction or None)
        self._samples: deque[tuple[float, int, float | None, float | None]] = deque()
        self.refusing = False
        self.last: dict[str, Any] = {}

    def applies(self, kind: str, control_hz: float | None = None) -> bool:
        """Whether a session of `kind` is weighed: a voice kind it was told to weigh,
        or a robot that declared its control rate (one that did not has no deadline to
        keep)."""
        return self.spec.enabled and kind in self.kinds and (kind != "robot" or control_hz is not None)

    def observe(self, sessions: int) -> tuple[float | None, float | None]:
        """Take one sample (established sessions, worst RTF now, CPU busy fraction)."""
        now = self.clock()
        rtf = self.meter.worst()  # on the meter's own clock, like the streams it measured
        cpu = self.cpu.utilisation() if self.spec.max_cpu_utilisation is not None else None
        if self.spec.weigh_outside_load or self.spec.max_throttled_fraction is not None:
            self.machine_load = self.machine.load()
        self._samples.append((now, sessions, rtf, cpu))
        horizon = now - 6 * self.spec.window_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()
        return rtf, cpu

    def _fitted(self, part: int, prior: float) -> tuple[float, str]:
        """The slope of sample part `part` (2: RTF, 3: CPU) against the established
        sessions, and where the figure comes from; `prior` until it can be fitted."""
        slope = _slope([(x[1], y) for x in self._samples if (y := x[part]) is not None])
        if slope is not None and slope > 0:
            return max(slope, self.spec.min_session_cost_rtf), "measured"
        return prior, "prior"

    def cost(self) -> tuple[float, str]:
        """What one more session adds to the RTF, and where the figure comes from."""
        return self._fitted(2, self.spec.session_cost_rtf)

    def cpu_cost(self) -> tuple[float, str]:
        """What one more session adds to the CPU busy fraction."""
        return self._fitted(3, self.spec.session_cost_cpu)

    def _busy(self, own: float | None) -> tuple[float | None, float]:
        """(CPU busy fraction now, the part of it taken by others): the server's own
        share, raised to the whole machine's on its cores when outside load is weighed."""
        load = self.machine_load
        if not self.spec.weigh_outside_load or load is None:
            return own, 0.0
        whole = load.effective()
        if own is None:
            return whole, 0.0
        own = own * self._quota_scale()
        return max(own, whole), max(0.0, whole - own)

    def _quota_scale(self) -> float:
        """The server's own share is measured on the cores it may run on; under a
        smaller container quota the same CPU seconds fill more of what it may use."""
        load = self.machine_load
        if not self.spec.weigh_outside_load or load is None or load.capacity_cpus <= 0:
            return 1.0
        return max(1.0, self.cpu.cpus / load.capacity_cpus)

    def check(self, kind: str, sessions: int, new: int = 0) -> None:
        """Admit one more `kind` session next to `sessions` established real-time ones
        and `new` ones that have not shown their load yet, or raise CapacityLimit."""
        rtf, own = self.observe(sessions)
        cost, source = self.cost()
        predicted = rtf + cost * (new + 1) if rtf is not None else (sessions + new + 1) * cost
        margin = self.spec.hysteresis if self.refusing else 0.0
        why: list[str] = []
        if predicted > self.spec.target_rtf - margin + 1e-9:
            why.append("rtf")
        cpu, outside = self._busy(own)
        predicted_cpu = None
        if self.spec.max_cpu_utilisation is not None and cpu is not None:
            ccost = self.cpu_cost()[0] * self._quota_scale()
            bound = self.spec.max_cpu_utilisation - margin + 1e-9
            predicted_cpu = cpu + ccost * (new + 1)
            if predicted_cpu > bound:
                why.append("outside_load" if outside > 0 and predicted_cpu - outside <= bound else "cpu")
        load = self.machine_load
        throttled = None if load is None else load.throttled
        if self.spec.max_throttled_fraction is not None and throttled is not None and throttled > self.spec.max_throttled_fraction:
            why.append("throttled")
        hole = self.holes.worst() if self.spec.max_hole_ms is not None else None
        if hole is not None and self.spec.max_hole_ms is not None and hole * 1000 >= self.spec.max_hole_ms:
            why.append("late_audio")
        admit = sessions + new < self.spec.min_sessions or not why
        self.refusing = not admit
        self.last = {
            "sessions": sessions,
            "new_sessions": new,
            "rtf_now": rtf,
            "session_cost_rtf": round(cost, 4),
            "cost_from": source,
            "predicted_rtf": round(predicted, 4),
            "cpu_now": None if cpu is None else round(cpu, 4),
            "cpu_own": None if own is None else round(own * self._quota_scale(), 4),
            "cpu_outside": round(outside, 4),
            "predicted_cpu": None if predicted_cpu is None else round(predicted_cpu, 4),
            **(load.as_dict() if load is not None else {}),
            "worst_hole_ms": None if hole is None else round(hole * 1000, 1),
            "admitting": admit,
            "why": [] if admit else why,
        }
        self._export(own, outside, cpu, throttled, [] if admit else why)
        if not admit:
            raise CapacityLimit(
                kind, sessions + new, predicted, self.spec.target_rtf, self.spec.retry_after_s,
                cpu=predicted_cpu, max_cpu=self.spec.max_cpu_utilisation, outside=outside, throttled=throttled, hole=hole, why=why,
            )

    @staticmethod
    def _export(own: float | None, outside: float, cpu: float | None, throttled: float | None, why: list[str]) -> None:
        if own is not None:
            metrics.ADMISSION_CPU.labels("own").set(own)
        metrics.ADMISSION_CPU.labels("outside").set(outside)
        if cpu is not None:
            metrics.ADMISSION_CPU.labels("machine").set(cpu)
        if throttled is not None:
            metrics.ADMISSION_THROTTLED.set(throttled)
        for w in ("rtf", "cpu", "outside_load", "throttled", "late_audio"):
            metrics.ADMISSION_REFUSING.labels(w).set(1 if w in why else 0)

    def health(self) -> dict[str, Any]:
        """The last decision's figures, and the machine's load now (read afresh: the
        last decision may be long past)."""
        if self.spec.weigh_outside_load or self.spec.max_throttled_fraction is not None:
            self.machine_load = self.machine.load() or self.machine_load
        live = self.machine_load.as_dict() if self.machine_load is not None else {}
        return {"enabled": self.spec.enabled, "target_rtf": self.spec.target_rtf, "max_cpu_utilisation": self.spec.max_cpu_utilisation,
                "weigh_outside_load": self.spec.weigh_outside_load, "refusing": self.refusing, **self.last, "machine_now": live}
