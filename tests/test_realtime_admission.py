"""Load-aware admission of real-time sessions, on a synthetic per-session cost.

The meter is fed streams whose generation RTF is what a server with a fixed cost and
a per-session cost would measure (`base + per × sessions`), on a virtual clock; the
session manager then decides each new voice session from those measurements.
"""

from __future__ import annotations

import pytest

from omni_rt import metrics
from omni_rt.load import CgroupCpu, CpuMeter, HoleMeter, MachineMeter, RtfMeter, machine_cpu_seconds, read_cgroup_cpu
from omni_rt.specs import RealtimeAdmissionSpec, SessionsSpec
from sessions import SessionManager
from sessions.admission import CPU_WINDOW_S
from sessions.errors import CapacityLimit, SessionLimit


class World:
    def __init__(self, base: float, per: float, **spec) -> None:
        self.t = [0.0]
        self.base, self.per = base, per
        self.meter = RtfMeter(window_s=10.0, clock=lambda: self.t[0])
        self.m = SessionManager(SessionsSpec(realtime_admission=RealtimeAdmissionSpec(**spec)), clock=lambda: self.t[0])
        self.m.admission.meter = self.meter
        self.cpu_s = [0.0]  # CPU seconds the fake server tree has used
        self.m.admission.cpu = CpuMeter(CPU_WINDOW_S, clock=lambda: self.t[0], read=lambda: self.cpu_s[0], cpus=2)
        # the whole machine (2 CPUs): the server's CPU seconds plus what other processes
        # used (`outside_s`); the container's cgroup, when a test gives it one
        self.outside_s = [0.0]
        self.cgroup: list[CgroupCpu | None] = [None]
        self.m.admission.machine = MachineMeter(
            CPU_WINDOW_S, clock=lambda: self.t[0], read_machine=lambda: (self.cpu_s[0] + self.outside_s[0], 2 * self.t[0]),
            read_cgroup=lambda: self.cgroup[0], cpus=2,
        )
        self.holes = HoleMeter(window_s=10.0, clock=lambda: self.t[0])  # holes the sessions' clients heard
        self.m.admission.holes = self.holes

    def rtf(self, sessions: int) -> float:
        return self.base + self.per * sessions

    def speak(self) -> float:
        """Every admitted session answers once at the RTF its count gives; one sample."""
        n = self.m.realtime_sessions()
        r = self.rtf(n)
        for _ in range(n):
            key = self.meter.new_stream()
            self.meter.chunk(key, 0.1, self.t[0])  # the first chunk
            self.meter.chunk(key, 1.0, self.t[0] + r)  # 1 s of audio generated in r seconds
        self.t[0] += 1.0
        self.m.admission.observe(n)
        return r


async def test_the_session_that_would_break_real_time_is_refused_with_retry_after_and_admission_reopens():
    w = World(base=0.2, per=0.05, target_rtf=0.8, hysteresis=0.1, retry_after_s=7, new_session_s=0)
    admitted = []
    refused = None
    for _ in range(40):
        try:
            admitted.append(await w.m.open("duplex", principal="p"))
        except CapacityLimit as exc:
            refused = exc
            break
        w.speak()
    assert refused is not None, "every session was admitted"
    n = len(admitted)
    # the measured slope is the synthetic per-session cost: 0.2 + 0.05 × 12 = 0.8 ≤ 0.8
    assert n == 12
    assert w.rtf(n) < 1.0 and w.rtf(n) <= 0.8  # every admitted session generates faster than real time
    assert w.m.admission.last["cost_from"] == "measured"
    assert w.m.admission.last["session_cost_rtf"] == pytest.approx(0.05, abs=1e-6)
    assert isinstance(refused, SessionLimit) and refused.code == "capacity" and refused.http_status == 429
    assert refused.headers["retry-after"] == "7"
    assert "real-time capacity" in str(refused)
    assert w.m.stats["rejected"] == 1
    # one session ends: once the streams of the busier seconds leave the window,
    # 0.75 + 0.05 would fit under 0.8, but not under 0.8 - 0.1 (hysteresis)
    await w.m.close(admitted.pop().id)
    w.t[0] += 11.0
    w.speak()
    with pytest.raises(CapacityLimit):
        await w.m.open("duplex", principal="p")
    # two more end: 0.55 + 0.05 = 0.6 <= 0.7, admission reopens
    for _ in range(2):
        await w.m.close(admitted.pop().id)
    w.t[0] += 11.0
    w.speak()
    again = await w.m.open("webrtc", principal="p")
    assert w.m.admission.refusing is False and again.kind == "webrtc"
    await w.m.stop()


