"""omni-rt latency bench: closed-loop load generation and honest latency metrics.

Subcommands (``python -m latency_bench --help``):

* ``tts``        closed-loop TTS bench against a running server (``--url``) or against
                 servers it starts itself, one per deploy variant (``--compare``);
* ``connectors`` put+get throughput of the payload connectors against plain memcpy.

The TTS bench talks to the server only through `clients` (over HTTP); the connectors
bench imports `omni_rt.connectors` lazily, only when it runs.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


# the machine's load when the bench started (before its own work), beside the load
# when the result is written: a bench run beside other work is not a measurement
_LOAD_AT_START = _load_avg()


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "load_avg_1_5_15_at_start": _LOAD_AT_START,
        "load_avg_1_5_15_at_end": _load_avg(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "implementation": sys.implementation.name,
        "platform": platform.platform(),
        "machine": platform.machine(),
    }
    try:
        info["cpu_affinity"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        info["cpu_affinity"] = None
    try:
        import psutil

        info["mem_total_mib"] = round(psutil.virtual_memory().total / (1024 * 1024), 1)
    except Exception:  # psutil missing or unsupported platform
        info["mem_total_mib"] = None
    return info


def write_json(path: str | os.PathLike | None, result: dict[str, Any]) -> None:
    """Write `result` atomically (tmp file + rename); strict JSON (no NaN/Infinity)."""
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, allow_nan=False))
    tmp.replace(p)


def finish(path: str | os.PathLike | None, result: dict[str, Any]) -> None:
    """A bench's closing lines: the settings and the machine's load, one line per
    target in `result["targets"]` (if any), then the JSON written to `path` (if given)."""
    settings = result.get("config") or {
        k: v for k, v in result.items() if k not in ("schema", "created") and isinstance(v, (str, int, float, bool, list)) and len(str(v)) < 200
    }
    print(f"settings: {json.dumps(settings, default=str)}")
    m = result.get("machine") or machine_info()
    print(f"machine: {m.get('cpu_count')} CPUs ({m.get('cpu_affinity')} usable), load average (1/5/15 min) "
          f"{m.get('load_avg_1_5_15_at_start')} at start, {m.get('load_avg_1_5_15_at_end')} at the end")
    for name, t in (result.get("targets") or {}).items():
        verdict = "n/a" if t.get("met") is None else "met" if t["met"] else "NOT met"
        print(f"target {name}: {t.get('value', t.get('value_le', ''))} {t.get('goal', '')} -> {verdict}")
    write_json(path, result)
    if path:
        print(f"\nwrote {path}")
