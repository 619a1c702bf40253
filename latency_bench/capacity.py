"""Admission against the machine's real capacity (`python -m latency_bench capacity`).

1. **Oracle**: a server with load-aware admission off; levels of N paced voice sessions
   over `/v1/duplex` arriving at once, each speaking `--turns` turns (espeak-ng speech,
   server VAD), N = `--start`, +`--step`, ... until a level has a session with a stall
   over 100 ms (or a failed turn); the oracle capacity is the largest N whose every
   session ran clean, the level after it re-tried one session at a time down to it.
2. **Burst** at a freshly started server with admission on (its defaults, so its
   start-up calibration): N + 4 sessions at once; how many it admits, and whether
   every admitted one ran clean.
3. **Ramp** on that server: a new session every `--ramp-every` s up to N + 4; the
   peak of open voice sessions, refusals, stalls.
4. **Slow reader** on that server: one client asks for a long paced answer and stops
   reading (4 KiB receive buffer), then N - 1 others open and speak: how many are
   admitted, and whether it refused anyone (it must not).
Beside them, the server's own event-loop lag per level (`omni_rt_event_loop_lag_seconds`)
and the server process's CPU per paced session (its front end: VAD, resampling,
pacing, framing, plus its in-process torch stages; the vLLM engine processes apart).

Goals: burst admitted >= 0.9 x oracle with 0 stalls in every admitted session, ramp peak
>= 0.9 x oracle with 0 stalls, the slow reader refuses no one.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import yaml

from latency_bench import finish, machine_info, utc_now
from latency_bench.duplex import _line, run_level, run_ramp
from latency_bench.machine import metrics_text, underruns_between

SCHEMA = "omni-rt.latency_bench.capacity/1"
ROOM_OVER_ORACLE = 4
CLEAN = "every session 0 stalls > 100 ms, no failed turn"


def _clean(level: dict[str, Any]) -> bool:
    return level["admitted"] == level["sessions"] and level["failed"] == 0 and not level["errors"] and \
        all(s["stalls_over_100ms"] == 0 and s["failed"] == 0 for s in level["per_session"])


def _overlay(deploy: str | None, admission: dict[str, Any], out: Path) -> Path:
    data: dict[str, Any] = yaml.safe_load(Path(deploy).read_text()) if deploy else {}
    data = data or {}
    sessions = dict(data.get("sessions") or {})
    sessions["realtime_admission"] = {**(sessions.get("realtime_admission") or {}), **admission}
    data["sessions"] = sessions
    out.write_text(yaml.safe_dump(data))
    return out


def _main_cpu(server: Any) -> float | None:
    """CPU seconds of the server's own process (not its engine processes)."""
    ps = getattr(server, "_ps", None)
    if ps is None:
        return None
    t = ps.cpu_times()
    return float(t.user + t.system)


def _engine_seconds(text: str | None) -> float:
    """The in-process torch / diffusers engines' step time so far (their busy seconds)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text or "") for s in f.samples if s.name == "omni_rt_engine_step_seconds_sum")


async def _level(base: str, key: str | None, n: int, turns: int, pcm: bytes, tokens: int, server: Any) -> dict[str, Any]:
    m0 = await metrics_text(base, key)
    cpu0, t0 = _main_cpu(server), time.monotonic()
    lvl = await run_level("ws", base, key, n, turns, pcm, tokens, server._ps if server is not None else None)
    cpu1, wall = _main_cpu(server), time.monotonic() - t0
    engines = _engine_seconds(await metrics_text(base, key)) - _engine_seconds(m0)
    if cpu0 is not None and cpu1 is not None and lvl["admitted"]:
        lvl["server_process_cpu_cores_per_session"] = round((cpu1 - cpu0) / wall / lvl["admitted"], 4)
        # less the in-process engines' step time (torch runs them on torch_threads threads:
        # at 1, a step's wall time is its CPU time): the front end's own
        lvl["front_end_cpu_cores_per_session"] = round(max(0.0, cpu1 - cpu0 - engines) / wall / lvl["admitted"], 4)
        lvl["in_process_engine_busy_s"] = round(engines, 3)
    lvl["clean"] = _clean(lvl)
    return {k: v for k, v in lvl.items() if k != "samples"}


async def slow_reader(url: str, headers: dict[str, str] | None = None) -> Any:
    """A WebSocket client that stops reading when told nothing: its socket's receive
    buffer is 4 KiB and it takes at most one message off it unasked (`max_queue=1`: the
    library stops reading the socket while a message waits), so once the caller stops
    calling `recv`, the server's sends to it wait."""
    from urllib.parse import urlsplit

    import websockets

    u = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (u.hostname or "127.0.0.1", u.port or 80))
    return await websockets.connect(url, sock=sock, max_queue=1, compression=None, max_size=None, additional_headers=headers or {})


