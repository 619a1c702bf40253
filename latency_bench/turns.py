"""semantic_vad's end-of-turn model against the silence thresholds it replaced.

Utterances spoken by espeak-ng, most with a pause in the middle of the sentence: a
speaker hesitating ("I would like to book a flight to, um, … Paris next Tuesday
morning."), or pausing on a continuing intonation ("My account number is, … four five
seven two nine."); five whole sentences. Each is fed in 20 ms pieces, as a client streams it, to the voice-activity
detector the server runs (silero-vad) under `semantic_vad` at each eagerness: once with
the end-of-turn model (Smart Turn v3) and once without it (the silence thresholds
300 / 700 / 1500 ms that semantic_vad meant before). Per detector:

- **false cut-offs**: the turn ended before the last word was spoken (in the pause);
- **end-of-turn latency**: the end of the last word -> the audio position at which the
  detector ended the turn (audio time, not wall time: what a caller waits for, less
  the server's compute, which is reported apart);
- **missed**: no end of turn within the eagerness's longest wait + 1 s.

Then the model's own cost: one decision, and batches of 8 and 64 (median of 5).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import time
from typing import Any

import numpy as np

from latency_bench import finish, machine_info, utc_now

RATE = 24000
STEP_MS = 20
# (words before the pause, pause in ms, words after it); no pause: one whole sentence
CASES: list[tuple[str, int, str]] = [
    # hesitations: a filler, then a pause
    ("I would like to book a flight to, um,", 700, "Paris next Tuesday morning."),
    ("My account number is, uh,", 900, "four five seven two nine."),
    ("Can you tell me, um,", 600, "what the weather will be like tomorrow?"),
    ("So I was thinking that maybe we could, uh,", 1000, "go to the park this afternoon."),
    ("I need to, um,", 1200, "cancel my subscription."),
    ("The meeting is on, uh,", 800, "Thursday at three."),
    # a pause on a continuing intonation, no filler
    ("My account number is,", 800, "four five seven two nine."),
    ("I want to order a pizza and,", 900, "a large salad."),
    ("I was wondering if,", 700, "you could call me back later."),
    # whole sentences
    ("What time does the store close today?", 0, ""),
    ("Please turn off the lights in the kitchen.", 0, ""),
    ("Thank you, that is all I needed.", 0, ""),
    ("How far is the nearest train station?", 0, ""),
    ("Book a flight to Paris next Tuesday morning.", 0, ""),
]


def _speech(text: str) -> np.ndarray:
    """espeak-ng's speech at 24 kHz, its own leading and trailing silence cut."""
    from testkit.harness import speech_pcm16

    x = np.frombuffer(speech_pcm16(text, RATE), "<i2").astype(np.float32) / 32768
    loud = np.flatnonzero(np.abs(x) > 0.01)
    return x[loud[0] : loud[-1] + 1] if len(loud) else x


