"""A server's processes end with it, however it ends (omni_rt.lifeline).

Unit tier: a process carrying a "server" pid in its environment (`server_env`) and
calling `watch_server()` dies as soon as that process is gone — at once if it is gone
already, or if its pid now belongs to another process. `leftover_engines()` finds
processes whose server is gone, and `omni-rt serve` warns about them.

Integration tier: a real `omni-rt serve` (the tts pipeline: a vLLM talker with its
EngineCore and Worker processes, the multiprocessing resource tracker) killed with
SIGKILL, stopped with SIGTERM or crashing inside its event loop leaves no process
behind 10 s later; SIGTERM and SIGINT are clean stops that exit 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from omni_rt.lifeline import PID_ENV, START_ENV, leftover_engines, server_env, start_time, watch_server
from testkit.harness import free_port

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration  # watcher processes and servers of their own

WATCHER = "from omni_rt.lifeline import watch_server; import sys, time; print(watch_server(), flush=True); time.sleep(120)"


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still alive (and not zombies) after waiting up to `seconds`."""
    deadline = time.monotonic() + seconds
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    return alive


def _watcher(env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", WATCHER], env={**os.environ, **env}, cwd=REPO, stdout=subprocess.PIPE, text=True)


def test_a_process_watching_the_server_dies_with_it():
    server = subprocess.Popen(["sleep", "120"])
    child = _watcher(server_env(server.pid))
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "True"
        time.sleep(0.3)
        assert child.poll() is None  # alive while the server is
        server.kill()
        server.wait()
        assert child.wait(timeout=5) == -signal.SIGKILL
    finally:
        for p in (server, child):
            if p.poll() is None:
                p.kill()


def test_a_server_gone_before_the_watch_starts_or_a_recycled_pid_ends_it_at_once():
    gone = subprocess.Popen(["true"])
    gone.wait()
    child = _watcher({PID_ENV: str(gone.pid), START_ENV: "1"})
    assert child.wait(timeout=5) == -signal.SIGKILL
    # a live pid whose start time is not the server's: the server's pid was recycled
    other = subprocess.Popen(["sleep", "120"])
    try:
        child = _watcher({PID_ENV: str(other.pid), START_ENV: "12345"})
        assert child.wait(timeout=5) == -signal.SIGKILL
    finally:
        other.kill()


def test_the_server_itself_and_processes_outside_one_do_not_watch(monkeypatch):
    monkeypatch.delenv(PID_ENV, raising=False)
    assert watch_server() is False
    monkeypatch.setenv(PID_ENV, str(os.getpid()))  # the server's own environment while it spawns engines
    assert watch_server() is False
    assert server_env() == {PID_ENV: str(os.getpid()), START_ENV: start_time(os.getpid())}


def test_leftovers_of_an_earlier_server_are_found_and_named_at_start(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    # an engine of a server that died, from before processes watched their server
    orphan = subprocess.Popen(["sleep", "120"], env={**os.environ, PID_ENV: str(gone.pid), START_ENV: "1"})
    try:
        assert leftover_engines().get(gone.pid) == [orphan.pid]
        import socket

        with socket.socket() as taken:  # the server stops at its port, right after the check
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            out = subprocess.run([sys.executable, "-m", "omni_server.cli", "serve", "--port", str(taken.getsockname()[1])], cwd=REPO,
                                 capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "cannot listen" in out.stderr
        assert f"earlier omni-rt server (pid {gone.pid}" in out.stderr and f"kill {orphan.pid}" in out.stderr, out.stderr
    finally:
        orphan.kill()


def _pipelines() -> list[str]:
    import pipelines

    return list(pipelines.load_all())


# ---- a real server -------------------------------------------------------------------------


CRASH = textwrap.dedent(
    """
    import sys
    import omni_server.app
    from omni_server.cli import main

    started = omni_server.app.freeze_startup_objects

    async def crash(app):  # a fault inside the event loop once the engines run
        await started(app)
        import os, psutil
        kids = psutil.Process().children(recursive=True)
        with open(os.environ["LIFELINE_CHILDREN"], "w") as f:
            f.write(" ".join(f"{k.pid}:{k.name()}" for k in kids))
        raise RuntimeError("a crash inside the event loop")

    omni_server.app.freeze_startup_objects = crash
    sys.exit(main(sys.argv[1:]))
    """
)


def _serve(tmp_path: Path, models_dir: Path, crash: bool = False) -> tuple[subprocess.Popen[bytes], Path]:
    cfg = tmp_path / "tts.yaml"
    cfg.write_text("pipelines: {" + ", ".join(f"{n}: {{enabled: false}}" for n in _pipelines() if n != "tts") + "}\n")
    port = free_port()
    args = ["serve", "--port", str(port), "--deploy", str(cfg)]
    cmd = [sys.executable, "-c", CRASH, *args] if crash else [sys.executable, "-m", "omni_server.cli", *args]
    log = tmp_path / "server.log"
    env = {**os.environ, "OMNI_RT_MODELS_DIR": str(models_dir), "PYTHONUNBUFFERED": "1", "LIFELINE_CHILDREN": str(tmp_path / "children")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if crash and "a crash inside the event loop" in log.read_text(errors="replace"):
            break
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        time.sleep(0.5)
    return proc, log


def _engines(proc: subprocess.Popen[bytes]) -> list[int]:
    kids = psutil.Process(proc.pid).children(recursive=True)
    names = [k.name() for k in kids]
    assert any(n.startswith("VLLM::EngineCor") for n in names) and any(n.startswith("VLLM::Worker") for n in names), names
    return [k.pid for k in kids]


@pytest.mark.vllm
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "SIGINT"])
def test_a_server_that_dies_or_stops_leaves_no_process_behind(tmp_path, models_dir, how):
    proc, log = _serve(tmp_path, models_dir)
    try:
        assert proc.poll() is None, log.read_text()[-3000:]
        kids = _engines(proc)
        os.kill(proc.pid, getattr(signal, how))  # the server only, not its process group
        code = proc.wait(timeout=60)
        left = _gone_within(kids, 10)
        assert left == [], f"{how}: alive 10 s after the server: {[psutil.Process(p).name() for p in left]}"
        if how == "SIGKILL":
            assert code == -signal.SIGKILL
        else:  # a clean stop: the engines were shut down and the exit status says so
            assert code == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        _kill_group(proc)


@pytest.mark.vllm
def test_a_crash_inside_the_event_loop_leaves_no_process_behind(tmp_path, models_dir):
    proc, log = _serve(tmp_path, models_dir, crash=True)
    try:
        code = proc.wait(timeout=120)
        assert code != 0 and "a crash inside the event loop" in log.read_text()
        kids = dict(k.split(":", 1) for k in (tmp_path / "children").read_text().split())
        assert any(n.startswith("VLLM::EngineCor") for n in kids.values()), kids  # the engines were running at the crash
        assert _gone_within([int(p) for p in kids], 10) == []
    finally:
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Whatever a failed test left (the server's process group), so it cannot leak."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
