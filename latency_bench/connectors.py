"""Connector throughput bench: put+get of one array payload vs a plain memcpy.

For each size the bench builds a uint8 array of that many bytes (random, so no page
is left untouched), then, after `warmup` untimed rounds, measures `repeat` rounds of:

* memcpy:   ``np.copyto(dst, src)`` into a preallocated array of the same size;
* backend:  ``h = c.put(rid, "x", Payload(LATENTS, Fence("bench"), {"x": src}))``
            then ``p = c.get(h)`` (timed together, and each on its own), then
            ``c.cleanup(rid)`` (timed separately, not part of put+get);
* inproc:   the same with `InprocConnector`, always reported alongside.

`--backend ray` measures Ray's object store (`ray.put` / `ray.get` in one process of a
Ray instance the bench starts; objects under Ray's inline limit, ~100 KiB, stay in the
owner's memory, bigger ones go to the node's shared-memory store).

It reports medians, GB/s (= bytes / median seconds / 1e9), the backend / memcpy
throughput ratio, and checks made outside the timed region on the first timed round:
the data came back equal, whether ``get`` returned a view (the array does not own its
memory), whether it shares memory with the source array (``np.shares_memory``) and,
for inproc, whether it copied. `omni_rt` is imported only when this bench runs.
"""

from __future__ import annotations

import re
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from latency_bench import finish, machine_info, utc_now
from latency_bench.stats import median, ratio, summarize

SCHEMA = "omni-rt.latency_bench.connectors/1"
DEFAULT_SIZES = "1KiB,64KiB,1MiB,16MiB,64MiB"
BACKENDS = ("ray", "inproc")

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
}


