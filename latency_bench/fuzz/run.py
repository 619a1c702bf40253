"""A seeded mutation fuzzer for every wire: ``python -m latency_bench fuzz``.

For each protocol the server mounts, valid seed messages are mutated (fields dropped or
replaced with wrong types: null, bool, a 5000-digit integer, NaN / Infinity literals,
negatives, nested objects and arrays, very long strings, a lone surrogate written as a
JSON escape; ~1000-level nesting; truncated / invalid JSON and invalid UTF-8; binary
frames where text is expected and the reverse; unknown event types; duplicate keys;
random byte flips) and sent to the server, by URL (a running ``omni-rt serve``) or to the
in-process harness (``run_fuzz(base_url, ..., harness=h)``). Each outcome is classified:

- HTTP: any 5xx is a failure; a 4xx must carry OpenAI's ``{"error": {message, type,
  param, code}}``; a 2xx body must arrive whole (a cut stream is a failure).
- JSON WebSockets (realtime GA / beta, duplex, world, live video): after every mutated
  message a probe (``{"type": "fuzz.probe", "event_id": …}``, an unknown event) must be
  answered with an ``error`` event that echoes its ``event_id``. A close of the socket
  where the protocol promises an ``error`` event is a failure (the one exception is
  a text frame that is not UTF-8, which RFC 6455 makes the transport fail), so is
  an ``error`` event for a fault of ours (``internal_error``) and a probe never answered.
- OpenPI: bad input is answered as openpi does it (a text frame, then close 1011 or
  1013); a close without the text, any other close code, or the generic "internal
  error" text (a fault of ours) is a failure; the client reconnects after each close.
- Leaks: after every client has closed, the server's live sessions (``GET /v1/sessions``
  with an admin key, or the harness's session manager) must go back to what they were
  before the run, within the disconnect grace (in-process the lease clock is moved on).
- Optional control robot (``--robot-hz``): an OpenPI client sending small observations
  at a fixed rate; its round-trip p99 during the run must stay ≤ 3× its p99 before.

JSON ``omni-rt.latency_bench.fuzz/1``: ``config``, ``machine``, ``protocols.{name}``
(``sent``, ``outcomes`` by kind, ``failures`` by kind, ``examples``: the first few
failing payloads (truncated repr) with what happened), ``sessions`` (leak check),
``robot`` and ``targets``.
"""


from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from collections import Counter
from collections.abc import Awaitable, Iterable
from typing import Any

import aiohttp

from latency_bench.fuzz import probe
from latency_bench.fuzz.mutate import SCHEMA
from latency_bench.fuzz.probe import LogTap, Tally, Target, fuzz_http_json, fuzz_json_ws, fuzz_openpi, fuzz_videos, fuzz_webrtc
from latency_bench.fuzz.seeds import CHAT, CHAT_AUDIO, CHAT_STREAM, IMAGE, SPEECH, duplex_binary_frames, duplex_seeds, openpi_seeds, realtime_seeds, video_seeds, world_seeds

# ---- the control robot ----------------------------------------------------------------------