async def test_before_anything_is_measured_the_prior_cost_bounds_voice_sessions_and_other_kinds_are_not_weighed():
    w = World(base=0.0, per=0.0, session_cost_rtf=0.1, target_rtf=0.8)
    for _ in range(8):
        await w.m.open("realtime")  # the 8th: 8 × 0.1 = 0.8 fits
    with pytest.raises(CapacityLimit) as exc:
        await w.m.open("realtime")  # 9 × 0.1 would not
    assert w.m.admission.last["cost_from"] == "prior"
    assert exc.value.cap == 8 and w.m.realtime_sessions() == 8
    for _ in range(5):
        await w.m.open("oneshot")  # not a real-time kind: the caps alone decide
        await w.m.open("robot")
    await w.m.stop()


async def test_min_sessions_are_always_admitted_and_disabled_admission_refuses_nothing():
    w = World(base=2.0, per=0.0, min_sessions=2)  # a server slower than real time even idle
    key = w.meter.new_stream()
    w.meter.chunk(key, 0.1, 0.0)
    w.meter.chunk(key, 1.0, 2.0)
    await w.m.open("duplex")
    await w.m.open("duplex")
    with pytest.raises(CapacityLimit):
        await w.m.open("duplex")
    await w.m.stop()
    off = World(base=2.0, per=0.0, enabled=False)
    key = off.meter.new_stream()
    off.meter.chunk(key, 0.1, 0.0)
    off.meter.chunk(key, 1.0, 2.0)
    for _ in range(20):
        await off.m.open("duplex")
    await off.m.stop()


async def test_sessions_that_have_not_spoken_yet_are_charged_on_top_of_what_is_measured():
    """Sessions arriving faster than their load shows: the measured RTF reflects the
    established ones only, so each new one is charged the cost until it is
    `new_session_s` old."""
    w = World(base=0.2, per=0.05, target_rtf=0.8, hysteresis=0.0, new_session_s=5.0, session_cost_rtf=0.1)
    for _ in range(3):
        await w.m.open("duplex")
    w.t[0] += 6.0
    assert w.speak() == pytest.approx(0.35)  # 3 established sessions; one session count seen: the prior cost
    admitted = 0
    with pytest.raises(CapacityLimit) as exc:
        while True:  # all at once, none has spoken yet: 0.35 + 0.1 × (new + 1) <= 0.8
            await w.m.open("duplex")
            admitted += 1
    assert admitted == 4 and exc.value.cap == 7  # charging only the next one (0.35 + 0.1) would never refuse
    assert w.m.admission.last == {**w.m.admission.last, "new_sessions": 4, "cost_from": "prior"}
    w.t[0] += 6.0  # established now, and they speak: 0.2 + 0.05 × 7 = 0.55 measured, the slope fitted
    w.speak()
    await w.m.open("duplex")  # 0.55 + 0.05 <= 0.8
    assert w.m.admission.last["cost_from"] == "measured" and w.m.admission.last["session_cost_rtf"] == pytest.approx(0.05)
    await w.m.stop()


