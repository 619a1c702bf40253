"""Load-aware admission of real-time sessions, on synthetic costs and meters.

The meters are fed streams whose generation RTF is what a server with a fixed cost and
a per-session cost would measure (`base + per × (sessions - 1)`, every session
generating at once), on a virtual clock, and CPU readings of a fake server and machine;
the session manager then decides each new voice session from them.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest

from omni_rt import metrics
from omni_rt.load import CPU_WINDOW_S, CgroupCpu, CpuMeter, HoleMeter, LoadMeters, MachineMeter, ProcessTree, RtfMeter, machine_cpu_seconds, read_cgroup_cpu
from omni_rt.specs import PipelineCostSpec, RealtimeAdmissionSpec, SessionsSpec
from sessions import SessionManager
from sessions.errors import CapacityLimit, SessionLimit
from sessions.store import Limits, MemoryStore, Slot


class World:
    def __init__(self, base: float, per: float, store=None, **spec) -> None:
        self.t = [0.0]
        clock = lambda: self.t[0]  # noqa: E731
        self.base, self.per = base, per
        self.cpu_s = [0.0]  # CPU seconds the fake server tree has used
        # the whole machine (2 CPUs): the server's CPU seconds plus what other processes
        # used (`outside_s`); the container's cgroup, when a test gives it one
        self.outside_s = [0.0]
        self.cgroup: list[CgroupCpu | None] = [None]
        self.front_s = [0.0]  # of which the front end's (the process less its in-process engines)
        spec.setdefault("front_end_cpu_per_session", 0.0)  # the tests that weigh the front end say so
        self.meters = LoadMeters(
            10.0, clock, cpu=CpuMeter(CPU_WINDOW_S, clock=clock, read=lambda: self.cpu_s[0], cpus=2),
            front=CpuMeter(CPU_WINDOW_S, clock=clock, read=lambda: self.front_s[0], cpus=2),
            machine=MachineMeter(CPU_WINDOW_S, clock=clock, read_machine=lambda: (self.cpu_s[0] + self.outside_s[0], 2 * self.t[0]),
                                 read_cgroup=lambda: self.cgroup[0], cpus=2),
        )
        self.meter: RtfMeter = self.meters.generation
        self.holes: HoleMeter = self.meters.playout  # holes the sessions' clients heard
        self.m = SessionManager(SessionsSpec(realtime_admission=RealtimeAdmissionSpec(**spec)), store=store, clock=clock, meters=self.meters)

    def rtf(self, sessions: int) -> float:
        return self.base + self.per * max(0, sessions - 1)

    def speak(self, n: int | None = None) -> float:
        """Every admitted session (or `n`) answers once at the RTF its count gives; the
        CPU meters take a reading; a second passes."""
        n = self.m.realtime_sessions() if n is None else n
        r = self.rtf(n)
        for _ in range(n):
            key = self.meter.new_stream()
            self.meter.chunk(key, 0.1, self.t[0])  # the first chunk
            self.meter.chunk(key, 1.0, self.t[0] + r)  # 1 s of audio generated in r seconds
        self.meters.sample()
        self.t[0] += 1.0
        return r

    def second(self, own: float = 0.0, outside: float = 0.0, front: float = 0.0) -> None:
        """A second of the server busy `own` of its 2 CPUs (`front` of them its front
        end's), other processes `outside`."""
        self.cpu_s[0] += own * 2
        self.front_s[0] += front * 2
        self.outside_s[0] += outside * 2
        self.t[0] += 1.0
        self.meters.sample()


async def _burst(m: SessionManager, n: int, kind: str = "duplex", pipeline: str | None = "voice") -> tuple[list, list[CapacityLimit]]:
    admitted, refused = [], []
    for _ in range(n):
        try:
            admitted.append(await m.open(kind, principal="p", pipeline=None) if pipeline is None else await _open(m, kind, pipeline))
        except CapacityLimit as exc:
            refused.append(exc)
    return admitted, refused


async def _open(m: SessionManager, kind: str, pipeline: str):
    # no orchestrator here: the pipeline is only the name admission's costs are kept under
    return await m.open(kind, pipeline, principal="p")


async def test_a_burst_at_a_cold_calibrated_server_admits_what_the_calibration_says_fits():
    """The start-up calibration measured 0.2 alone and 0.41 with four at once: each more
    session adds 0.07. A burst of 12 at a server that has served nobody: nine fit under
    0.8 with all of them generating at once (0.2 + 0.07 x 8 = 0.76), the tenth would not."""
    w = World(base=0.0, per=0.0, target_rtf=0.8, retry_after_s=7)
    cost = w.m.admission.calibrated("voice", {1: 0.2, 4: 0.41})
    assert cost.per_session == pytest.approx(0.07) and cost.source == "calibrated" and cost.sessions_under(0.8) == 9
    admitted, refused = await _burst(w.m, 12)
    assert len(admitted) == 9 and len(refused) == 3
    exc = refused[0]
    assert isinstance(exc, SessionLimit) and exc.code == "capacity" and exc.http_status == 429 and exc.why == ["rtf"]
    assert exc.headers["retry-after"] == "7" and "real-time capacity" in str(exc)
    last = w.m.admission.last
    assert last["cost"] == {"base_rtf": 0.2, "per_session_rtf": 0.07, "from": "calibrated"} and last["predicted_rtf_cold"] == pytest.approx(0.83)
    h = w.m.health()["realtime_admission"]
    assert h["costs"]["voice"]["from"] == "calibrated" and h["calibration"]["voice"]["rtf_at_4"] == 0.41
    await w.m.stop()


def test_the_steepest_measured_slope_is_kept_where_the_cores_saturate():
    """1 and 4 at once say 8 fit; 8 at once measured 0.95: the line through that level is
    kept, and 6 fit."""
    from sessions.admission import RealtimeAdmission

    adm = RealtimeAdmission(RealtimeAdmissionSpec(), LoadMeters())
    assert adm.cost_of_levels({1: 0.35, 4: 0.52}).sessions_under(0.8) == 8
    cost = adm.calibrated("voice", {1: 0.35, 4: 0.52, 8: 0.95}, {"took_s": 1.0})
    assert cost.per_session == pytest.approx(0.6 / 7) and cost.sessions_under(0.8) == 6
    assert adm.calibration["voice"] == {"took_s": 1.0, "base_rtf": 0.35, "per_session_rtf": 0.0857, "rtf_at_1": 0.35, "rtf_at_4": 0.52, "rtf_at_8": 0.95}
    assert adm.cost_of_levels({1: 0.3, 4: 0.3}).per_session == adm.spec.min_session_cost_rtf  # batching for free is never assumed


async def test_a_server_calibrates_its_voice_pipeline_before_its_first_caller():
    """The in-process app over fake stages whose talker makes audio 2x faster than real
    time: at start-up the voice pipeline answers alone and in bursts, and its measured
    cost is what admission weighs (in /health)."""
    from testkit import Speeds, serve

    overlay = {"sessions": {"realtime_admission": {"calibrate": True, "calibrate_sessions": 2, "calibrate_max_sessions": 3,
                                                   "calibrate_tokens": 8}}}
    async with serve(["voice"], overlay, speeds=Speeds(token_s=2048 / 24000 / 2)) as h:
        adm = h.sessions.health()["realtime_admission"]
        cal = adm["calibration"]["voice"]
        assert adm["costs"]["voice"]["from"] == "calibrated", adm
        assert 0 < cal["base_rtf"] < 1 and cal["audio_s"] == 3.0 and 1 in cal["answers_at_once"] and 2 in cal["answers_at_once"]
        assert h.sessions.meters.generation.worst() is None  # the calibration's streams are not the load of the first callers


async def test_a_cost_the_deploy_states_wins_over_calibration_and_the_prior_bounds_what_was_measured_nowhere():
    w = World(base=0.0, per=0.0, target_rtf=0.8, session_cost_rtf=0.1,
              pipeline_costs={"voice": PipelineCostSpec(base_rtf=0.3, per_session_rtf=0.25)})
    w.m.admission.calibrated("voice", {1: 0.1, 4: 0.13})  # measured, but the deploy says otherwise
    assert w.m.admission.cost("voice").source == "deploy"
    admitted, _ = await _burst(w.m, 5)
    assert len(admitted) == 3  # 0.3 + 0.25 x 2 = 0.8
    await w.m.stop()
    w = World(base=0.0, per=0.0, session_cost_rtf=0.1, target_rtf=0.8)
    admitted, refused = await _burst(w.m, 10, kind="realtime", pipeline=None)
    assert len(admitted) == 8 and refused[0].cap == 8  # 8 x 0.1 = 0.8 fits, 9 would not
    assert w.m.admission.last["cost_from"] == "prior" and w.m.realtime_sessions() == 8
    for _ in range(5):
        await w.m.open("oneshot")  # not a real-time kind: the caps alone decide
        await w.m.open("robot")
    await w.m.stop()


async def test_the_front_ends_share_of_the_cores_stretches_the_cold_prediction():
    """The calibration measured the engines alone; each open session's front end (VAD,
    resampling, pacing) takes its share of the cores from them. Before it is measured,
    the prior: 0.2 cores a session on 2 cores; 0.2 + 0.05 x 3 = 0.35 with four,
    stretched by 1 / (1 - 0.4) = 0.58; with five, 0.4 / 0.5 = 0.8; with six 0.45 / 0.4.
    Measured over the five once established: 0.05 cores a session, and nine fit."""
    w = World(base=0.0, per=0.0, target_rtf=0.8, front_end_cpu_per_session=0.2, new_session_s=10)
    w.m.admission.calibrated("voice", {1: 0.2, 4: 0.35})
    admitted, refused = await _burst(w.m, 8)
    assert len(admitted) == 5 and refused[0].why == ["rtf"]
    assert w.m.admission.last["front_end_from"] == "prior" and w.m.admission.last["predicted_rtf_cold"] == pytest.approx(1.125)
    for _ in range(11):
        w.second(own=0.3, front=0.125)  # the five sessions' front end: 0.25 of 2 cores
    w.m.admission.refusing = False
    more, _ = await _burst(w.m, 8)
    assert w.m.admission.last["front_end_from"] == "measured" and w.m.admission.last["front_end_cores_per_session"] == pytest.approx(0.05)
    assert len(admitted) + len(more) == 9  # 0.2 + 0.05 x 8 = 0.6, / (1 - 0.225) = 0.77; a 10th: 0.65 / 0.75 = 0.87
    await w.m.stop()


async def test_one_long_answer_on_a_busy_cpu_does_not_refuse_the_next_caller():
    """One session generates a long answer as fast as the cores allow: the CPUs are
    saturated, but its RTF is 0.53 and a second session adds 0.07: it fits."""
    w = World(base=0.53, per=0.07, target_rtf=0.8, new_session_s=0)
    w.m.admission.calibrated("voice", {1: 0.23, 4: 0.44})
    await _open(w.m, "duplex", "voice")
    for _ in range(6):
        w.cpu_s[0] += 2.0  # both cores busy
        w.speak(1)
    await _open(w.m, "duplex", "voice")
    last = w.m.admission.last
    assert last["admitting"] and last["cpu_own"] == pytest.approx(1.0) and last["predicted_rtf_live"] == pytest.approx(0.6)
    await w.m.stop()


async def test_live_load_refuses_and_a_finished_level_is_forgotten_within_the_window():
    """The established sessions measure more than the calibration said (longer answers,
    something it did not see): the live prediction refuses; once that level is over, its
    streams leave the window (4 s) and the next burst is weighed cold again."""
    w = World(base=0.6, per=0.1, target_rtf=0.8, hysteresis=0.1, new_session_s=0)
    w.m.admission.calibrated("voice", {1: 0.2, 4: 0.26})  # 0.02 a session
    admitted, _ = await _burst(w.m, 3)
    assert len(admitted) == 3
    w.speak()  # 3 at once measure 0.8
    with pytest.raises(CapacityLimit) as exc:
        await _open(w.m, "duplex", "voice")
    assert exc.value.why == ["rtf"] and w.m.admission.last["predicted_rtf_live"] == pytest.approx(0.82)
    assert w.m.admission.last["predicted_rtf_cold"] == pytest.approx(0.26)
    for s in admitted:
        await w.m.close(s.id)
    w.t[0] += 4.5  # the level's streams leave the window
    again, refused = await _burst(w.m, 8)
    assert len(again) == 8 and not refused  # 0.2 + 0.02 x 7 = 0.34 cold (under 0.8 - 0.1), nothing live
    await w.m.stop()


async def test_a_burst_after_one_answer_at_an_idle_server_is_not_charged_that_answer_twice():
    """A caller was answered alone (0.3, still in the window) and left; then a burst
    arrives. No session is established: the measured stream stands for one of the burst's
    answers, so the live prediction for n at once is 0.3 + 0.1 x (n - 1), as the cold
    one: four fit under 0.65. (Charged on top, it said 0.7 at the fourth and refused it.)"""
    w = World(base=0.3, per=0.1, target_rtf=0.65, hysteresis=0.0)
    w.m.admission.calibrated("voice", {1: 0.3, 4: 0.6})
    w.speak(1)
    w.t[0] += 1.0  # its answer finished 1.7 s ago; its stream is still in the window
    admitted, refused = await _burst(w.m, 6)
    assert len(admitted) == 4 and len(refused) == 2
    last = w.m.admission.last
    assert last["rtf_now"] == pytest.approx(0.3) and last["new_sessions"] == 4 and last["predicted_rtf_live"] == pytest.approx(0.7)
    assert refused[0].why == ["rtf"]
    await w.m.stop()
    # a stream still generating (a speech request, a detached session's answer) is load
    # beside the burst: 0.3 + 0.1 x n
    w = World(base=0.3, per=0.1, target_rtf=0.65, hysteresis=0.0)
    w.m.admission.calibrated("voice", {1: 0.3, 4: 0.6})
    key = w.meter.new_stream()
    w.meter.chunk(key, 0.1, 0.0)
    w.meter.chunk(key, 1.0, 0.3)
    w.t[0] = 0.5
    admitted, _ = await _burst(w.m, 6)
    assert len(admitted) == 3 and w.m.admission.last["predicted_rtf_live"] == pytest.approx(0.7)
    await w.m.stop()


async def test_a_burst_after_a_finished_busy_level_is_weighed_on_the_answers_that_level_carried():
    """Four sessions answered at once (0.5) and left; their streams are still in the
    window when a burst of 12 arrives. Each finished stream stands for the four answers
    that generated with it: 0.5 + 0.05 x (n - 4) stays under 0.8 up to 10 at once. (Taken
    for one answer, 0.5 + 0.05 x (n - 1) refused from the 8th on load that had left.)"""
    w = World(base=0.35, per=0.05, target_rtf=0.8, hysteresis=0.0, new_session_s=30.0)
    w.m.admission.calibrated("voice", {1: 0.2, 4: 0.35})  # 0.05 a session
    level, _ = await _burst(w.m, 4)
    assert w.speak(4) == pytest.approx(0.5)
    for s in level:
        await w.m.close(s.id)
    w.t[0] += 1.0  # nothing generating now; the level's streams are 1.5 s old
    assert sorted(k for _, k in w.meter.measured()) == [4, 4, 4, 4]
    admitted, refused = await _burst(w.m, 12)
    assert len(admitted) == 10 and len(refused) == 2 and refused[0].why == ["rtf"]
    assert w.m.admission.last["predicted_rtf_live"] == pytest.approx(0.85)
    await w.m.stop()


def test_a_streams_answers_at_once_are_the_most_that_generated_with_it_at_one_moment():
    t = [0.0]
    m = RtfMeter(10.0, clock=lambda: t[0])
    for key, (a, b) in enumerate([(0.0, 2.0), (1.0, 3.0), (2.5, 4.0), (5.0, 6.0)]):
        m.chunk(key, 0.1, a)
        m.chunk(key, 1.0, b)
    t[0] = 6.0
    # (0, 2) overlapped (1, 3); (1, 3) overlapped each of its neighbours but never both at
    # once; (5, 6) generated alone
    got = sorted(m.measured())  # 1 s of audio after the first chunk each
    assert [r for r, _ in got] == pytest.approx([1.0, 1.5, 2.0, 2.0]) and [k for _, k in got] == [1, 2, 2, 2]
    m.sample(9, 0.4, 6.0)  # a robot's call counts as one
    assert (0.4, 1) in m.measured()


async def test_min_sessions_are_always_admitted_and_disabled_admission_refuses_nothing():
    w = World(base=2.0, per=0.0, min_sessions=2)  # a server slower than real time even idle
    w.speak(1)
    await w.m.open("duplex")
    await w.m.open("duplex")
    # admitted, and the decision says the prediction would have refused it
    assert w.m.admission.last["admitting"] and w.m.admission.last["admitted_past_target"] == ["rtf"]
    assert w.m.decisions[-1]["admitted"] and w.m.decisions[-1]["load"]["admitted_past_target"] == ["rtf"]
    with pytest.raises(CapacityLimit):
        await w.m.open("duplex")
    await w.m.stop()
    off = World(base=2.0, per=0.0, enabled=False)
    off.speak(1)
    for _ in range(20):
        await off.m.open("duplex")
    await off.m.stop()


async def test_sessions_that_have_not_spoken_yet_are_charged_on_top_of_what_is_measured():
    """Sessions arriving faster than their load shows: the measured RTF reflects the
    established ones only, so each new one is charged the cost until it is
    `new_session_s` old."""
    w = World(base=0.25, per=0.15, target_rtf=0.8, hysteresis=0.0, new_session_s=5.0)
    w.m.admission.calibrated("voice", {1: 0.05, 4: 0.35})  # 0.1 a session
    for _ in range(3):
        await _open(w.m, "duplex", "voice")
    w.t[0] += 6.0
    assert w.speak() == pytest.approx(0.55)  # 3 established sessions measure 0.55
    admitted = 0
    with pytest.raises(CapacityLimit) as exc:
        while True:  # all at once, none has spoken yet: 0.55 + 0.1 x (new + 1)
            await _open(w.m, "duplex", "voice")
            admitted += 1
    assert admitted == 2 and exc.value.cap == 5  # 0.85 with the third: charging only the next one (0.65) would admit it
    assert w.m.admission.last["new_sessions"] == 2 and w.m.admission.last["predicted_rtf_live"] == pytest.approx(0.85)
    await w.m.stop()


async def test_concurrent_opens_on_a_slow_store_cannot_over_admit():
    """The store is awaited between the decision and the session's registration (Redis
    round trips): sessions being admitted count as new, so a burst arriving at once is
    weighed one after another, not all against the same empty server."""

    class SlowStore(MemoryStore):
        async def acquire(self, slot: Slot, limits: Limits, record: Mapping[str, Any] | None = None) -> None:
            await asyncio.sleep(0.05)
            await super().acquire(slot, limits, record)

    w = World(base=0.0, per=0.0, target_rtf=0.8, session_cost_rtf=0.2, store=SlowStore())
    results = await asyncio.gather(*(w.m.open("duplex", principal="p") for _ in range(8)), return_exceptions=True)
    assert sum(1 for r in results if not isinstance(r, BaseException)) == 4
    assert all(isinstance(r, CapacityLimit) for r in results if isinstance(r, BaseException))
    assert w.m.realtime_sessions() == 4
    await w.m.stop()


async def test_busy_cpus_refuse_nothing_by_default_and_the_cpu_bound_can_be_brought_back():
    """Generation fills idle cores by design: a server at 100 % CPU whose streams keep
    real time with room is not full. `max_cpu_utilisation` brings the old bound back
    for those who want it."""
    w = World(base=0.2, per=0.01, new_session_s=0)
    await w.m.open("duplex")
    for _ in range(6):
        w.cpu_s[0] += 2.0
        w.speak()
    await w.m.open("duplex")
    assert w.m.admission.last["cpu_own"] == pytest.approx(1.0)
    await w.m.stop()
    w = World(base=0.2, per=0.01, new_session_s=0, max_cpu_utilisation=0.85)
    await w.m.open("duplex")
    for _ in range(6):
        w.cpu_s[0] += 2 * 0.84
        w.speak()
    with pytest.raises(CapacityLimit) as exc:
        await w.m.open("duplex")
    assert exc.value.why == ["cpu"] and "CPUs 89% busy (at most 85%)" in str(exc.value)
    await w.m.stop()


async def test_cpu_taken_by_other_processes_stretches_the_cold_prediction_and_health_and_metrics_say_why():
    """A noisy neighbour on one of the two cores: the calibration ran on an idle machine,
    so with half the CPUs taken what it measured takes twice as long. 0.2 + 0.1 x 2 =
    0.4 fits alone; stretched by 1 / (1 - 0.5) it is 0.8 + ... over the target."""
    w = World(base=0.0, per=0.0, target_rtf=0.75, hysteresis=0.05)
    w.m.admission.calibrated("voice", {1: 0.2, 4: 0.5})
    await _open(w.m, "duplex", "voice")
    for _ in range(6):
        w.second(own=0.1)
    await _open(w.m, "duplex", "voice")  # 0.3 with 2: room
    for _ in range(6):  # a process burns one core: 50 % of the machine
        w.second(own=0.2, outside=0.5)
    with pytest.raises(CapacityLimit) as exc:
        await _open(w.m, "duplex", "voice")
    assert exc.value.why == ["outside_load"]
    assert "50% of its CPUs taken by other processes" in str(exc.value)
    assert exc.value.headers["retry-after"] == "5"
    h = w.m.health()["realtime_admission"]
    assert h["refusing"] and h["why"] == ["outside_load"] and h["predicted_rtf_cold"] == pytest.approx(0.8, abs=0.01)
    assert h["cpu_own"] == pytest.approx(0.2, abs=0.01) and h["cpu_outside"] == pytest.approx(0.5, abs=0.01)
    assert h["machine_busy"] == pytest.approx(0.7, abs=0.01)
    assert metrics.REGISTRY.get_sample_value("omni_rt_admission_refusing", {"why": "outside_load"}) == 1
    assert metrics.REGISTRY.get_sample_value("omni_rt_admission_cpu_busy_fraction", {"scope": "outside"}) == pytest.approx(0.5, abs=0.01)
    for _ in range(6):  # the burner stops: its share leaves the window
        w.second(own=0.2)
    await _open(w.m, "duplex", "voice")
    assert metrics.REGISTRY.get_sample_value("omni_rt_admission_refusing", {"why": "outside_load"}) == 0
    await w.m.stop()
    off = World(base=0.0, per=0.0, target_rtf=0.75, weigh_outside_load=False)
    off.m.admission.calibrated("voice", {1: 0.2, 4: 0.5})
    for _ in range(6):
        off.second(own=0.2, outside=0.7)
    admitted, _ = await _burst(off.m, 3)
    assert len(admitted) == 3 and "other processes" not in str(off.m.admission.last)
    await off.m.stop()


async def test_a_throttled_container_refuses_and_its_quota_is_the_capacity():
    """In a container with a 1-CPU quota on a 2-core machine, the quota binds: the
    cgroup's use over its quota is the busy figure, and throttling refuses outright."""
    w = World(base=0.2, per=0.001, new_session_s=0, max_throttled_fraction=0.05)
    used = [0.0]
    periods = [0, 0]

    def second(cg_cpus: float, throttled: int) -> None:
        used[0] += cg_cpus
        periods[0] += 10
        periods[1] += throttled
        w.cgroup[0] = CgroupCpu(1.0, used[0], periods[0], periods[1])
        w.second(own=cg_cpus / 2)

    await w.m.open("duplex")
    for _ in range(6):
        second(0.3, 0)
    await w.m.open("duplex")
    h = w.m.health()["realtime_admission"]
    assert h["capacity_cpus"] == 1.0 and h["cgroup_busy"] == pytest.approx(0.3, abs=0.01)
    assert h["cpu_outside"] == 0.0  # the server's own 30 % of the quota is no outside load
    for _ in range(6):
        second(0.3, 3)  # little use, but throttled in 30 % of periods
    with pytest.raises(CapacityLimit) as exc:
        await w.m.open("duplex")
    assert exc.value.why == ["throttled"] and "throttled in 30% of periods" in str(exc.value)
    await w.m.stop()


async def test_the_meters_are_sampled_off_the_event_loop_and_decisions_read_the_latest_sample():
    loop_thread = threading.get_ident()
    readers: list[int] = []

    def read() -> float:
        readers.append(threading.get_ident())
        return 1.0 * len(readers)

    meters = LoadMeters(cpu=CpuMeter(CPU_WINDOW_S, read=read, cpus=2), machine=MachineMeter(read_machine=lambda: (1.0, 2.0)))
    m = SessionManager(SessionsSpec(), meters=meters)
    await m.start()
    try:
        for _ in range(50):
            await asyncio.sleep(0.05)
            if meters.sampled >= 2:
                break
        assert meters.sampled >= 2 and readers and loop_thread not in readers
        n = len(readers)
        await m.open("duplex")
        m.health()
        assert len(readers) == n  # a decision and /health read no /proc
        assert meters.loop.ticks > 0  # the loop-lag probe runs beside it
    finally:
        await m.stop()


def test_placed_stages_processes_on_this_host_count_as_the_servers_own_cpu():
    import os

    meters = LoadMeters()
    mine = meters.server_cpu_seconds()
    meters.placed_cpu(999_999_999, 12.5)  # a Ray actor's process: no child of this one
    meters.placed_cpu(999_999_999, 10.0)  # an older report does not go back
    meters.placed_cpu(os.getpid(), 100.0)  # a process of the tree is counted once, as the tree
    assert 12.5 - 1e-6 <= meters.server_cpu_seconds() - mine < 13.5  # (CPU seconds are sums of floats)


def test_the_process_tree_is_listed_once_per_refresh_and_its_cpu_read_every_time():
    import subprocess
    import sys

    import psutil

    t = [0.0]
    tree = ProcessTree(psutil.Process(), refresh_s=5.0, clock=lambda: t[0])
    assert tree.processes()[0].pid == os.getpid()  # the root first (earlier tests may have left children)
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", burn])
    try:
        deadline = time.monotonic() + 20
        while psutil.Process(child.pid).cpu_times().user + psutil.Process(child.pid).cpu_times().system < 0.25:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        mine = tree.cpu_seconds()
        assert child.pid not in {p.pid for p in tree.processes()}  # listed before it started: not yet counted
        t[0] = 5.0
        assert child.pid in {p.pid for p in tree.processes()}
        assert tree.cpu_seconds() - mine >= 0.25  # the child's CPU time, read now
    finally:
        child.kill()
        child.wait()
    t[0] = 10.0
    assert child.pid not in {p.pid for p in tree.processes()}


def test_the_cgroup_cpu_controller_is_read_in_v2_and_v1_layouts(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    (v2 / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\nnr_periods 40\nnr_throttled 4\nthrottled_usec 9\n")
    assert read_cgroup_cpu(str(v2)) == CgroupCpu(1.5, 2.5, 40, 4)
    (v2 / "cpu.max").write_text("max 100000\n")
    assert read_cgroup_cpu(str(v2)).quota_cpus is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpuacct").mkdir()
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.stat").write_text("nr_periods 7\nnr_throttled 1\nthrottled_time 5\n")
    (v1 / "cpuacct" / "cpuacct.usage").write_text("3000000000\n")
    assert read_cgroup_cpu(str(v1)) == CgroupCpu(0.5, 3.0, 7, 1)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert read_cgroup_cpu(str(v1)).quota_cpus is None
    assert read_cgroup_cpu(str(tmp_path / "none")) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("")  # a file that cannot be parsed: no reading, no error out of the meter
    meter = MachineMeter(read_cgroup=lambda: read_cgroup_cpu(str(v1)))
    assert meter.load() is None


def test_the_machine_reading_counts_every_process_on_this_processes_cores():
    busy0, total0 = machine_cpu_seconds()
    x = 0
    for i in range(3_000_000):  # burn a little CPU in this process
        x += i
    busy1, total1 = machine_cpu_seconds()
    assert 0 <= busy0 <= total0 and busy1 > busy0 and total1 > total0
    assert busy1 - busy0 <= total1 - total0 + 1e-6
    only0 = machine_cpu_seconds({0})
    assert only0[1] < total1  # one core's times are a part of the whole


def test_the_cpu_meter_reads_the_busy_fraction_over_its_window():
    t, used = [0.0], [0.0]
    m = CpuMeter(5.0, clock=lambda: t[0], read=lambda: used[0], cpus=2)
    assert m.utilisation() is None  # one reading
    t[0], used[0] = 2.0, 2.0
    assert m.utilisation() == pytest.approx(0.5)  # 2 CPU-s in 2 s of 2 CPUs
    t[0], used[0] = 10.0, 2.0  # idle since: the old readings leave the window
    assert m.utilisation() == pytest.approx(0.0)
    t[0], used[0] = 10.5, 1.0  # a child exited and took its CPU time along: start over
    assert m.utilisation() is None


def test_the_meter_measures_rtf_after_the_first_chunk_and_forgets_old_streams():
    t = [0.0]
    meter = RtfMeter(window_s=5.0, clock=lambda: t[0])
    k = meter.new_stream()
    meter.chunk(k, 0.085, 0.3)  # the first chunk waited for its lookahead: not counted
    assert meter.worst() is None
    meter.chunk(k, 1.0, 0.8)
    meter.chunk(k, 1.0, 1.3)
    assert meter.worst() == pytest.approx(0.5)
    t[0] = 7.0
    assert meter.worst() is None  # nothing emitted in the last 5 s


def test_a_robot_reports_its_calls_and_the_worst_of_the_window_counts():
    t = [0.0]
    meter = RtfMeter(window_s=10.0, clock=lambda: t[0])
    key = meter.new_stream()
    for r in (0.2, 0.6, 0.3):
        meter.sample(key, r)
        t[0] += 1.0
    assert meter.worst() == pytest.approx(0.6)
    t[0] = 11.5  # the 0.2 and 0.6 calls left the window
    assert meter.worst() == pytest.approx(0.3)
    t[0] = 30.0
    assert meter.worst() is None


async def test_robots_are_weighed_only_when_they_declare_a_control_rate():
    w = World(base=0.2, per=0.4, target_rtf=0.8, new_session_s=0, session_cost_rtf=0.4)
    assert w.m.admission.applies("robot", 15.0) and not w.m.admission.applies("robot")
    undeclared = [await w.m.open("robot", principal="p") for _ in range(5)]
    assert w.m.realtime_sessions() == 0 and all(not s.weighed for s in undeclared)
    admitted = []
    with pytest.raises(CapacityLimit):
        for _ in range(10):
            admitted.append(await w.m.open("robot", principal="p", control_hz=30.0))
            n = w.m.realtime_sessions()
            for _ in range(n):  # every declared robot's calls take base + per × (n - 1) of its budget
                w.meter.sample(w.meter.new_stream(), w.rtf(n))
            w.t[0] += 1.0
    assert len(admitted) == 2 and w.rtf(2) <= 0.8 < w.rtf(3)  # the third would have pushed every robot late


@pytest.mark.integration
async def test_a_real_cpu_burner_beside_the_server_refuses_new_voice_sessions_until_it_stops(tmp_path):
    """The real meters on this machine: an in-process server, then a process that is
    not the server's (an orphan, so not in its process tree) spins one core. The next
    voice session is refused on the wire with `capacity` naming the outside load; once
    the burner has stopped for a window, sessions are admitted again."""
    import asyncio
    import subprocess
    import sys
    import time

    from testkit import serve
    from testkit.wire import connect

    # nothing calibrated here (fake stages): a session costs the prior, 0.25; two fit under
    # the default 0.65 (and under 0.6 once refusing) on an idle machine, not with half its
    # CPUs taken (0.5 / (1 - 0.5))
    overlay = {"sessions": {"realtime_admission": {"session_cost_rtf": 0.25, "weigh_outside_load": True, "hysteresis": 0.05}}}
    pidfile = tmp_path / "burner.pid"
    async with serve(["voice"], overlay) as h:
        first = await connect(h, "/v1/realtime?model=gpt-realtime")
        await first.until("session.created")  # the first session is always admitted; the meters take a reading
        subprocess.run(  # the shell exits at once: the burner is reparented, outside this process tree
            ["sh", "-c", f"{sys.executable} -c 'import time\nt=time.monotonic()\nwhile time.monotonic()-t<8: pass' & echo $! > {pidfile}"],
            check=True,
        )
        try:
            await asyncio.sleep(4.5)  # most of the CPU window (5 s)
            extra = await connect(h, "/v1/realtime?model=gpt-realtime")
            ev = await extra.until("error")
            assert ev["error"]["code"] == "capacity" and "outside_load" in ev["error"]["message"]
            assert "taken by other processes" in ev["error"]["message"]
            await extra.until("connection.closed")
            assert extra.closed is not None and extra.closed[0] == 1013
            adm = h.sessions.health()["realtime_admission"]
            assert adm["why"] == ["outside_load"] and adm["cpu_outside"] >= 0.3, adm
        finally:
            pid = int(pidfile.read_text())
            subprocess.run(["kill", str(pid)], check=False)
        t = time.monotonic()
        while time.monotonic() - t < 6.5:  # a quiet window
            await asyncio.sleep(0.5)
        again = await connect(h, "/v1/realtime?model=gpt-realtime")
        await again.until("session.created")
        assert h.sessions.health()["realtime_admission"]["refusing"] is False
        await again.ws.close()
        await first.ws.close()


def test_the_machine_is_read_on_the_servers_cores_after_its_threads_were_moved():
    """On CPU the vLLM engine moves the front end's threads off its Workers' cores; the
    machine's load is still read on every core the server started with (the Workers'
    included), not on the one the reading thread is left on."""
    import os

    from omni_rt.load import SERVER_CORES

    assert SERVER_CORES
    one = {min(SERVER_CORES)}
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, one)
    try:
        _, total = machine_cpu_seconds()
        _, total_one = machine_cpu_seconds(one)
    finally:
        os.sched_setaffinity(0, before)
    assert total > total_one * (len(SERVER_CORES) - 0.5)


async def test_a_hole_heard_in_a_paced_answer_refuses_new_sessions_until_it_leaves_the_window():
    """What the sessions hear decides too: a paced answer's client ran dry for 150 ms
    (the server's: late generation or a late writer); the next session is refused naming
    late_audio, health and the gauges say so; a hole under the bound does not; once it
    leaves the window, admitted."""
    from omni_rt import metrics

    w = World(base=0.1, per=0.01, target_rtf=0.8, new_session_s=0)
    await w.m.open("duplex", principal="p")
    w.speak()
    w.holes.hole(0.05, w.t[0])  # under max_hole_ms (100)
    await w.m.open("duplex", principal="p")
    w.holes.hole(0.15, w.t[0])
    with pytest.raises(CapacityLimit) as err:
        await w.m.open("duplex", principal="p")
    assert err.value.why == ["late_audio"] and "went silent for 150 ms" in err.value.message
    adm = w.m.health()["realtime_admission"]
    assert adm["why"] == ["late_audio"] and adm["worst_hole_ms"] == 150.0
    assert metrics.ADMISSION_REFUSING.labels("late_audio")._value.get() == 1
    for _ in range(5):
        w.speak()
    await w.m.open("duplex", principal="p")
    assert w.m.health()["realtime_admission"]["refusing"] is False


def test_omni_rt_check_says_what_admission_will_weigh_with():
    from omni_rt.specs import parse_overlay
    from omni_server.cli import admission_notes

    ov = parse_overlay({"sessions": {"realtime_admission": {"pipeline_costs": {"voice": {"base_rtf": 0.3, "per_session_rtf": 0.1}}}}}, "d.yaml")
    notes = admission_notes(ov)
    assert "pipeline voice costs 0.300 RTF alone, +0.100 a session at once (stated in the deploy): a burst of up to 4" in notes[0]
    assert "calibrated when the server starts" in notes[1]
    off = parse_overlay({"sessions": {"realtime_admission": {"calibrate": False}}}, "d.yaml")
    assert "weighed at the prior 0.050" in admission_notes(off)[0]
    with pytest.raises(Exception, match="base_rtf"):
        parse_overlay({"sessions": {"realtime_admission": {"pipeline_costs": {"voice": {"per_session_rtf": 0.1}}}}}, "d.yaml")
