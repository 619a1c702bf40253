"""How loaded the serving path is: how fast it generates audio, as the streams
themselves see it, and how busy the machine's CPUs are with this server.

Every meter belongs to one server: `LoadMeters` holds them, the orchestrator owns one
(`Orchestrator.meters`), its stages write to it through their context (`ctx.meter`; a
stage placed in another process or a Ray actor sends its reports back with its
outputs, `omni_rt.placement`), the wires through the session manager, and admission
reads it. Two servers in one process keep apart.

Each streaming audio decoder (`pipelines.streaming.StreamingDecoder`) reports every chunk it
emits to the generation meter, an `RtfMeter`. A stream's generation real-time
factor is the wall time between its first and its latest chunk over the audio emitted
after the first chunk (the first chunk waits for its lookahead frames and would count
that wait twice): 0.5 means the stream is generated twice as fast as it plays, above
1 its listener hears holes. The meter keeps the streams that emitted within the last
`window_s`, and `worst()` is what load-aware admission reads: the slowest of them.

A robot reports each call instead (`sample`): the time its actions took to come back
over the time its previous chunk of actions lasts at its declared control rate, a
real-time factor of the same meaning (above 1 the robot runs out of actions before the
next chunk arrives); the worst of its calls in the window counts.

`CpuMeter` is the other half: the CPU time of this process and every process it
started (vLLM's engine cores and workers included) over the last `window_s`, as a
fraction of the CPUs this process may run on. Generation speed degrades gently until
the cores are saturated and then falls off a cliff (every stage waits for a core), so
admission also keeps this under a bound rather than trusting a straight-line fit of
the RTF up to the cliff.

The playout meter, a `HoleMeter`, is what the sessions hear: every paced writer reports
each hole in an answer the server caused (its client, playing the audio as it came, ran
dry because the audio was generated late or the writer itself ran late). A hole its own
client caused by not reading is that session's problem, not the server's: it is not
reported here (`protocols.duplex.writer`), and admission refuses while a hole over its
bound was heard within the window.

`LoopLag` measures how late the server's event loop wakes up (the loop paces every
answer's frames): a task that sleeps 20 ms at a time and records how much longer it
took. CPU and cgroup readings scan `/proc` and `/sys`: `LoadMeters.run` samples them
in a thread every `SAMPLE_S`, and decisions read the latest sample.

`MachineMeter` sees what the server's own figure cannot: CPU taken by anything else on
the CPUs it may run on (the whole machine's busy time on those cores, from psutil's
per-CPU times, so a noisy neighbour or a build on the same box counts) and, inside a
container, the cgroup's CPU quota (cgroup v2 `cpu.max` / v1 `cpu.cfs_quota_us`) with how
often the cgroup was throttled over the window (`cpu.stat`). Admission adds the
outside share to its prediction, and refuses while the cgroup is being throttled.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "SAMPLE_S", "CgroupCpu", "LoadMeters", "LoopLag", "StreamMeter", "HoleMeter", "CpuMeter", "MachineLoad", "MachineMeter", "RtfMeter", "StreamRtf", "machine_cpu_seconds",
    "read_cgroup_cpu", "tree_cpu_seconds", "ProcessTree",
]


class StreamMeter(Protocol):
    """Where a stream reports its generation speed: a server's `RtfMeter`, or a placed
    stage's recorder that sends the reports back (`omni_rt.placement`)."""

    def new_stream(self) -> int: ...

    def chunk(self, key: int, audio_s: float, now: float | None = None) -> None: ...

    def sample(self, key: int, rtf: float, now: float | None = None) -> None: ...


@dataclass
class StreamRtf:
    first_t: float
    last_t: float
    first_audio_s: float
    audio_s: float

    @property
    def rtf(self) -> float | None:
        after_first = self.audio_s - self.first_audio_s
        if after_first <= 0:
            return None
        return (self.last_t - self.first_t) / after_first


# A stream that reported this recently is taken as still generating (a decoder reports
# every chunk, a fraction of a second of audio apart).
IN_FLIGHT_S = 1.0