async def test_the_cpu_guard_refuses_before_the_cores_saturate_even_when_the_rtf_looks_fine():
    """Generation speed holds until the cores are saturated, then falls off a cliff:
    a fit of the RTF alone would admit past it. Each session here costs 10 % of two
    CPUs and barely moves the RTF; the guard stops at 85 % busy."""
    w = World(base=0.2, per=0.001, new_session_s=0, max_cpu_utilisation=0.85, hysteresis=0.05)
    n_ok = 0
    with pytest.raises(CapacityLimit) as exc:
        for _ in range(40):
            await w.m.open("duplex")
            n_ok += 1
            n = w.m.realtime_sessions()
            for _ in range(11):  # a window's worth at 10 % of 2 CPUs per session
                w.cpu_s[0] += 0.1 * n * 2
                w.speak()
    assert n_ok == 8  # 8 × 10 % = 80 % busy, and a 9th would make 90 %
    assert w.m.admission.last["predicted_cpu"] == pytest.approx(0.9, abs=0.02)
    assert w.m.admission.last["predicted_rtf"] < 0.8  # the RTF alone would have admitted it
    assert "CPUs 90% busy (at most 85%)" in str(exc.value)
    await w.m.stop()


async def test_a_lull_between_turns_is_not_room_for_more_sessions():
    """The CPU busy fraction is the mean of the last CPU_WINDOW_S: sessions that are
    quiet for a few seconds between turns still hold their share."""
    w = World(base=0.2, per=0.001, new_session_s=0, max_cpu_utilisation=0.85, session_cost_cpu=0.05)
    await w.m.open("duplex")
    for _ in range(8):  # 100 % busy
        w.cpu_s[0] += 1.0 * 2
        w.speak()
    for _ in range(2):  # then a lull: 20 % busy for two seconds
        w.cpu_s[0] += 0.2 * 2
        w.speak()
    with pytest.raises(CapacityLimit):
        await w.m.open("duplex")  # (8 × 1.0 + 2 × 0.2) / 10 = 84 %, + 5 %: over 85 % (the lull alone: 25 %)
    for _ in range(10):  # a whole window of the lull
        w.cpu_s[0] += 0.2 * 2
        w.speak()
    await w.m.open("duplex")
    await w.m.stop()


async def test_cpu_taken_by_other_processes_refuses_new_sessions_and_health_and_metrics_say_why():
    """A noisy neighbour on one of the two cores: the server's own share is small and
    its RTF looks fine, but the cores are not free. New sessions are refused (the
    reason named in the error, /health and the metrics) until the burner stops."""
    w = World(base=0.2, per=0.001, new_session_s=0, max_cpu_utilisation=0.7, hysteresis=0.05)
    await w.m.open("duplex")

    def second(own: float, outside: float) -> None:
        w.cpu_s[0] += own * 2
        w.outside_s[0] += outside * 2
        w.speak()

    for _ in range(11):
        second(0.1, 0.0)
    await w.m.open("duplex")  # 10 % own, nothing else: room
    for _ in range(11):  # a process burns one core: 50 % of the machine
        second(0.2, 0.5)
    with pytest.raises(CapacityLimit) as exc:
        await w.m.open("duplex")
    assert exc.value.why == ["outside_load"]
    assert "50% of them taken by other processes" in str(exc.value)
    assert exc.value.headers["retry-after"] == "5"
    h = w.m.health()["realtime_admission"]
    assert h["refusing"] and h["why"] == ["outside_load"]
    assert h["cpu_own"] == pytest.approx(0.2, abs=0.01) and h["cpu_outside"] == pytest.approx(0.5, abs=0.01)
    assert h["machine_busy"] == pytest.approx(0.7, abs=0.01)
    assert metrics.REGISTRY.get_sample_value("omni_rt_admission_refusing", {"why": "outside_load"}) == 1
    assert metrics.REGISTRY.get_sample_value("omni_rt_admission_cpu_busy_fraction", {"scope": "outside"}) == pytest.approx(0.5, abs=0.01)
    for _ in range(11):  # the burner stops
        second(0.2, 0.0)
    await w.m.open("duplex")
    assert metrics.REGISTRY.get_sample_value("omni_rt_admission_refusing", {"why": "outside_load"}) == 0
    await w.m.stop()