class Robot:
    """An OpenPI client at a fixed rate; round trips recorded per phase."""

    def __init__(self, t: Target, hz: float) -> None:
        self.t, self.period = t, 1.0 / hz
        self.phase = "before"
        self.rtt: dict[str, list[float]] = {"before": [], "during": []}
        self.errors: list[str] = []
        self.stop = asyncio.Event()

    async def run(self) -> None:
        import msgpack

        obs = msgpack.packb(openpi_seeds()[0])
        try:
            async with self.t.http.ws_connect(self.t.url("/v1/openpi", ws=True), headers=self.t.headers, max_msg_size=0) as ws:
                await ws.receive()
                nxt = time.perf_counter()
                while not self.stop.is_set():
                    t0 = time.perf_counter()
                    await ws.send_bytes(obs)
                    msg = await asyncio.wait_for(ws.receive(), 30)
                    if msg.type is not aiohttp.WSMsgType.BINARY:
                        self.errors.append(f"{msg.type} {str(msg.data)[:200]}")
                        return
                    self.rtt[self.phase].append((time.perf_counter() - t0) * 1000)
                    nxt += self.period
                    await asyncio.sleep(max(0.0, nxt - time.perf_counter()))
        except Exception as exc:  # noqa: BLE001 - reported
            self.errors.append(repr(exc))

    def result(self) -> dict[str, Any]:
        from latency_bench.stats import summarize

        out: dict[str, Any] = {"hz": round(1 / self.period, 2), "errors": self.errors[:5]}
        for k, v in self.rtt.items():
            out[f"{k}_ms"] = summarize(v) if v else None
        b, d = out.get("before_ms"), out.get("during_ms")
        out["p99_ratio"] = round(d["p99"] / b["p99"], 3) if b and d and b.get("p99") else None
        return out


# ---- sessions -------------------------------------------------------------------------------


async def live_sessions(t: Target, harness: Any = None) -> list[dict[str, Any]]:
    if harness is not None:
        return [s.info() for s in harness.sessions.sessions()]
    async with t.http.get(t.url("/v1/sessions"), headers=t.headers) as r:
        body = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"GET /v1/sessions: {r.status} {body}")
        return list(body.get("data") or [])


async def check_leaks(t: Target, before: set[str], harness: Any, wait_s: float, grace_s: float) -> dict[str, Any]:
    def new(infos: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: s.get(k) for k in ("id", "kind", "state", "idle_s", "detached_s", "running_requests")} for s in infos if s.get("id") not in before]

    deadline = time.monotonic() + wait_s
    left = new(await live_sessions(t, harness))
    while left and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        left = new(await live_sessions(t, harness))
    lingering = left
    if left and harness is not None:  # past the disconnect grace: detached sessions expire
        await harness.expire(grace_s + 1)
        await asyncio.sleep(0.05)
        left = new(await live_sessions(t, harness))
    return {"lingering_after_close": lingering[:20], "leaked": left[:50], "leaked_count": len(left),
            "leaked_by_kind": dict(Counter(s["kind"] for s in left))}


# ---- what the server mounts -----------------------------------------------------------------

ALL = ("speech", "chat", "images", "videos", "webrtc", "realtime", "realtime-beta", "duplex", "world", "video-live", "openpi")
PATHS = {"speech": "/v1/audio/speech", "chat": "/v1/chat/completions", "images": "/v1/images/generations", "videos": "/v1/videos",
         "webrtc": "/v1/realtime/calls", "realtime": "/v1/realtime", "realtime-beta": "/v1/realtime", "duplex": "/v1/duplex",
         "world": "/v1/world", "video-live": "/v1/realtime/video", "openpi": "/v1/openpi"}


async def mounted(t: Target) -> list[str]:
    async with t.http.get(t.url("/"), headers=t.headers) as r:
        page = await r.text()
    paths = set(re.findall(r"<code>([^<]+)</code>", page))
    return [p for p in ALL if PATHS[p] in paths]