def _utterances() -> list[dict[str, Any]]:
    out = []
    lead = np.zeros(RATE * 3 // 10, np.float32)
    for before, pause_ms, after in CASES:
        a = _speech(before)
        parts = [lead, a]
        last_word_start = len(lead)
        if pause_ms:
            b = _speech(after)
            parts += [np.zeros(RATE * pause_ms // 1000, np.float32), b]
            last_word_start = len(lead) + len(a) + RATE * pause_ms // 1000
        speech = np.concatenate(parts)
        out.append({"text": f"{before} … {after}" if pause_ms else before, "pause_ms": pause_ms, "pcm": speech,
                    "last_part_ms": last_word_start * 1000 // RATE, "end_ms": len(speech) * 1000 // RATE})
    return out


def _run(vad: Any, td: Any, pcm: np.ndarray, tail_ms: int) -> list[tuple[str, int, int]]:
    audio = np.concatenate([pcm, np.zeros(RATE * tail_ms // 1000, np.float32)])
    n = RATE * STEP_MS // 1000
    out = []
    for i in range(0, len(audio), n):
        for kind, ms in vad.push(audio[i : i + n], td):
            out.append((kind, ms, (i + n) * 1000 // RATE))
    return out


def _score(events: list[tuple[str, int, int]], u: dict[str, Any]) -> dict[str, Any]:
    stops = [e for e in events if e[0] == "stop"]
    if not stops:
        return {"missed": True, "cut_off": False, "latency_ms": None}
    first = stops[0]
    cut = first[2] < u["end_ms"] - 50  # ended before the last word was out (50 ms: the trim's edge)
    return {"missed": False, "cut_off": cut, "latency_ms": None if cut else first[2] - u["end_ms"], "turns": len(stops)}


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    lat = [r["latency_ms"] for r in rows if r["latency_ms"] is not None]
    paused = [r for r in rows if r["pause_ms"]]
    return {
        "utterances": len(rows),
        "false_cut_offs": sum(r["cut_off"] for r in rows),
        "false_cut_offs_of_paused": f"{sum(r['cut_off'] for r in paused)}/{len(paused)}",
        "missed": sum(r["missed"] for r in rows),
        "latency_ms_p50": statistics.median(lat) if lat else None,
        "latency_ms_max": max(lat) if lat else None,
        "latency_ms_mean": round(statistics.fmean(lat), 1) if lat else None,
    }


def _model_cost(model: Any, clip: np.ndarray) -> dict[str, float]:
    out = {}
    for n in (1, 8, 64):
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            model.predict([clip] * n)
            times.append(time.perf_counter() - t0)
        out[f"batch_{n}_ms"] = round(statistics.median(times) * 1000, 1)
        out[f"batch_{n}_ms_per_decision"] = round(statistics.median(times) * 1000 / n, 2)
    return out


def main_turns(args: argparse.Namespace) -> int:
    from protocols.realtime.models import TurnDetectionIn
    from protocols.realtime.turn import EAGERNESS, SemanticVad, SmartTurn, smart_turn_path
    from protocols.realtime.vad import silero_vad

    if shutil.which("espeak-ng") is None:
        print("error: the turns bench speaks with espeak-ng: install it")
        return 2
    path = smart_turn_path(args.turn_model)
    if path is None:
        print(f"error: no end-of-turn model for {args.turn_model!r} (the pipecat-ai wheel carries Smart Turn v3)")
        return 2
    model = SmartTurn(path, threads=args.threads)
    model.load()
    utterances = _utterances()
    eagerness = [e.strip() for e in args.eagerness.split(",") if e.strip()]
    results: dict[str, Any] = {}
    pairs: dict[str, list[dict[str, Any]]] = {}  # eagerness -> [silence's, the model's]
    for e in eagerness:
        td = TurnDetectionIn(type="semantic_vad", eagerness=e).settings()
        tail = EAGERNESS[e][2] + 1000
        for label, m in ((f"silence {e} ({td.silence_duration_ms} ms)", None), (f"smart-turn {e} (p >= {EAGERNESS[e][0]})", model)):
            rows = []
            for u in utterances:
                vad = SemanticVad(asyncio.run(silero_vad()), m)
                score = _score(_run(vad, td, u["pcm"], tail), u)
                rows.append({"text": u["text"], "pause_ms": u["pause_ms"], **score})
            results[label] = {"eagerness": e, "model": m is not None, **_summary(rows), "utterances_detail": rows}
            s = results[label]
            pairs.setdefault(e, []).append(s)
            print(f"{label:34s} false cut-offs {s['false_cut_offs']:2d} (paused: {s['false_cut_offs_of_paused']}), missed {s['missed']}, "
                  f"end-of-turn latency p50 {s['latency_ms_p50']} ms, max {s['latency_ms_max']} ms")
    cost = _model_cost(model, utterances[0]["pcm"])  # any clip costs the same: the model always hears 8 s
    print("model cost:", cost)
    targets = {f"smart_turn_beats_silence_{e}": {
        "value": f"cut-offs {m['false_cut_offs']} vs {s['false_cut_offs']}, latency p50 {m['latency_ms_p50']} vs {s['latency_ms_p50']} ms",
        "goal": "fewer false cut-offs at no more latency, or no more cut-offs at less latency",
        "met": (m["false_cut_offs"] < s["false_cut_offs"] and (m["latency_ms_p50"] or 0) <= (s["latency_ms_p50"] or 0) + 1e-9)
        or (m["false_cut_offs"] <= s["false_cut_offs"] and (m["latency_ms_p50"] or 0) < (s["latency_ms_p50"] or 0)),
    } for e, (s, m) in pairs.items()}
    result = {"schema": "omni-rt.latency_bench.turns/1", "at": utc_now(),
              "config": {"model": str(path), "threads": args.threads, "eagerness": eagerness, "step_ms": STEP_MS, "vad": "silero-vad",
                         "cases": len(CASES), "paused_cases": sum(1 for c in CASES if c[1])},
              "machine": machine_info(), "detectors": results, "model_cost": cost, "targets": targets}
    finish(args.json, result)
    return 0