def parse_size(spec: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", spec)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"bad size {spec!r}; use e.g. 512, 1KiB, 64KiB, 1MiB, 16MiB, 1GiB, 1MB")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 1:
        raise ValueError(f"size must be at least 1 byte, got {spec!r}")
    return n


def parse_sizes(spec: str) -> list[int]:
    sizes = [parse_size(s) for s in spec.split(",") if s.strip()]
    if not sizes:
        raise ValueError("no sizes given")
    return sizes


def format_size(n: int) -> str:
    for unit, f in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= f and n % f == 0:
            return f"{n // f}{unit}"
    return f"{n}B"


def make_connector(backend: str) -> Any:
    """Imports the backend lazily; raises ImportError if it is not available."""
    if backend == "inproc":
        from omni_rt.connectors.inproc import InprocConnector

        return InprocConnector()
    if backend == "ray":
        # a Ray instance of the bench's own (as a server without server.ray_address starts one)
        from omni_rt.connectors.ray import RayConnector
        from omni_rt.placement import connect

        connect(None)
        return RayConnector()
    raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")


def _gbps(nbytes: int, seconds: float | None) -> float | None:
    if not seconds:
        return None
    return nbytes / seconds / 1e9


def bench_memcpy(src: np.ndarray, repeat: int, warmup: int) -> dict[str, Any]:
    dst = np.empty_like(src)
    for _ in range(max(1, warmup)):  # at least one: fault in dst's pages
        np.copyto(dst, src)
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        samples.append(time.perf_counter() - t0)
    ok = bool(np.array_equal(dst, src))
    med = median(samples)
    return {"median_s": med, "gbps": _gbps(src.nbytes, med), "data_ok": ok, "samples_s": samples}


def bench_connector(conn, src: np.ndarray, repeat: int, warmup: int) -> dict[str, Any]:
    from omni_rt.payloads import Fence, Payload, PayloadKind

    run_id = uuid.uuid4().hex[:8]
    put_s: list[float] = []
    get_s: list[float] = []
    put_get_s: list[float] = []
    cleanup_s: list[float] = []
    checks: dict[str, Any] = {}
    for i in range(warmup + repeat):
        timed = i >= warmup
        rid = f"bench-{run_id}-{i}"
        payload = Payload(kind=PayloadKind.LATENTS, fence=Fence("bench"), arrays={"x": src})
        t0 = time.perf_counter()
        h = conn.put(rid, "x", payload)
        t1 = time.perf_counter()
        p = conn.get(h)
        t2 = time.perf_counter()
        if timed and not checks:
            x = p.arrays["x"]
            checks = {
                "data_ok": bool(x.shape == src.shape and x.dtype == src.dtype and np.array_equal(x, src)),
                "get_is_view": not x.flags.owndata,
                "shares_memory_with_src": bool(np.shares_memory(x, src)),
                "handle_nbytes": int(h.nbytes),
            }
            del x
        # Drop every reference to the payload's arrays before the connector frees them.
        del p, payload
        t3 = time.perf_counter()
        freed = conn.cleanup(rid)
        t4 = time.perf_counter()
        if timed:
            put_s.append(t1 - t0)
            get_s.append(t2 - t1)
            put_get_s.append(t2 - t0)
            cleanup_s.append(t4 - t3)
            checks.setdefault("cleanup_freed", freed)
    med = median(put_get_s)
    return {
        "backend": getattr(conn, "name", type(conn).__name__),
        "put_get_median_s": med,
        "put_median_s": median(put_s),
        "get_median_s": median(get_s),
        "cleanup_median_s": median(cleanup_s),
        "gbps": _gbps(src.nbytes, med),
        **checks,
        "copied": None if "shares_memory_with_src" not in checks else not checks["shares_memory_with_src"],
        "put_get_s": summarize(put_get_s, (50, 90)),
        "samples_put_get_s": put_get_s,
        "samples_put_s": put_s,
        "samples_get_s": get_s,
    }


def run(
    sizes: Sequence[int],
    repeat: int = 10,
    warmup: int = 2,
    backend: str = "ray",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    if repeat < 1:
        raise ValueError("repeat must be >= 1")
    conns = {backend: make_connector(backend)}
    if backend != "inproc":
        conns["inproc"] = make_connector("inproc")
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "created": utc_now(),
        "machine": {**machine_info(), "numpy": np.__version__},
        "config": {"backend": backend, "sizes": [int(s) for s in sizes], "repeat": repeat, "warmup": warmup},
        "backend": backend,
        "sizes": [],
    }
    rng = np.random.default_rng(0)
    try:
        for n in sizes:
            src = rng.integers(0, 256, size=n, dtype=np.uint8)
            entry: dict[str, Any] = {"bytes": int(n), "label": format_size(n)}
            entry["memcpy"] = bench_memcpy(src, repeat, warmup)
            entry["backends"] = {name: bench_connector(c, src, repeat, warmup) for name, c in conns.items()}
            entry["ratio_over_memcpy"] = {
                name: ratio(b["gbps"], entry["memcpy"]["gbps"]) for name, b in entry["backends"].items()
            }
            entry["ratio"] = entry["ratio_over_memcpy"][backend]
            result["sizes"].append(entry)
            log(_row(entry, backend))
    finally:
        for c in conns.values():
            try:
                c.close()
            except Exception as e:  # report, but do not hide the bench's own error
                print(f"warning: closing {c!r} failed: {e}", file=sys.stderr)
    return result


def _f(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def header(backend: str) -> str:
    return (f"{'size':>8} {'memcpy GB/s':>12} {backend + ' GB/s':>12} {backend + '/memcpy':>14} "
            f"{backend + ' view':>10} {'inproc us':>10} {'inproc copied':>13}")


def _row(e: dict[str, Any], backend: str) -> str:
    b = e["backends"][backend]
    ip = e["backends"]["inproc"]
    return (f"{e['label']:>8} {_f(e['memcpy']['gbps'], '.2f'):>12} {_f(b['gbps'], '.2f'):>12} "
            f"{_f(e['ratio'], '.3f'):>14} {str(b.get('get_is_view')):>10} "
            f"{_f(ip['put_get_median_s'] * 1e6 if ip['put_get_median_s'] is not None else None, '.1f'):>10} "
            f"{str(ip.get('copied')):>13}")


def main_connectors(args) -> int:
    try:
        sizes = parse_sizes(args.sizes)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        make_connector(args.backend).close()
    except ImportError as e:
        print(f"error: connector backend {args.backend!r} is not available ({e}); try --backend inproc",
              file=sys.stderr)
        return 2
    print(header(args.backend))
    result = run(sizes, repeat=args.repeat, warmup=args.warmup, backend=args.backend)
    bad = [e["label"] for e in result["sizes"]
           if not e["memcpy"]["data_ok"] or not all(b.get("data_ok") for b in e["backends"].values())]
    if bad:
        print(f"error: data mismatch after put/get for sizes {bad}", file=sys.stderr)
    finish(args.json, result)
    return 1 if bad else 0