class RtfMeter:
    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._streams: dict[int, StreamRtf] = {}
        self._samples: dict[int, deque[tuple[float, float]]] = {}  # streams that report their RTF directly
        self._keys = itertools.count()
        self._lock = threading.Lock()

    def new_stream(self) -> int:
        return next(self._keys)

    def chunk(self, key: int, audio_s: float, now: float | None = None) -> None:
        t = self.clock() if now is None else now
        with self._lock:
            s = self._streams.get(key)
            if s is None:
                self._streams[key] = StreamRtf(t, t, audio_s, audio_s)
            else:
                s.last_t = t
                s.audio_s += audio_s
            self._expire(t)

    def sample(self, key: int, rtf: float, now: float | None = None) -> None:
        """A stream that measures its own real-time factor (a robot's call)."""
        t = self.clock() if now is None else now
        with self._lock:
            self._samples.setdefault(key, deque()).append((t, rtf))
            self._expire(t)

    def _expire(self, now: float) -> None:
        old = [k for k, s in self._streams.items() if now - s.last_t > self.window_s]
        for k in old:
            del self._streams[k]
        for k, q in list(self._samples.items()):
            while q and now - q[0][0] > self.window_s:
                q.popleft()
            if not q:
                del self._samples[k]

    def rtfs(self, now: float | None = None) -> list[float]:
        """The RTF of every stream that emitted within the window (and has one); for a
        stream that samples its own, the worst sample of the window."""
        with self._lock:
            self._expire(self.clock() if now is None else now)
            return [r for s in self._streams.values() if (r := s.rtf) is not None] + [max(r for _, r in q) for q in self._samples.values()]

    def measured(self, now: float | None = None) -> list[tuple[float, int]]:
        """(RTF, answers generating at once) for every stream of the window that has an
        RTF: the most streams that generated at the same moment while it did, itself
        counted (a finished level's worst RTF was measured with that many answers, and
        stands for them). A stream that samples its own RTF counts as one."""
        with self._lock:
            self._expire(self.clock() if now is None else now)
            spans = [(s.first_t, s.last_t) for s in self._streams.values()]
            out = [(r, _most_at_once(s.first_t, s.last_t, spans)) for s in self._streams.values() if (r := s.rtf) is not None]
            return out + [(max(r for _, r in q), 1) for q in self._samples.values()]

    def in_flight(self, within_s: float = IN_FLIGHT_S, now: float | None = None) -> bool:
        """Whether a stream reported within `within_s`: one still generating (a stream
        that ended stays in the window, but stopped reporting)."""
        t = self.clock() if now is None else now
        with self._lock:
            return any(t - s.last_t <= within_s for s in self._streams.values()) or any(
                q and t - q[-1][0] <= within_s for q in self._samples.values())

    def worst(self, now: float | None = None) -> float | None:
        r = self.rtfs(now)
        return max(r) if r else None

    def clear(self) -> None:
        with self._lock:
            self._streams.clear()
            self._samples.clear()


def _most_at_once(start: float, end: float, spans: list[tuple[float, float]]) -> int:
    """The most of `spans` (the span itself among them) open at one moment in [start, end]."""
    edges = sorted(e for a, b in spans if a <= end and b >= start for e in ((max(a, start), 0), (min(b, end), 1)))
    most = depth = 0
    for _, closing in edges:  # at a tie, openings come first: spans that touch overlap
        depth += -1 if closing else 1
        most = max(most, depth)
    return max(most, 1)