def _protocol_runs(t: Target, names: list[str], n: int, seed: int) -> list[Awaitable[Tally]]:
    def rng(name: str) -> random.Random:
        return random.Random(f"{seed}:{name}")

    runs = {
        "speech": lambda: fuzz_http_json(t, rng("speech"), "speech", "/v1/audio/speech", [SPEECH], n),
        "chat": lambda: fuzz_http_json(t, rng("chat"), "chat", "/v1/chat/completions", [CHAT, CHAT_STREAM, CHAT_AUDIO], n),
        "images": lambda: fuzz_http_json(t, rng("images"), "images", "/v1/images/generations", [IMAGE], n),
        "videos": lambda: fuzz_videos(t, rng("videos"), n),
        "webrtc": lambda: fuzz_webrtc(t, rng("webrtc"), n),
        "realtime": lambda: fuzz_json_ws(t, rng("realtime"), "realtime", "/v1/realtime", realtime_seeds(False), n),
        "realtime-beta": lambda: fuzz_json_ws(t, rng("realtime-beta"), "realtime-beta", "/v1/realtime", realtime_seeds(True), n,
                                              headers={"openai-beta": "realtime=v1"}),
        "duplex": lambda: fuzz_json_ws(t, rng("duplex"), "duplex", "/v1/duplex", duplex_seeds(), n, extra=duplex_binary_frames,
                                       close_event="session.closed"),
        "world": lambda: fuzz_json_ws(t, rng("world"), "world", "/v1/world", world_seeds(), n, close_event="session.closed"),
        "video-live": lambda: fuzz_json_ws(t, rng("video-live"), "video-live", "/v1/realtime/video", video_seeds(), n),
        "openpi": lambda: fuzz_openpi(t, rng("openpi"), n),
    }
    return [runs[name]() for name in names]


async def run_fuzz(base_url: str, *, per_protocol: int = 1000, seed: int = 0, protocols: Iterable[str] | None = None,
                   api_key: str | None = None, timeout: float = 10.0, harness: Any = None, concurrent: bool = True,
                   robot_hz: float = 0.0, robot_before_s: float = 5.0, leak_wait_s: float = 40.0, grace_s: float = 30.0) -> dict[str, Any]:
    """Fuzz the server at `base_url` (http://host:port); `harness`: the in-process one
    (its session manager is read and its lease clock moved for the leak check)."""
    t_start = time.perf_counter()
    tap = LogTap()
    logging.getLogger().addHandler(tap)
    probe.TAP = tap
    try:
        res = await _run_fuzz(base_url, per_protocol, seed, protocols, api_key, timeout, harness, concurrent, robot_hz,
                              robot_before_s, leak_wait_s, grace_s)
    finally:
        logging.getLogger().removeHandler(tap)
        probe.TAP = None
    res["server_exceptions"] = dict(tap.counts.most_common())  # in-process only: what the server logged
    res["seconds"] = round(time.perf_counter() - t_start, 2)
    return res