async def test_outside_load_is_ignored_when_told_and_the_servers_own_load_is_named_cpu():
    w = World(base=0.2, per=0.001, new_session_s=0, max_cpu_utilisation=0.7, weigh_outside_load=False)
    await w.m.open("duplex")
    for _ in range(11):
        w.cpu_s[0] += 0.2 * 2
        w.outside_s[0] += 0.7 * 2
        w.speak()
    await w.m.open("duplex")  # 20 % own: the outside 70 % is not weighed
    for _ in range(11):
        w.cpu_s[0] += 0.8 * 2
        w.speak()
    with pytest.raises(CapacityLimit) as exc:
        await w.m.open("duplex")
    assert exc.value.why == ["cpu"] and "other processes" not in str(exc.value)
    await w.m.stop()


async def test_a_throttled_container_or_a_full_cpu_quota_refuses():
    """In a container with a 1-CPU quota on a 2-core machine, the quota binds: the
    cgroup's use over its quota is the busy figure, and throttling refuses outright."""
    w = World(base=0.2, per=0.001, new_session_s=0, max_cpu_utilisation=0.7, max_throttled_fraction=0.05)
    used = [0.0]
    periods = [0, 0]

    def second(cg_cpus: float, throttled: int) -> None:
        used[0] += cg_cpus
        periods[0] += 10
        periods[1] += throttled
        w.cpu_s[0] += cg_cpus
        w.cgroup[0] = CgroupCpu(1.0, used[0], periods[0], periods[1])
        w.speak()

    await w.m.open("duplex")
    for _ in range(11):
        second(0.3, 0)
    await w.m.open("duplex")  # 30 % of the quota
    for _ in range(11):
        second(0.8, 0)  # 40 % of two cores, but 80 % of the one-CPU quota
    with pytest.raises(CapacityLimit) as exc:
        await w.m.open("duplex")
    assert exc.value.why == ["cpu"]
    assert w.m.health()["realtime_admission"]["capacity_cpus"] == 1.0
    assert w.m.health()["realtime_admission"]["cgroup_busy"] == pytest.approx(0.8, abs=0.01)
    for _ in range(11):
        second(0.3, 3)  # little use, but throttled in 30 % of periods
    with pytest.raises(CapacityLimit) as exc:
        await w.m.open("duplex")
    assert exc.value.why == ["throttled"] and "throttled in 30% of periods" in str(exc.value)
    await w.m.stop()


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
    t[0], used[0] = 10.1, 3.0  # asked again at once: the last answer, nothing is read
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
    w = World(base=0.1, per=0.3, target_rtf=0.8, new_session_s=0)
    assert w.m.admission.applies("robot", 15.0) and not w.m.admission.applies("robot")
    undeclared = [await w.m.open("robot", principal="p") for _ in range(5)]
    assert w.m.realtime_sessions() == 0 and all(not s.weighed for s in undeclared)
    admitted = []
    with pytest.raises(CapacityLimit):
        for _ in range(10):
            admitted.append(await w.m.open("robot", principal="p", control_hz=30.0))
            n = w.m.realtime_sessions()
            for _ in range(n):  # every declared robot's calls take base + per × n of its budget
                w.meter.sample(w.meter.new_stream(), w.rtf(n))
            w.t[0] += 1.0
            w.m.admission.observe(n)
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
    from tests.protocols.helpers import connect

    overlay = {"sessions": {"realtime_admission": {"max_cpu_utilisation": 0.4, "weigh_outside_load": True, "hysteresis": 0.05}}}
    pidfile = tmp_path / "burner.pid"
    async with serve(["voice"], overlay) as h:
        first = await connect(h, "/v1/realtime?model=gpt-realtime")
        await first.until("session.created")  # the first session is always admitted; the meters take a reading
        subprocess.run(  # the shell exits at once: the burner is reparented, outside this process tree
            ["sh", "-c", f"{sys.executable} -c 'import time\nt=time.monotonic()\nwhile time.monotonic()-t<8: pass' & echo $! > {pidfile}"],
            check=True,
        )
        try:
            await asyncio.sleep(3.0)
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
        while time.monotonic() - t < 11.0:  # a quiet window
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
    (whatever the cause); the next session is refused naming late_audio, health and
    the gauges say so; a hole under the bound does not; ten seconds on, admitted."""
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
    for _ in range(11):
        w.speak()
    await w.m.open("duplex", principal="p")
    assert w.m.health()["realtime_admission"]["refusing"] is False