class HoleMeter:
    """Holes heard in paced answers over the last `window_s`: how long a client playing
    the audio as it arrived waited for more (the paced writers report each one). What
    the sessions actually hear, whatever its cause (slow generation, a starved server
    process, a neighbour on the machine)."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._holes: deque[tuple[float, float]] = deque()  # (when, seconds)
        self._lock = threading.Lock()

    def hole(self, seconds: float, now: float | None = None) -> None:
        with self._lock:
            self._holes.append((self.clock() if now is None else now, seconds))

    def worst(self, now: float | None = None) -> float | None:
        """The longest hole of the window (None: none)."""
        t = self.clock() if now is None else now
        with self._lock:
            while self._holes and t - self._holes[0][0] > self.window_s:
                self._holes.popleft()
            return max((s for _, s in self._holes), default=None)

    def clear(self) -> None:
        with self._lock:
            self._holes.clear()



def tree_cpu_seconds(root: Any = None) -> float:
    """User + system CPU seconds of a process (a `psutil.Process`; default this one)
    and its live descendants."""
    return ProcessTree(root).cpu_seconds()


class ProcessTree:
    """A process and its descendants, whose CPU seconds are read every sample. Listing
    the descendants scans every process of the machine (`/proc/*/stat`), so the list is
    kept for `refresh_s`: a child started since is counted from the next listing, one
    that exited drops out (its time with it: `CpuMeter` takes the drop as a new start)."""

    def __init__(self, root: Any = None, refresh_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        import psutil

        self.root = root if root is not None else psutil.Process()
        self.refresh_s = refresh_s
        self.clock = clock
        self._procs: list[Any] = []
        self._listed_at: float | None = None

    def processes(self) -> list[Any]:
        import psutil

        now = self.clock()
        if self._listed_at is None or now - self._listed_at >= self.refresh_s:
            try:
                self._procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                self._procs = [self.root]
            self._listed_at = now
        return self._procs

    def cpu_seconds(self) -> float:
        import psutil

        total = 0.0
        for p in self.processes():
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                continue
        return total


def _startup_cores() -> frozenset[int] | None:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


# The cores this server may run on, read when it starts: on CPU the vLLM engine moves
# the front end's threads off its Workers' cores (omni_rt.engines.vllm), so the process's
# affinity later names only some of the cores the server's processes use.
SERVER_CORES = _startup_cores()


def usable_cpus() -> int:
    return len(SERVER_CORES) if SERVER_CORES else (os.cpu_count() or 1)


class CpuMeter:
    """Busy fraction of this server's CPUs over the last `window_s` (None until two
    readings at least a second apart). A process that exits takes its CPU time with it:
    a reading that goes back is taken as a new start."""

    def __init__(
        self,
        window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        read: Callable[[], float] = tree_cpu_seconds,
        cpus: int | None = None,
    ) -> None:
        self.window_s = window_s
        self.clock = clock
        self.read = read
        self.cpus = cpus or usable_cpus()
        self._readings: deque[tuple[float, float]] = deque()

    def utilisation(self) -> float | None:
        """Read the CPU time now (blocking: it scans /proc) and give the busy fraction
        since the oldest reading of the window."""
        t = self.clock()
        cpu = self.read()
        if self._readings and cpu < self._readings[-1][1]:
            self._readings.clear()
        self._readings.append((t, cpu))
        while len(self._readings) > 2 and t - self._readings[1][0] >= self.window_s:
            self._readings.popleft()
        t0, c0 = self._readings[0]
        if t - t0 < 1.0:
            return None
        return (cpu - c0) / (t - t0) / self.cpus


CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class CgroupCpu:
    """One reading of the cgroup's CPU controller: its quota in CPUs (None: unlimited),
    the CPU seconds it used, and its enforcement periods (all / throttled)."""

    quota_cpus: float | None
    usage_s: float | None
    periods: int
    throttled: int


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _stat(text: str | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        k, _, v = line.partition(" ")
        if v.strip().lstrip("-").isdigit():
            out[k] = int(v)
    return out


def read_cgroup_cpu(root: str = CGROUP_ROOT) -> CgroupCpu | None:
    """The CPU controller of the cgroup this process is in as the container sees it
    (cgroup v2 at `root`, else v1 at `root/cpu`); None when neither is readable."""
    v2 = _read(f"{root}/cpu.max")
    if v2 is not None:
        quota, *period = v2.split()
        q = None if quota == "max" or not period else int(quota) / int(period[0])
        st = _stat(_read(f"{root}/cpu.stat"))
        usage = st.get("usage_usec")
        return CgroupCpu(q, None if usage is None else usage / 1e6, st.get("nr_periods", 0), st.get("nr_throttled", 0))
    quota_us = _read(f"{root}/cpu/cpu.cfs_quota_us")
    if quota_us is None:
        return None
    period_us = _read(f"{root}/cpu/cpu.cfs_period_us")
    q1 = int(quota_us)
    quota_cpus = q1 / int(period_us) if q1 > 0 and period_us else None
    st = _stat(_read(f"{root}/cpu/cpu.stat"))
    usage_ns = _read(f"{root}/cpuacct/cpuacct.usage") or _read(f"{root}/cpu/cpuacct.usage")
    usage_s = int(usage_ns) / 1e9 if usage_ns and usage_ns.strip().isdigit() else None
    return CgroupCpu(quota_cpus, usage_s, st.get("nr_periods", 0), st.get("nr_throttled", 0))


def machine_cpu_seconds(cpus: set[int] | None = None) -> tuple[float, float]:
    """(busy, total) CPU seconds since boot over the CPUs in `cpus` (default: those the
    server may run on, `SERVER_CORES`), every process on the machine counted. Idle and
    iowait are not busy; steal (time a hypervisor gave to another guest) is."""
    import psutil

    if cpus is None:
        cpus = set(SERVER_CORES) if SERVER_CORES is not None else None
    busy = total = 0.0
    for i, t in enumerate(psutil.cpu_times(percpu=True)):
        if cpus is not None and i not in cpus:
            continue
        d = t._asdict()
        all_s = sum(v for k, v in d.items() if k not in ("guest", "guest_nice"))  # guest time is inside user
        idle = d.get("idle", 0.0) + d.get("iowait", 0.0)
        busy += all_s - idle
        total += all_s
    return busy, total


@dataclass(frozen=True)
class MachineLoad:
    """The whole machine's load over the meter's window, on this process's CPUs."""

    busy: float  # busy fraction of the CPUs this process may run on, everyone's work counted
    capacity_cpus: float  # CPUs this server may use: its affinity, capped by a cgroup quota
    cgroup_busy: float | None  # the cgroup's CPU use over its quota (None: no quota / unreadable)
    throttled: float | None  # fraction of the cgroup's enforcement periods it was throttled in

    def effective(self) -> float:
        """The busy fraction that binds: the cores' or the quota's, whichever is fuller."""
        return max(self.busy, self.cgroup_busy or 0.0)

    def as_dict(self) -> dict[str, Any]:
        r = lambda v: None if v is None else round(v, 4)  # noqa: E731
        return {"machine_busy": r(self.busy), "capacity_cpus": r(self.capacity_cpus), "cgroup_busy": r(self.cgroup_busy),
                "throttled": r(self.throttled)}