async def _run_fuzz(base_url: str, per_protocol: int, seed: int, protocols: Iterable[str] | None, api_key: str | None, timeout: float,
                    harness: Any, concurrent: bool, robot_hz: float, robot_before_s: float, leak_wait_s: float,
                    grace_s: float) -> dict[str, Any]:
    conn = aiohttp.TCPConnector(limit=64, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as http:
        t = Target(base_url, http, api_key, timeout)
        names = list(protocols) if protocols is not None else await mounted(t)
        before = {s["id"] for s in await live_sessions(t, harness)}
        robot: Robot | None = None
        robot_task = None
        if robot_hz > 0 and "openpi" in await mounted(t):
            robot = Robot(t, robot_hz)
            robot_task = asyncio.ensure_future(robot.run())
            await asyncio.sleep(robot_before_s)
            before = {s["id"] for s in await live_sessions(t, harness)}
            robot.phase = "during"
        runs = _protocol_runs(t, names, per_protocol, seed)
        if concurrent:
            tallies = await asyncio.gather(*runs)
        else:
            tallies = [await r for r in runs]
        robot_result = None
        if robot is not None and robot_task is not None:
            robot.stop.set()
            await asyncio.gather(robot_task, return_exceptions=True)
            robot_result = robot.result()
        leaks = await check_leaks(t, before, harness, leak_wait_s, grace_s)
    protos = {tl.name: tl.result() for tl in tallies}
    targets: dict[str, Any] = {
        "http_5xx": {"value": sum(p["failures"].get("http_5xx", 0) for p in protos.values()), "goal": "== 0"},
        "ws_close_instead_of_error": {"value": sum(p["failures"].get("ws_close", 0) + p["failures"].get("ws_close_without_text", 0)
                                                   for p in protos.values()), "goal": "== 0"},
        "all_failures": {"value": sum(p["failed"] for p in protos.values()), "goal": "== 0"},
        "leaked_sessions": {"value": leaks["leaked_count"], "goal": "== 0"},
    }
    for v in targets.values():
        v["met"] = v["value"] == 0
    if robot_result is not None:
        ratio = robot_result.get("p99_ratio")
        targets["robot_p99_during_over_before"] = {"value": ratio, "goal": "<= 3", "met": None if ratio is None else ratio <= 3}
    return {"protocols": protos, "sessions": leaks, "robot": robot_result, "targets": targets}


def summary_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    for name, p in result["protocols"].items():
        fails = ", ".join(f"{k} {v}" for k, v in p["failures"].items()) or "none"
        lines.append(f"{name:14s} sent {p['sent']:5d} in {p['seconds']:6.2f}s  failures: {fails}")
    s = result["sessions"]
    lines.append(f"sessions leaked: {s['leaked_count']} {s['leaked_by_kind']}")
    if result.get("server_exceptions"):
        lines.append("server exceptions (in-process, by where raised):")
        lines += [f"  {n:5d}  {sig}" for sig, n in result["server_exceptions"].items()]
    return lines


def failure_report(result: dict[str, Any]) -> str:
    out = []
    for name, p in result["protocols"].items():
        for kind, exs in p["examples"].items():
            for ex in exs:
                out.append(f"[{name}] {kind}: {ex['what']}\n    mutation: {ex['mutation']}\n    payload ({ex['frame']}): {ex['payload']}"
                           + "".join(f"\n    server: {r}" for r in ex.get("server_log") or []))
    for s in result["sessions"]["leaked"]:
        out.append(f"[sessions] leaked: {s}")
    return "\n".join(out)


# ---- CLI ------------------------------------------------------------------------------------


async def _in_process(args: Any, names: list[str] | None) -> dict[str, Any]:
    from testkit import Speeds, serve

    async with serve(["voice", "tts", "image", "world", "video", "video_edit", "robot"], speeds=Speeds(token_s=0.0)) as h:
        return await run_fuzz(h.url(""), per_protocol=args.per_protocol, seed=args.seed, protocols=names, timeout=args.timeout,
                              harness=h, concurrent=not args.sequential, robot_hz=args.robot_hz, robot_before_s=args.robot_before,
                              leak_wait_s=2.0, grace_s=float(h.sessions.spec.disconnect_grace_s))


def main_fuzz(args: Any) -> int:
    from latency_bench import finish, machine_info, utc_now

    names = [p.strip() for p in args.protocols.split(",")] if args.protocols else None
    if names:
        bad = [p for p in names if p not in ALL]
        if bad:
            print(f"error: unknown protocol(s) {bad}; known: {', '.join(ALL)}")
            return 2
    config = {"url": args.url or "(in-process harness, fake engines)", "per_protocol": args.per_protocol, "seed": args.seed,
              "protocols": names or "all mounted", "timeout_s": args.timeout, "concurrent": not args.sequential,
              "robot_hz": args.robot_hz, "robot_before_s": args.robot_before}
    if args.url:
        res = asyncio.run(run_fuzz(args.url, per_protocol=args.per_protocol, seed=args.seed, protocols=names, api_key=args.api_key,
                                   timeout=args.timeout, concurrent=not args.sequential, robot_hz=args.robot_hz,
                                   robot_before_s=args.robot_before, leak_wait_s=args.leak_wait, grace_s=args.leak_wait))
    else:
        res = asyncio.run(_in_process(args, names))
    result = {"schema": SCHEMA, "created": utc_now(), "config": config, "machine": machine_info(), **res}
    for line in summary_lines(result):
        print(line)
    report = failure_report(result)
    if report:
        print("\nfailures (first examples per kind):\n" + report)
    finish(args.json, result)
    return 0
