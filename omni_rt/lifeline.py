"""A server's processes end with it, however it ends.

The server starts processes it does not fully control (vLLM's engine cores, their
workers; later, stage processes): if the server is killed (SIGKILL, the OOM killer, a
container runtime) its own cleanup never runs, and those processes, re-parented to
PID 1, would keep running and holding memory (a GPU's, on a GPU box) until someone
kills them by hand.

So every process started on the server's behalf carries the server's identity in its
environment (`server_env()`: its pid and the kernel's start time of that pid, so a
recycled pid is not taken for the server) and, early in its life, calls
`watch_server()`: a daemon thread waits on a pidfd of the server (Linux 5.3+; polling
elsewhere) and kills its own process the moment the server is gone. Every descendant
watches the server itself, not its parent, so a worker under an engine core does not
depend on the engine core's watchdog. Nothing here depends on the server's cleanup,
its event loop or its threads (a parent-death signal would fire when the spawning
thread exits, and vLLM's engines are spawned from a worker thread).

vLLM runs omni-rt's general plugin (`omni_rt.vllm_plugin`) in every engine process it
starts; that is where its processes call `watch_server()`.

`leftover_engines()` finds processes of an earlier server that are still alive (their
server pid is gone), for the start-up warning.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from pathlib import Path

log = logging.getLogger("omni_rt.lifeline")

PID_ENV = "OMNI_RT_SERVER_PID"
START_ENV = "OMNI_RT_SERVER_START"
POLL_S = 0.5  # where pidfds are not available

_watching = False


def start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot; field 22 of
    /proc/PID/stat), None where there is no such process or no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces
    return stat[stat.rindex(")") + 2 :].split()[19]


def server_env(pid: int | None = None) -> dict[str, str]:
    """Environment for a process started on behalf of the server `pid` (this process)."""
    pid = os.getpid() if pid is None else pid
    return {PID_ENV: str(pid), START_ENV: start_time(pid) or ""}


def _alive(pid: int, started: str) -> bool:
    now = start_time(pid)
    if now is None:
        try:
            os.kill(pid, 0)  # no /proc: at least the pid exists
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return not started or now == started


def _die(pid: int) -> None:
    log.warning("omni-rt server %d is gone: process %d exits with it", pid, os.getpid())
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_for_exit(pid: int, started: str) -> None:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        _die(pid)
        return
    except (AttributeError, OSError):  # no pidfds here: poll
        while _alive(pid, started):
            time.sleep(POLL_S)
        _die(pid)
        return
    # the pid may have been recycled between the server's death and pidfd_open
    if not _alive(pid, started):
        _die(pid)
        return
    select.select([fd], [], [])  # readable once the process has exited
    _die(pid)


def watch_server() -> bool:
    """In a process started on the server's behalf (its environment says so): kill this
    process as soon as the server is gone. Returns whether it watches (False in the
    server itself, or outside one). Safe to call any number of times."""
    global _watching
    raw = os.environ.get(PID_ENV)
    if _watching or not raw or not raw.isdigit() or int(raw) == os.getpid():
        return _watching
    pid, started = int(raw), os.environ.get(START_ENV, "")
    _watching = True
    threading.Thread(target=_wait_for_exit, args=(pid, started), name="omni-rt-lifeline", daemon=True).start()
    return True


def leftover_engines() -> dict[int, list[int]]:
    """Processes started on behalf of an omni-rt server that is no longer running
    (readable to this user), by that server's pid."""
    import psutil

    found: dict[int, list[int]] = {}
    me = os.getpid()
    for p in psutil.process_iter(["pid"]):
        try:
            env = p.environ()
        except (psutil.Error, OSError):
            continue
        raw = env.get(PID_ENV, "")
        if not raw.isdigit() or int(raw) == me or p.pid == me:
            continue
        if not _alive(int(raw), env.get(START_ENV, "")):
            found.setdefault(int(raw), []).append(p.pid)
    return found
