"""Load-aware admission: refuse a real-time session the server cannot serve in real time.

Weighed: voice sessions (`realtime`, `duplex`, `webrtc`) and robots that declare their
control rate (`robot`, `control_hz`; a robot's real-time factor is each call's time
over how long its last chunk of actions lasts at that rate).

The static caps (`max_total`, `max_per_kind`) say how many sessions a box may hold;
they cannot say whether the next voice session will still hear an unbroken answer.
`RealtimeAdmission` decides that on real-time slack, the generation real-time factor
(RTF: generation time over the audio's duration; above 1 a listener hears holes):

- **what a session costs**, known before the first one arrives: each real-time voice
  pipeline is calibrated when the server starts (`sessions.calibrate`: one answer
  alone, then `calibrate_sessions` answers at once, as a burst of callers would
  generate them), giving the RTF of one answer alone (`base`) and what each more answer
  generating at the same time adds (`per_session`). A deploy file may state them
  instead (`pipeline_costs`); a kind nothing was measured for uses the prior
  `session_cost_rtf` for both. `omni-rt check` shows what the deploy states.
- **the cold prediction**: with N sessions after admitting this one, all generating at
  once, `base + per_session × (N − 1)`. Voice sessions speak in turns, so this is the
  worst case of a burst whose callers all speak at the same moment.
- **the live prediction**: the worst RTF among the streams that emitted audio in the last
  `window_s` (the load as it is now), plus `per_session` for this and every session
  younger than `new_session_s` (it has not shown its load yet). Once no stream is
  generating, the window holds finished answers, and each stands for the answers that
  generated at once with it: a finished level of 4 that measured 0.5 predicts a burst of
  8 at `0.5 + per_session × 4` (charging it on top of the 8, a burst after a busy level
  was refused on load that had left), a caller answered alone who left for one of the N;
  a stream still generating (a detached session's answer, a speech request) with no
  session established is load beside the N.
- **load from outside**: the calibration ran on the machine as it was at start-up. The
  share of the server's CPUs other processes take now (the whole machine's busy
  fraction on its cores, a container's quota fill, less the server's own and its placed
  stages' share; sampled off the event loop) stretches the cold prediction by
  `1 / (1 − share)`; the live one already hears it. While the container's cgroup is
  throttled in more than `max_throttled_fraction` of its CPU periods, nothing is
  admitted.
- **what the sessions hear**: a hole of `max_hole_ms` or more in a paced answer within
  the window refuses (`late_audio`), when the server caused it (late generation, or a
  writer that ran late); a client that does not read makes its own holes, which are
  its session's problem, not a reason to refuse anyone else.

One more session is admitted when the larger prediction stays under `target_rtf`. The
server's own CPU busy fraction is no refusal reason by default: generation runs as fast
as the cores allow, so busy cores say nothing of real-time slack
(`max_cpu_utilisation` brings the bound back). Each refusal says why (`rtf`,
`outside_load`, `cpu`, `throttled`, `late_audio`) in its message, in `/health`
(`realtime_admission.why`) and in the `omni_rt_admission_refusing{why}` gauge. Once it
refuses, it admits again only under each bound less `hysteresis`. Only attached
sessions are weighed. The first `min_sessions` sessions are always admitted; one admitted
although its prediction refuses it says so in the decision (`admitted_past_target`: why
it would have been refused): it may not keep real time. A refusal
is `CapacityLimit`: the `session_limit` family's 429 / close 1013 with code `capacity`,
its own `retry-after` and the `omni_rt_sessions_rejected_total{reason="capacity"}`
metric.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omni_rt import metrics
from omni_rt.load import LoadMeters, MachineLoad
from omni_rt.specs import RealtimeAdmissionSpec
from sessions.errors import CapacityLimit

__all__ = ["OUTSIDE_DEADBAND", "Cost", "RealtimeAdmission"]

# Other processes' share of the CPUs below this is read as noise (the kernel, a shell).
OUTSIDE_DEADBAND = 0.05
# Past this share the prediction is refused outright (1 / (1 - share) grows without bound).
OUTSIDE_MAX = 0.9


@dataclass(frozen=True)
class Cost:
    """What real-time sessions of one pipeline cost in generation RTF: one alone, and
    what each more one generating at the same time adds."""

    base: float
    per_session: float
    source: str  # calibrated | deploy | prior

    def at(self, sessions: int) -> float:
        """The RTF with `sessions` generating at once."""
        return self.base + self.per_session * max(0, sessions - 1)

    def sessions_under(self, target: float) -> int:
        """How many sessions generating at once stay under `target`."""
        if self.base > target:
            return 0
        return 1 + int((target - self.base) / self.per_session + 1e-9)

    def as_dict(self) -> dict[str, Any]:
        return {"base_rtf": round(self.base, 4), "per_session_rtf": round(self.per_session, 4), "from": self.source}


class RealtimeAdmission:
    def __init__(self, spec: RealtimeAdmissionSpec, meters: LoadMeters | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.meters = meters if meters is not None else LoadMeters(spec.window_s)
        self.meters.set_window(spec.window_s)
        self.clock = clock
        self.kinds = frozenset(spec.kinds)
        self.costs: dict[str, Cost] = {  # per pipeline: stated in the deploy, or calibrated at start-up
            name: Cost(c.base_rtf, max(c.per_session_rtf, spec.min_session_cost_rtf), "deploy") for name, c in spec.pipeline_costs.items()
        }
        self.calibration: dict[str, Any] = {}  # per pipeline: what the start-up calibration measured
        self._front: tuple[float, str] = (spec.front_end_cpu_per_session, "prior")
        self.refusing = False
        self.last: dict[str, Any] = {}

    def applies(self, kind: str, control_hz: float | None = None) -> bool:
        """Whether a session of `kind` is weighed: a voice kind it was told to weigh,
        or a robot that declared its control rate (one that did not has no deadline to
        keep)."""
        return self.spec.enabled and kind in self.kinds and (kind != "robot" or control_hz is not None)

    def cost(self, pipeline: str | None = None) -> Cost:
        """What a session of `pipeline` costs; the prior when it was neither stated nor measured."""
        c = self.costs.get(pipeline or "")
        if c is not None:
            return c
        p = self.spec.session_cost_rtf
        return Cost(p, p, "prior")

    def cost_of_levels(self, levels: dict[int, float]) -> Cost:
        """The cost measured at `levels` ({answers at once: worst RTF}, 1 among them): the
        RTF alone, and the steepest slope from it to another level (never under
        `min_session_cost_rtf`)."""
        base = levels[1]
        slopes = [(r - base) / (n - 1) for n, r in levels.items() if n > 1]
        return Cost(base, max([*slopes, self.spec.min_session_cost_rtf]), "calibrated")

    def calibrated(self, pipeline: str, levels: dict[int, float], details: dict[str, Any] | None = None) -> Cost:
        """Record a start-up calibration ({answers at once: worst RTF}). A cost the deploy
        states wins."""
        cost = self.cost_of_levels(levels)
        self.calibration[pipeline] = {**(details or {}), "base_rtf": round(cost.base, 4), "per_session_rtf": round(cost.per_session, 4),
                                      **{f"rtf_at_{n}": round(r, 4) for n, r in sorted(levels.items())}}
        if pipeline not in self.costs or self.costs[pipeline].source != "deploy":
            self.costs[pipeline] = cost
        return self.costs[pipeline]

    def outside_share(self) -> tuple[float, float | None]:
        """(share of the server's CPUs other processes take, the server's own busy
        fraction) from the latest sample; 0 until there is one or when not weighed."""
        own = self.meters.cpu_now
        load = self.meters.machine_now
        if not self.spec.weigh_outside_load or load is None:
            return 0.0, own
        own_scaled = (own or 0.0) * self._quota_scale(load)
        share = max(0.0, load.effective() - own_scaled)
        return (share if share >= OUTSIDE_DEADBAND else 0.0), own_scaled

    def _quota_scale(self, load: MachineLoad) -> float:
        """The server's own share is measured on the cores it may run on; under a
        smaller container quota the same CPU seconds fill more of what it may use."""
        if load.capacity_cpus <= 0:
            return 1.0
        return max(1.0, self.meters.cpu.cpus / load.capacity_cpus)

    def front_end(self, sessions: int) -> tuple[float, str]:
        """The CPU (in cores) the server's front end spends per real-time session (VAD,
        resampling, pacing, framing: the process but its in-process engines), and where
        the figure comes from: measured over the `sessions` established ones (those
        younger than `new_session_s` have not loaded it yet), else the last measure,
        else the prior `front_end_cpu_per_session`."""
        if not self.spec.weigh_front_end:
            return 0.0, "not weighed"
        f = self.meters.front_now
        if f is not None and sessions > 0:
            self._front = (f * self.meters.front.cpus / sessions, "measured")
        return self._front

    def _live(self, cost: Cost, sessions: int, n: int) -> float | None:
        """The live prediction for `n` sessions, `sessions` of them established: each
        measured stream's RTF plus `per_session` for the answers it did not carry.

        While a stream is still generating, the measured RTFs carry the established
        sessions' answers (a stream with none established, a speech request or a
        detached session's answer, is load beside the n). Once none is generating, the
        window holds finished answers: each stands for as many answers as generated at
        once with it (a finished level of 4 measured 0.5 predicts 8 at
        0.5 + per_session x 4, not at 0.5 + per_session x 7), and at least for the
        established sessions', or for one (a caller who left)."""
        gen = self.meters.generation
        measured = gen.measured()
        if not measured:
            return None
        if gen.in_flight():
            return max(r for r, _ in measured) + cost.per_session * (n - sessions)
        return max(r + cost.per_session * (n - max(sessions, k, 1)) for r, k in measured)

    def check(self, kind: str, sessions: int, new: int = 0, pipeline: str | None = None) -> None:
        """Admit one more `kind` session of `pipeline` next to `sessions` established
        real-time ones and `new` ones that have not shown their load yet, or raise
        CapacityLimit. Reads the latest samples only: nothing here touches /proc."""
        a = self.assess(sessions, new, pipeline)
        admit, why, own, outside, load, throttled = a["admit"], a["why"], a["own"], a["outside"], a["load"], a["throttled"]
        self.refusing = not admit
        self.last = a["record"]
        self._export(own, outside, load, throttled, [] if admit else why)
        if not admit:
            raise CapacityLimit(
                kind, sessions + new, a["predicted"], self.spec.target_rtf, self.spec.retry_after_s,
                cpu=a["predicted_cpu"],
                max_cpu=self.spec.max_cpu_utilisation, outside=outside, throttled=throttled, hole=a["hole"], why=why,
            )

    def headroom(self, sessions: int, new: int = 0, pipeline: str | None = None, limit: int = 256) -> int:
        """How many more real-time sessions of `pipeline` the check would admit now, one
        after the other (each counted as new), up to `limit`: what an autoscaler reads.
        Decides nothing and records nothing."""
        k = 0
        while k < limit and self.assess(sessions, new + k, pipeline)["admit"]:
            k += 1
        return k

    def assess(self, sessions: int, new: int = 0, pipeline: str | None = None) -> dict[str, Any]:
        """The check's figures and decision for one more session, without acting on it."""
        spec = self.spec
        cost = self.cost(pipeline)
        rtf = self.meters.generation.worst()
        n = sessions + new + 1
        outside, own = self.outside_share()
        front, front_from = self.front_end(sessions)
        cpus = self.meters.machine_now.capacity_cpus if self.meters.machine_now is not None else float(self.meters.cpu.cpus)
        front_share = front * n / max(cpus, 1e-9)
        cold = cost.at(n)
        # the calibration measured the engines alone: the front end of n sessions and
        # other processes take their shares of the cores from them
        cold_front = cold / (1.0 - min(front_share, OUTSIDE_MAX))
        stretched = cold / (1.0 - min(front_share + outside, OUTSIDE_MAX))
        live = self._live(cost, sessions, n)
        predicted = max(stretched, live if live is not None else 0.0)
        margin = spec.hysteresis if self.refusing else 0.0
        bound = spec.target_rtf - margin + 1e-9
        why: list[str] = []
        if outside >= OUTSIDE_MAX:
            why.append("outside_load")
        elif predicted > bound:
            why.append("outside_load" if cold_front <= bound and (live is None or live <= bound) else "rtf")
        predicted_cpu = None
        if spec.max_cpu_utilisation is not None and own is not None:
            predicted_cpu = own + outside + spec.session_cost_cpu * (new + 1)
            if predicted_cpu > spec.max_cpu_utilisation - margin + 1e-9:
                why.append("cpu")
        load = self.meters.machine_now
        throttled = None if load is None else load.throttled
        if spec.max_throttled_fraction is not None and throttled is not None and throttled > spec.max_throttled_fraction:
            why.append("throttled")
        hole = self.meters.playout.worst() if spec.max_hole_ms is not None else None
        if hole is not None and spec.max_hole_ms is not None and hole * 1000 >= spec.max_hole_ms:
            why.append("late_audio")
        admit = sessions + new < spec.min_sessions or not why
        # admitted although the prediction refuses it (one of the first min_sessions): the
        # decision says so, and that this session may not keep real time
        past_target = admit and bool(why)
        record = {
            "sessions": sessions,
            "new_sessions": new,
            "pipeline": pipeline,
            "rtf_now": None if rtf is None else round(rtf, 4),
            "cost": cost.as_dict(),
            # kept under their earlier names for dashboards and the benches
            "session_cost_rtf": round(cost.per_session, 4),
            "cost_from": cost.source,
            "predicted_rtf_cold": round(stretched, 4),
            "front_end_cores_per_session": round(front, 4),
            "front_end_from": front_from,
            "predicted_rtf_live": None if live is None else round(live, 4),
            "predicted_rtf": round(predicted, 4),
            "cpu_own": None if own is None else round(own, 4),
            "cpu_outside": round(outside, 4),
            "predicted_cpu": None if predicted_cpu is None else round(predicted_cpu, 4),
            **(load.as_dict() if load is not None else {}),
            "worst_hole_ms": None if hole is None else round(hole * 1000, 1),
            "loop_lag_ms": round(self.meters.loop.worst() * 1000, 1),
            "admitting": admit,
            "why": [] if admit else why,
            "admitted_past_target": why if past_target else [],
        }
        return {"admit": admit, "why": why, "own": own, "outside": outside, "load": load, "throttled": throttled,
                "predicted": predicted, "predicted_cpu": predicted_cpu, "hole": hole, "record": record}

    @staticmethod
    def _export(own: float | None, outside: float, load: MachineLoad | None, throttled: float | None, why: list[str]) -> None:
        if own is not None:
            metrics.ADMISSION_CPU.labels("own").set(own)
        metrics.ADMISSION_CPU.labels("outside").set(outside)
        if load is not None:
            metrics.ADMISSION_CPU.labels("machine").set(load.effective())
        if throttled is not None:
            metrics.ADMISSION_THROTTLED.set(throttled)
        for w in ("rtf", "cpu", "outside_load", "throttled", "late_audio"):
            metrics.ADMISSION_REFUSING.labels(w).set(1 if w in why else 0)

    def health(self) -> dict[str, Any]:
        """The last decision's figures, and the load now (the latest samples)."""
        load = self.meters.machine_now
        live = load.as_dict() if load is not None else {}
        outside, own = self.outside_share()
        rtf = self.meters.generation.worst()
        return {"enabled": self.spec.enabled, "target_rtf": self.spec.target_rtf, "max_cpu_utilisation": self.spec.max_cpu_utilisation,
                "weigh_outside_load": self.spec.weigh_outside_load, "refusing": self.refusing,
                "costs": {k: v.as_dict() for k, v in self.costs.items()}, "calibration": self.calibration, **self.last,
                "rtf_now": None if rtf is None else round(rtf, 4), "rtf_at_last_decision": self.last.get("rtf_now"),
                "machine_now": {**live, "cpu_own": None if own is None else round(own, 4), "cpu_outside": round(outside, 4)},
                "loop_lag_ms_now": round(self.meters.loop.worst() * 1000, 1),
                "loop_lag_ms_max": round(self.meters.loop.worst_ever * 1000, 1),
                "loop_blocked": list(self.meters.loop.blocked)[-5:]}