async def _slow_reader(base: str, key: str | None, others: int, turns: int, pcm: bytes, tokens: int) -> dict[str, Any]:
    """One client that asks for a long paced answer and reads nothing more, then
    `others` sessions open and speak."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    ws = await slow_reader(base.replace("http", "ws", 1) + "/v1/duplex", headers)
    first = json.loads(await ws.recv())
    if first.get("type") != "session.created":
        ws.transport.abort()
        return {"error": f"the slow reader was not admitted: {first}"}
    for ev in ({"type": "session.update", "session": {"turn_detection": None, "max_output_tokens": 4096,
                                                      "audio": {"output": {"transport": "binary", "pacing": "realtime"}}}},
               {"type": "conversation.item.create",
                "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me a long story."}]}},
               {"type": "response.create", "response": {"max_output_tokens": 4096}}):
        await ws.send(json.dumps(ev))
    before = await metrics_text(base, key)
    await asyncio.sleep(5.0)  # its answer starts; its socket and the server's fill
    lvl = await run_level("ws", base, key, others, turns, pcm, tokens, None)
    held = underruns_between(before, await metrics_text(base, key)).get("client", {})
    ws.transport.abort()
    return {"others": others, "admitted": lvl["admitted"], "refused": lvl["refused"], "refusals": lvl["refusals"],
            "admitted_with_stalls": lvl["admitted_sessions_with_stalls_over_100ms"], "server_underruns": lvl["server_underruns"],
            "slow_readers_holes": held, "server_loop_lag": lvl["server_loop_lag"]}


def _serve(port: int, deploy: Path, log: Path) -> Any:
    from latency_bench.server import ServerProcess

    server = ServerProcess(port=port, deploy=deploy, log_path=log, env=dict(os.environ))
    server.start()
    server.wait_ready(timeout_s=900)
    return server


def main_capacity(args: Any) -> int:
    import shutil

    if args.wav is None and shutil.which("espeak-ng") is None:
        print("error: the capacity bench speaks to the server's VAD: install espeak-ng or pass --wav")
        return 2
    out_dir = Path(args.json).parent if args.json else Path("bench-out")
    out_dir.mkdir(parents=True, exist_ok=True)
    pcm, source = _line(args.wav)
    key = args.api_key
    result: dict[str, Any] = {"schema": SCHEMA, "created": utc_now(), "machine": machine_info(), "utterance": source,
                              "config": {"turns": args.turns, "max_output_tokens": args.max_output_tokens, "start": args.start, "step": args.step,
                                         "max_sessions": args.max_sessions, "ramp_every_s": args.ramp_every, "deploy": args.deploy}}
    base = f"http://127.0.0.1:{args.port}"

    # 1. the oracle: admission off
    server = _serve(args.port, _overlay(args.deploy, {"enabled": False}, out_dir / "capacity-oracle.yaml"), out_dir / "capacity-oracle.log")
    levels: list[dict[str, Any]] = []
    try:
        async def oracle() -> int:
            await run_level("ws", base, key, 1, 1, pcm, args.max_output_tokens, None)  # warm-up
            best, n = 0, args.start
            while n <= args.max_sessions:
                lvl = await _level(base, key, n, args.turns, pcm, args.max_output_tokens, server)
                levels.append(lvl)
                print(f"oracle: {n} sessions at once -> {'clean' if lvl['clean'] else 'stalls/failures'}", flush=True)
                if not lvl["clean"]:
                    break
                best, n = n, n + args.step
            for m in range(min(n, args.max_sessions + 1) - 1, best, -1):  # between the last clean level and the first that was not
                lvl = await _level(base, key, m, args.turns, pcm, args.max_output_tokens, server)
                levels.append(lvl)
                print(f"oracle: {m} sessions at once -> {'clean' if lvl['clean'] else 'stalls/failures'}", flush=True)
                if lvl["clean"]:
                    return m
            return best

        n_oracle = asyncio.run(oracle())
    finally:
        server.stop()
    result["oracle"] = {"capacity": n_oracle, "definition": f"the largest N of paced sessions at once, {args.turns} turns each, {CLEAN}, admission off",
                        "levels": levels}
    offered = n_oracle + ROOM_OVER_ORACLE

    # 2-4. a freshly started server with admission on
    server = _serve(args.port, _overlay(args.deploy, {}, out_dir / "capacity-admission.yaml"), out_dir / "capacity-admission.log")
    try:
        async def admitted() -> dict[str, Any]:
            import httpx

            async with httpx.AsyncClient(timeout=10) as http:
                adm = (await http.get(base + "/health", headers={"Authorization": f"Bearer {key}"} if key else {})).json()["sessions"]["realtime_admission"]
            burst = await _level(base, key, offered, args.turns, pcm, args.max_output_tokens, server)
            print(f"burst of {offered} at a cold server: admitted {burst['admitted']}, refused {burst['refused']}", flush=True)
            await asyncio.sleep(10)  # the burst's streams leave admission's window
            ramp = await run_ramp("ws", base, key, offered, args.ramp_every, args.turns, pcm, args.max_output_tokens)
            ramp = {k: v for k, v in ramp.items() if k != "health"}
            print(f"ramp to {offered}: admitted {ramp['admitted']}, peak open {ramp['peak_open_voice_sessions']}", flush=True)
            await asyncio.sleep(10)
            slow = await _slow_reader(base, key, max(1, n_oracle - 1), args.turns, pcm, args.max_output_tokens)
            print(f"slow reader: {slow.get('admitted')} of {slow.get('others')} others admitted", flush=True)
            return {"calibration": adm.get("calibration"), "costs": adm.get("costs"), "burst": burst, "ramp": ramp, "slow_reader": slow}

        result.update(asyncio.run(admitted()))
    finally:
        server.stop()
    burst, ramp, slow = result["burst"], result["ramp"], result["slow_reader"]
    goal = 0.9 * n_oracle
    peak = ramp.get("peak_open_voice_sessions") or 0
    result["front_end"] = {
        "levels": [{k: lv.get(k) for k in ("sessions", "server_process_cpu_cores_per_session", "front_end_cpu_cores_per_session",
                                          "in_process_engine_busy_s", "wall_s")} for lv in levels],
        "note": "per admitted paced session over each oracle level: the server process's CPU (VAD, resampling, pacing, framing and the "
                "in-process torch stages), and that less the in-process engines' step time (the front end's own); the vLLM engine "
                "processes apart"}
    result["targets"] = {
        "burst_admitted_over_oracle": {"goal": ">= 0.9", "value": round(burst["admitted"] / n_oracle, 3) if n_oracle else None,
                                       "met": n_oracle > 0 and burst["admitted"] >= goal},
        "burst_admitted_clean": {"goal": "0 stalls in every admitted session", "value": burst["admitted_sessions_with_stalls_over_100ms"],
                                 "met": burst["admitted_sessions_with_stalls_over_100ms"] == 0 and burst["failed"] == 0},
        "ramp_peak_over_oracle": {"goal": ">= 0.9", "value": round(peak / n_oracle, 3) if n_oracle else None, "met": n_oracle > 0 and peak >= goal},
        "ramp_clean": {"goal": "0 stalls in every admitted session", "value": ramp["admitted_with_stalls"], "met": ramp["admitted_with_stalls"] == 0},
        "slow_reader_refuses_no_one": {"goal": "every other session admitted while its sends waited (client holes > 0)",
                                       "value": slow.get("refused"), "client_holes": (slow.get("slow_readers_holes") or {}).get("holes"),
                                       "met": slow.get("refused") == 0 and not slow.get("error") and bool((slow.get("slow_readers_holes") or {}).get("holes"))},
    }
    finish(args.json, result)
    return 0


__all__ = ["main_capacity"]