class MachineMeter:
    """Whole-machine CPU load over the last `window_s` (None until two readings at
    least a second apart); readers injectable for tests."""

    def __init__(
        self,
        window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        read_machine: Callable[[], tuple[float, float]] = machine_cpu_seconds,
        read_cgroup: Callable[[], CgroupCpu | None] = read_cgroup_cpu,
        cpus: int | None = None,
    ) -> None:
        self.window_s = window_s
        self.clock = clock
        self.read_machine = read_machine
        self.read_cgroup = read_cgroup
        self.cpus = cpus or usable_cpus()
        self._readings: deque[tuple[float, tuple[float, float], CgroupCpu | None]] = deque()

    def load(self) -> MachineLoad | None:
        """Read the machine's and the cgroup's CPU counters now (blocking) and give the
        load since the oldest reading of the window."""
        t = self.clock()
        try:  # an unreadable or odd /proc or cgroup file must not break admission
            m, cg = self.read_machine(), self.read_cgroup()
        except (OSError, ValueError, IndexError):
            return None
        if self._readings and m[1] < self._readings[-1][1][1]:
            self._readings.clear()
        self._readings.append((t, m, cg))
        while len(self._readings) > 2 and t - self._readings[1][0] >= self.window_s:
            self._readings.popleft()
        t0, m0, cg0 = self._readings[0]
        if t - t0 < 1.0 or m[1] <= m0[1]:
            return None
        busy = min(1.0, max(0.0, (m[0] - m0[0]) / (m[1] - m0[1])))
        capacity = float(self.cpus)
        cgroup_busy = throttled = None
        if cg is not None and cg0 is not None:
            if cg.quota_cpus is not None:
                capacity = min(capacity, cg.quota_cpus)
                if cg.usage_s is not None and cg0.usage_s is not None:
                    cgroup_busy = max(0.0, (cg.usage_s - cg0.usage_s) / (t - t0) / cg.quota_cpus)
            if cg.periods > cg0.periods:
                throttled = (cg.throttled - cg0.throttled) / (cg.periods - cg0.periods)
        return MachineLoad(busy, capacity, cgroup_busy, throttled)


