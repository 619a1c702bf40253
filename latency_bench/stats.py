"""Small, dependency-free statistics used by the benches.

Percentiles use linear interpolation between closest ranks (numpy's default
"linear" method), so p50 of [1, 2, 3, 4] is 2.5. Empty inputs give ``None`` rather
than a made-up number; ``None`` values in the input are ignored.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any


def _clean(values: Iterable[float | None]) -> list[float]:
    out = []
    for v in values:
        if v is None:
            continue
        f = float(v)
        if math.isnan(f):
            continue
        out.append(f)
    return out


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """q in [0, 100]."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    xs = sorted(_clean(values))
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    if lo == hi:
        return xs[lo]
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Iterable[float | None]) -> float | None:
    xs = _clean(values)
    if not xs:
        return None
    return math.fsum(xs) / len(xs)


def median(values: Iterable[float | None]) -> float | None:
    return percentile(values, 50)


def summarize(values: Sequence[float | None], percentiles: Sequence[float] = (50, 90, 99)) -> dict[str, float | None]:
    """{"n", "mean", "min", "max", "p50", "p90", ...} over the non-None values."""
    xs = _clean(values)
    out: dict[str, float | None] = {
        "n": len(xs),
        "mean": mean(xs),
        "min": min(xs) if xs else None,
        "max": max(xs) if xs else None,
    }
    for q in percentiles:
        key = f"p{q:g}"
        out[key] = percentile(xs, q)
    return out


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None when either is missing or den is zero."""
    if num is None or den is None or den == 0:
        return None
    return num / den


def scaling_target(by: dict[int, dict[str, Any]], key: str, hi: int, lo: int, at_least: float) -> dict[str, dict[str, Any]]:
    """`{"<key>_<hi>_over_<lo>": {goal, value, met}}`: the levels' `key` at `hi` over at
    `lo` against a floor; empty when the run lacks either level."""
    if hi not in by or lo not in by:
        return {}
    r = ratio(by[hi][key], by[lo][key])
    return {f"{key}_{hi}_over_{lo}": {"goal": f">= {at_least:g}", "value": r, "met": r is not None and r >= at_least}}
