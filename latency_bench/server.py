"""Start and stop an omni-rt server subprocess for a bench run.

`ServerProcess` starts ``python -m omni_server.cli serve --host H --port P [--deploy F]``
(or a custom command template) in its own session / process group, sends its stdout
and stderr to a log file, waits for ``GET /health`` to answer 200, samples the RSS of
the whole process tree (the server plus every descendant, e.g. engine workers) in a
background thread, and on stop sends SIGINT to the group, then SIGTERM, then SIGKILL,
each after a timeout, so engine child processes die with it.

Note: the tree RSS is the plain sum of each process's resident set; pages shared
between processes (shared libraries, shared-memory segments) are counted once per
process that maps them, so it is an upper bound on physical memory used.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil

MIB = 1024 * 1024
DEFAULT_STARTUP_TIMEOUT_S = 300.0


class ServerError(RuntimeError):
    """The server could not be started or did not become healthy."""


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def tree_rss_bytes(root: psutil.Process) -> tuple[int, int]:
    """(sum of RSS over root and all its descendants, number of processes counted)."""
    total = 0
    count = 0
    try:
        procs = [root] + root.children(recursive=True)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return 0, 0
    for p in procs:
        try:
            total += p.memory_info().rss
            count += 1
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    return total, count


def default_command(host: str, port: int, deploy: str | os.PathLike | None, python: str | None = None) -> list[str]:
    cmd = [python or sys.executable, "-m", "omni_server.cli", "serve", "--host", host, "--port", str(port)]
    if deploy is not None:
        cmd += ["--deploy", str(deploy)]
    return cmd


def expand_command(template: str | Sequence[str], host: str, port: int, deploy: str | os.PathLike | None) -> list[str]:
    """Fill ``{python} {host} {port} {deploy}`` placeholders of a custom command."""
    tokens = shlex.split(template) if isinstance(template, str) else list(template)
    values = {"python": sys.executable, "host": host, "port": str(port), "deploy": "" if deploy is None else str(deploy)}
    return [t.format(**values) for t in tokens]


class ServerProcess:
    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int,
        deploy: str | os.PathLike | None = None,
        log_path: str | os.PathLike | None = None,
        command: str | Sequence[str] | None = None,
        cwd: str | os.PathLike | None = None,
        env: dict[str, str] | None = None,
        rss_interval_s: float = 0.5,
        tls_ca: str | os.PathLike | None = None,
    ) -> None:
        self.host = host
        # a server whose deploy overlay serves https: the CA (or self-signed certificate) to trust
        self.tls_ca = str(tls_ca) if tls_ca is not None else None
        self.port = port
        self.deploy = str(deploy) if deploy is not None else None
        self.log_path = Path(log_path) if log_path is not None else None
        if command is None:
            self.command = default_command(host, port, self.deploy)
        else:
            self.command = expand_command(command, host, port, self.deploy)
        self.cwd = str(cwd) if cwd is not None else None
        self.env = env
        self.rss_interval_s = rss_interval_s

        self.proc: subprocess.Popen | None = None
        self._log_fh: Any = None
        self._ps: psutil.Process | None = None
        self._seen: dict[int, psutil.Process] = {}
        self._sampler: threading.Thread | None = None
        self._stop_sampling = threading.Event()
        self._lock = threading.Lock()
        self.rss_peak_bytes = 0
        self.rss_peak_procs = 0
        self.rss_last_bytes = 0
        self.rss_samples = 0
        self.started_at: float | None = None
        self.ready_s: float | None = None
        self.returncode: int | None = None
        self.stop_signal: str | None = None  # which signal finally stopped it

    # -- lifecycle -----------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"{'https' if self.tls_ca else 'http'}://{self.host}:{self.port}"

    def start(self) -> None:
        if self.proc is not None:
            raise ServerError("server already started")
        if not port_is_free(self.host, self.port):
            raise ServerError(
                f"port {self.host}:{self.port} is already in use; refusing to bench whatever is listening there"
            )
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_fh = open(self.log_path, "ab")
            self._log_fh.write(f"# latency_bench: starting {shlex.join(self.command)}\n".encode())
            self._log_fh.flush()
            out = self._log_fh
        else:
            out = subprocess.DEVNULL
        self.started_at = time.perf_counter()
        self.proc = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=self.cwd,
            env=env,
            # Its own process group (stopped as one), but not its own session: Linux
            # schedules each session as one "autogroup", and a client in another
            # autogroup than a busy server was starved for seconds at a time (first
            # audio seen ~4 s late while the server had sent it in 0.15 s).
            process_group=0,
        )
        try:
            self._ps = psutil.Process(self.proc.pid)
        except psutil.NoSuchProcess:
            self._ps = None
        self._stop_sampling.clear()
        self._sampler = threading.Thread(target=self._sample_loop, name="rss-sampler", daemon=True)
        self._sampler.start()

    def wait_ready(self, timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S, poll_s: float = 0.25) -> float:
        """Block until ``GET /health`` returns 200; returns seconds since start."""
        if self.proc is None or self.started_at is None:
            raise ServerError("server not started")
        deadline = time.perf_counter() + timeout_s
        last_err = "no answer yet"
        verify: Any = ssl.create_default_context(cafile=self.tls_ca) if self.tls_ca else True
        with httpx.Client(timeout=httpx.Timeout(5.0), trust_env=False, verify=verify) as http:
            while True:
                rc = self.proc.poll()
                if rc is not None:
                    raise ServerError(
                        f"server exited with code {rc} before becoming healthy; log tail:\n{self.log_tail()}"
                    )
                try:
                    r = http.get(self.url + "/health")
                    if r.status_code == 200:
                        self.ready_s = time.perf_counter() - self.started_at
                        self._sample_once()
                        return self.ready_s
                    last_err = f"/health answered {r.status_code}"
                except httpx.HTTPError as exc:
                    last_err = f"{type(exc).__name__}: {exc}"
                if time.perf_counter() >= deadline:
                    raise ServerError(
                        f"server not healthy after {timeout_s:.0f}s ({last_err}); log tail:\n{self.log_tail()}"
                    )
                time.sleep(poll_s)

    def stop(self, int_timeout_s: float = 20.0, term_timeout_s: float = 10.0) -> int | None:
        """SIGINT the process group, then SIGTERM, then SIGKILL; reap leftovers."""
        if self.proc is None:
            return None
        pgid = self.proc.pid  # process_group=0: the leader's pid is the group id
        self._track_children()
        if self.proc.poll() is None:
            for sig, wait_s in ((signal.SIGINT, int_timeout_s), (signal.SIGTERM, term_timeout_s), (signal.SIGKILL, 10.0)):
                self._killpg(pgid, sig)
                try:
                    self.proc.wait(timeout=wait_s)
                    self.stop_signal = sig.name
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.returncode = self.proc.poll()
        self._reap_leftovers(pgid)
        self._stop_sampling.set()
        if self._sampler is not None:
            self._sampler.join(timeout=5)
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None
        return self.returncode

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- memory --------------------------------------------------------------------
    @property
    def rss_peak_mib(self) -> float:
        return self.rss_peak_bytes / MIB

    @property
    def rss_last_mib(self) -> float:
        return self.rss_last_bytes / MIB

    def _sample_once(self) -> None:
        if self._ps is None:
            return
        total, count = tree_rss_bytes(self._ps)
        if count == 0:
            return
        with self._lock:
            self.rss_last_bytes = total
            self.rss_samples += 1
            if total > self.rss_peak_bytes:
                self.rss_peak_bytes = total
                self.rss_peak_procs = count
        self._track_children()

    def _sample_loop(self) -> None:
        while not self._stop_sampling.is_set():
            if self.proc is not None and self.proc.poll() is not None:
                break
            self._sample_once()
            self._stop_sampling.wait(self.rss_interval_s)

    def _track_children(self) -> None:
        if self._ps is None:
            return
        try:
            for c in self._ps.children(recursive=True):
                self._seen.setdefault(c.pid, c)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass

    # -- helpers -------------------------------------------------------------------
    @staticmethod
    def _killpg(pgid: int, sig: int) -> bool:
        """Signal a process group (0: only check it exists); False when it is gone."""
        try:
            os.killpg(pgid, sig)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return False

    def _reap_leftovers(self, pgid: int) -> None:
        """Kill anything of the tree that outlived the leader (same group or seen as a child)."""
        deadline = time.monotonic() + 5.0
        if self._killpg(pgid, signal.SIGTERM):
            while time.monotonic() < deadline and self._killpg(pgid, 0):
                time.sleep(0.1)
            self._killpg(pgid, signal.SIGKILL)
        alive = []
        for p in self._seen.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
        for p in alive:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, still = psutil.wait_procs(alive, timeout=3)
        for p in still:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        if self._log_fh is not None:
            self._log_fh.flush()
        with open(self.log_path, "rb") as f:
            try:
                f.seek(-64 * 1024, os.SEEK_END)
            except OSError:
                f.seek(0)
            data = f.read().decode("utf-8", errors="replace")
        return "\n".join(data.splitlines()[-lines:])


OTHER_PIPELINES = ("tts", "robot", "image", "world", "video", "video_edit")


def voice_only_overlay(profile: str, also_off: tuple[str, ...] = ()) -> dict[str, Any]:
    """A deploy overlay serving the voice pipeline under `profile`, every pipeline that is
    not part of it off (and `also_off`)."""
    return {"pipelines": {**{n: {"enabled": False} for n in (*OTHER_PIPELINES, *also_off)}, "voice": {"profile": profile}}}


@contextlib.contextmanager
def bench_url(args: Any, name: str, scheme: str = "http", path: str = "") -> Iterator[str]:
    """`args.url` when given; else the URL (`scheme://127.0.0.1:{args.port}{path}`) of a
    server started for the bench with overlay `args.deploy` (its log beside the JSON
    output, `{name}-server.log`) and stopped afterwards."""
    if getattr(args, "url", None):
        yield args.url
        return
    log_dir = Path(args.json).parent if args.json else Path("bench-out")
    log_dir.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(port=args.port, deploy=args.deploy, log_path=log_dir / f"{name}-server.log", env=dict(os.environ))
    server.start()
    try:
        server.wait_ready(timeout_s=600)
        yield f"{scheme}://127.0.0.1:{args.port}{path}"
    finally:
        server.stop()