# CPU and machine readings are taken this often (in a thread), decisions read the latest.
SAMPLE_S = 0.5
# The outside-load figure is the mean over this span: long enough to smooth a burst of
# another process, short enough to forget it soon after it ends.
CPU_WINDOW_S = 5.0
LOOP_TICK_S = 0.02


# Where an idle thread of the process waits (an executor's queue, a lock, a sleep).
IDLE_FRAMES = ("thread.py:81 _worker", "threading.py:", "selectors.py:", "garbage.py:")


class LoopLag:
    """How late the event loop wakes a task that sleeps `LOOP_TICK_S` at a time: the
    worst of the last `window_s`, the worst since start, and the histogram
    `omni_rt_event_loop_lag_seconds`. A loop that paces audio frames and is late by
    more than a frame is heard.

    A watchdog thread beside it notices a loop that has not ticked for `BLOCKED_S` and
    takes the loop thread's stack then (`blocked`: the last `BLOCKED_KEPT`, each when,
    for how long at least, and where; logged as a warning): what held the loop, named."""

    BLOCKED_S = 0.05
    BLOCKED_KEPT = 20

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._lags: deque[tuple[float, float]] = deque()  # (when, lag) of the lags over 5 ms
        self.worst_ever = 0.0
        self.ticks = 0
        self.blocked: deque[dict[str, Any]] = deque(maxlen=self.BLOCKED_KEPT)
        self._beat = time.perf_counter()
        self._loop_thread: int | None = None
        self._stop = threading.Event()

    def record(self, lag: float, now: float | None = None) -> None:
        t = self.clock() if now is None else now
        self.ticks += 1
        self.worst_ever = max(self.worst_ever, lag)
        if lag > 0.005:
            self._lags.append((t, lag))
        while self._lags and t - self._lags[0][0] > self.window_s:
            self._lags.popleft()

    def worst(self, now: float | None = None) -> float:
        t = self.clock() if now is None else now
        return max((lag for when, lag in self._lags if t - when <= self.window_s), default=0.0)

    def reset(self) -> None:
        self._lags.clear()
        self.worst_ever = 0.0

    def _watch(self) -> None:
        import logging
        import sys
        import traceback

        log = logging.getLogger("omni_rt.load")
        seen = None  # the beat of the stall already reported
        while not self._stop.wait(0.01):
            beat = self._beat
            held = time.perf_counter() - beat
            if held < self.BLOCKED_S or beat == seen or self._loop_thread is None:
                continue
            frames = sys._current_frames()
            frame = frames.get(self._loop_thread)
            if frame is None:
                continue
            seen = beat
            stack = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack(frame)[-12:]]
            # where the other threads are (one of them may hold the interpreter lock)
            names = {t.ident: t.name for t in threading.enumerate()}
            others = {names.get(tid, str(tid)): " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}"
                                                           for f in traceback.extract_stack(fr)[-3:][::-1])
                      for tid, fr in frames.items() if tid not in (self._loop_thread, threading.get_ident())}
            self.blocked.append({"time": time.time(), "held_ms_at_least": round(held * 1000, 1), "stack": stack[::-1], "threads": others})
            busy = {k: v for k, v in others.items() if not v.startswith(IDLE_FRAMES)}
            log.warning("event loop held for %.0f ms (so far) at %s; other threads running: %s", held * 1000, " <- ".join(stack[::-1][:6]),
                        "; ".join(f"{k}: {v}" for k, v in busy.items()) or "none")

    async def run(self) -> None:
        import asyncio

        from omni_rt import metrics

        self._loop_thread = threading.get_ident()
        self._stop.clear()
        watchdog = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
        watchdog.start()
        try:
            while True:
                t0 = time.perf_counter()
                self._beat = t0
                await asyncio.sleep(LOOP_TICK_S)
                now = time.perf_counter()
                self._beat = now
                lag = max(0.0, now - t0 - LOOP_TICK_S)
                self.record(lag)
                metrics.EVENT_LOOP_LAG_SECONDS.observe(lag)
        finally:
            self._stop.set()


