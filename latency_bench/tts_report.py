"""The TTS bench's report: ratios between deploy variants (TTFP, audio seconds a
second, peak RSS), the variant's server over its engines driven directly, the
targets, and the printed table (`latency_bench.tts` runs the levels).
"""

from __future__ import annotations

from typing import Any

from latency_bench.stats import ratio


def _get(d: dict | None, *keys):
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def compute_ratios(variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    cs = sorted({int(c) for v in variants.values() for c in (v.get("levels") or {})})
    names = list(variants)

    def table(*path) -> dict[str, dict[str, Any]]:
        return {n: {str(c): _get(variants[n], "levels", str(c), *path) for c in cs} for n in names}

    ttfp = table("ttfp_ms", "p50")
    p99 = table("ttfp_ms", "p99")
    out: dict[str, Any] = {
        "levels": cs,
        "ttfp_p50_ms": ttfp,
        "ttfp_p99_over_p50": {n: {str(c): ratio(p99[n][str(c)], ttfp[n][str(c)]) for c in cs} for n in names},
        "rtf_mean": table("rtf", "mean"),
        "rtf_p90": table("rtf", "p90"),
        "audio_s_per_s": table("audio_s_per_s"),
        "errors": table("errors"),
        "server_rss_mib_peak": {n: variants[n].get("server_rss_mib_peak") for n in names},
    }
    if "split_chunk" in variants:
        out["ttfp_p50_over_split_chunk"] = {
            n: {str(c): ratio(ttfp[n][str(c)], ttfp["split_chunk"][str(c)]) for c in cs} for n in names
        }
    if "split_chunk" in variants and "split_batch" in variants:
        out["chunk_over_batch_ttfp"] = {
            str(c): ratio(ttfp["split_chunk"][str(c)], ttfp["split_batch"][str(c)]) for c in cs
        }
    if len(cs) > 1:  # a single level has nothing to compare against
        c_min, c_max = cs[0], cs[-1]
        out["c_min"], out["c_max"] = c_min, c_max
        out["ttfp_c_max_over_c1"] = {n: ratio(ttfp[n][str(c_max)], ttfp[n][str(c_min)]) for n in names}
    return out


def _fmt(v: Any, spec: str = ".1f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def level_line(lvl: dict[str, Any]) -> str:
    return (
        f"C={lvl['concurrency']:<3d} n={lvl['completed']:<4d} err={lvl['errors']:<3d} "
        f"ttfp p50/p90/mean={_fmt(lvl['ttfp_ms']['p50'])}/{_fmt(lvl['ttfp_ms']['p90'])}/"
        f"{_fmt(lvl['ttfp_ms']['mean'])} ms  e2el p50/p90={_fmt(lvl['e2el_ms']['p50'])}/"
        f"{_fmt(lvl['e2el_ms']['p90'])} ms  rtf mean/p90={_fmt(lvl['rtf']['mean'], '.3f')}/"
        f"{_fmt(lvl['rtf']['p90'], '.3f')}  audio_s/s={_fmt(lvl['audio_s_per_s'], '.2f')}"
    )


def format_report(result: dict[str, Any]) -> str:
    lines: list[str] = []
    hdr = (f"{'C':>4} {'n':>5} {'err':>4} {'ttfp50':>8} {'ttfp90':>8} {'ttfpµ':>8} "
           f"{'e2el50':>8} {'e2el90':>8} {'rtfµ':>6} {'rtf90':>6} {'aud s/s':>7}")
    for name, v in result["variants"].items():
        extra = []
        if v.get("url"):
            extra.append(v["url"])
        if v.get("deploy"):
            extra.append(f"deploy={v['deploy']}")
        if v.get("server_rss_mib_peak") is not None:
            extra.append(f"rss_peak={v['server_rss_mib_peak']:.0f}MiB")
        if v.get("server_ready_s") is not None:
            extra.append(f"ready={v['server_ready_s']:.1f}s")
        lines.append(f"== {name} " + " ".join(extra))
        if v.get("error"):
            lines.append(f"   FAILED: {v['error'].splitlines()[0]}")
            continue
        lines.append(hdr + "   (ms)")
        for c, lv in (v.get("levels") or {}).items():
            lines.append(
                f"{c:>4} {lv['completed']:>5} {lv['errors']:>4} {_fmt(lv['ttfp_ms']['p50']):>8} "
                f"{_fmt(lv['ttfp_ms']['p90']):>8} {_fmt(lv['ttfp_ms']['mean']):>8} {_fmt(lv['e2el_ms']['p50']):>8} "
                f"{_fmt(lv['e2el_ms']['p90']):>8} {_fmt(lv['rtf']['mean'], '.3f'):>6} {_fmt(lv['rtf']['p90'], '.3f'):>6} "
                f"{_fmt(lv['audio_s_per_s'], '.2f'):>7}"
            )
        for c, lv in (v.get("levels") or {}).items():
            for m in lv.get("error_messages") or []:
                lines.append(f"   C={c}: {m['count']} x error: {m['message'][:160]}")
    r = result.get("ratios") or {}
    names = [n for n in result["variants"] if not result["variants"][n].get("error")]
    if len(names) > 1 and r.get("levels"):
        lines.append("== ratios (TTFP p50 / split_chunk TTFP p50; chunk/batch = split_chunk / split_batch)")
        over = r.get("ttfp_p50_over_split_chunk") or {}
        head = f"{'C':>4} " + " ".join(f"{n[:12]:>12}" for n in names if n in over and n != "split_chunk")
        if "chunk_over_batch_ttfp" in r:
            head += f" {'chunk/batch':>11}"
        head += "  | rtf mean: " + " ".join(f"{n[:12]:>12}" for n in names)
        lines.append(head)
        for c in r["levels"]:
            c = str(c)
            row = f"{c:>4} " + " ".join(
                f"{_fmt(over[n][c], '.3f'):>12}" for n in names if n in over and n != "split_chunk"
            )
            if "chunk_over_batch_ttfp" in r:
                row += f" {_fmt(r['chunk_over_batch_ttfp'][c], '.3f'):>11}"
            row += "  |           " + " ".join(f"{_fmt(r['rtf_mean'][n][c], '.3f'):>12}" for n in names)
            lines.append(row)
    if r.get("ttfp_c_max_over_c1"):
        lines.append(
            f"ttfp p50 C={r['c_max']} / C={r['c_min']}: "
            + "  ".join(f"{n}={_fmt(x, '.2f')}" for n, x in r["ttfp_c_max_over_c1"].items())
        )
    if r.get("ttfp_p99_over_p50"):
        lines.append("ttfp p99 / p50: " + "  ".join(
            f"{n}=" + "/".join(_fmt(x, ".2f") for x in by.values()) for n, by in r["ttfp_p99_over_p50"].items())
            + f"  (C={','.join(str(c) for c in r['levels'])})")
    eng = result.get("engines")
    if eng:
        if eng.get("error"):
            lines.append(f"== engines of {eng['variant']}: FAILED: {eng['error'].splitlines()[0]}")
        else:
            lines.append(f"== engines of {eng['variant']} (talker and decoder driven directly, in one process)")
            for lv in eng["levels"].values():
                lines.append("   " + level_line(lv))
            over = r.get("audio_s_per_s_over_engines") or {}
            lines.append(f"audio s/s, {eng['variant']} server / its engines: "
                         + "  ".join(f"C={c}: {_fmt(x, '.3f')}" for c, x in over.items()))
    if any(x is not None for x in (r.get("server_rss_mib_peak") or {}).values()):
        lines.append("server RSS peak (MiB): " + "  ".join(
            f"{n}={_fmt(x, '.0f')}" for n, x in r["server_rss_mib_peak"].items()))
    return "\n".join(lines)


def engine_ratios(result: dict[str, Any]) -> dict[str, Any]:
    """Audio s/s of the variant's server over its engines driven directly, per level."""
    eng = result.get("engines") or {}
    server = result["variants"].get(eng.get("variant"), {})
    if eng.get("error") or server.get("error"):
        return {}
    return {"audio_s_per_s_over_engines": {
        c: ratio(_get(server, "levels", c, "audio_s_per_s"), _get(eng, "levels", c, "audio_s_per_s")) for c in eng.get("levels", {})
    }}


def tts_targets(result: dict[str, Any]) -> dict[str, Any]:
    """At the highest level, for the variant the engines ran: TTFP p99 <= 3 x p50 (no
    request starves) and audio s/s >= 0.9 of the engines' own."""
    r = result.get("ratios") or {}
    name = (result.get("engines") or {}).get("variant")
    levels = r.get("levels") or []
    if name is None or not levels:
        return {}
    top = str(levels[-1])
    tail = _get(r, "ttfp_p99_over_p50", name, top)
    share = _get(r, "audio_s_per_s_over_engines", top)
    return {
        f"ttfp_p99_over_p50_at_{top}": {"goal": "<= 3", "value": tail, "met": None if tail is None else tail <= 3},
        f"audio_s_per_s_over_engines_at_{top}": {"goal": ">= 0.9", "value": share, "met": None if share is None else share >= 0.9},
    }