# Threads of the engines that run in the server's process (`omni_rt.engines`: one
# executor thread each, named after it): the rest of the process is the front end.
ENGINE_THREAD_PREFIXES = ("torch-", "diffusers-")


def front_cpu_seconds() -> float:
    """CPU seconds of this process's threads, less its in-process engines' threads."""
    import psutil

    engines = {t.native_id for t in threading.enumerate() if t.name.startswith(ENGINE_THREAD_PREFIXES)}
    try:
        return sum(t.user_time + t.system_time for t in psutil.Process().threads() if t.id not in engines)
    except psutil.Error:
        return 0.0


class LoadMeters:
    """One server's load meters (see the module docstring): the generation RTF of its
    streams, the holes its paced answers had, its event loop's lag, and its and the
    machine's CPU, sampled off the event loop (`start`)."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic, cpu_window_s: float = CPU_WINDOW_S,
                 cpu: CpuMeter | None = None, machine: MachineMeter | None = None, front: CpuMeter | None = None) -> None:
        self.generation = RtfMeter(window_s, clock)
        self.playout = HoleMeter(window_s, clock)
        self.loop = LoopLag()
        self.cpu = cpu if cpu is not None else CpuMeter(cpu_window_s, read=self.server_cpu_seconds)
        # the front end: this process's threads but its in-process engines' (VAD, resampling,
        # pacing, framing, the wires, the orchestrator)
        self.front = front if front is not None else CpuMeter(cpu_window_s, read=front_cpu_seconds)
        self.front_now: float | None = None  # the latest sample: the front end's busy fraction of the CPUs
        self.machine = machine if machine is not None else MachineMeter(cpu_window_s)
        self.cpu_now: float | None = None  # the latest sample: the server's busy fraction
        self.machine_now: MachineLoad | None = None  # the latest sample: the machine's load
        self.sampled = 0
        self._placed: dict[int, float] = {}  # pid -> CPU seconds a placed stage's process on this host reported
        self._lock = threading.Lock()
        self._tasks: list[Any] = []
        self._tree_cache: ProcessTree | None = None

    @property
    def _tree(self) -> ProcessTree:
        if self._tree_cache is None:
            self._tree_cache = ProcessTree()
        return self._tree_cache

    def set_window(self, window_s: float) -> None:
        self.generation.window_s = self.playout.window_s = window_s

    # ---- what placed stages report ----------------------------------------------------
    def placed_cpu(self, pid: int, seconds: float) -> None:
        """A placed stage's process on this host reports its CPU seconds so far (it is
        no child of this server's, so the process tree does not show it)."""
        with self._lock:
            self._placed[pid] = max(seconds, self._placed.get(pid, 0.0))

    def server_cpu_seconds(self) -> float:
        """This process, its descendants, and the placed stages' processes on this host."""
        procs = self._tree.processes()
        tree = {p.pid for p in procs}
        with self._lock:
            placed = sum(s for pid, s in self._placed.items() if pid not in tree)
        return self._tree.cpu_seconds() + placed

    # ---- sampling -----------------------------------------------------------------------
    def sample(self, machine: bool = True) -> None:
        """One reading of the CPU meters (blocking: run it in a thread)."""
        self.cpu_now = self.cpu.utilisation()
        self.front_now = self.front.utilisation()
        if machine:
            self.machine_now = self.machine.load() or self.machine_now
        self.sampled += 1

    async def start(self, machine: bool = True) -> None:
        import asyncio

        if self._tasks:
            return

        async def sampler() -> None:
            while True:
                try:
                    await asyncio.to_thread(self.sample, machine)
                except Exception:  # noqa: BLE001 - an odd /proc must not end the sampling
                    import logging

                    logging.getLogger("omni_rt.load").exception("load sampling failed")
                await asyncio.sleep(SAMPLE_S)

        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(sampler(), name="load-sampler"), loop.create_task(self.loop.run(), name="loop-lag")]

    async def stop(self) -> None:
        import asyncio

        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def clear(self) -> None:
        self.generation.clear()
        self.playout.clear()
        self.loop.reset()
