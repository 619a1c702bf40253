"""Live-migration bench: drain node A while N duplex listeners are mid-answer, resume
them on node B, and measure what they hear.

Two servers on one Redis prefix (the voice pipeline on the tiny checkpoints unless
`--deploy`), node A on `--port`, node B on `--port + 1`. Per level N: N `/v1/duplex`
sessions on A each ask a question with real-time pacing; when every one has heard its
first audio, A is drained (`POST /admin/drain`). Each client, on `session.migrated`,
reconnects to B with its resume token, asks the next question and waits for its first
audio. Per level:

- `drain_s`: the drain's own time (A's report), and how many sessions moved;
- `resume_s`: `session.migrated` received → `session.resumed` from B;
- `gap_heard_s`: the silence a listener hears: from the end of A's answer as it plays
  out (its first audio + the audio seconds received) to B's first audio (0 when B
  speaks before A's answer has finished playing).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from clients.duplex import DuplexClient
from latency_bench import finish, machine_info, utc_now
from latency_bench.stats import summarize

SCHEMA = "omni-rt.latency_bench.migrate/1"
RATE = 24000


def _overlay(prefix: str, node: str) -> dict[str, Any]:
    import pipelines as builtin

    return {
        "sessions": {"store": "redis", "redis_prefix": prefix, "node_id": node, "realtime_admission": {"enabled": False}},
        "pipelines": {name: {"enabled": name == "voice"} for name in builtin.load_all()},
    }


def _audio_s(ev: dict[str, Any]) -> float:
    if ev["type"] == "audio.binary":
        return len(ev["audio"]) / 2 / RATE
    return 0.0


async def _listener(a: str, b: str, i: int, heard: asyncio.Event, tokens: int) -> dict[str, Any]:
    c = await DuplexClient.connect(a)
    await c.update(turn_detection=None, audio={"output": {"transport": "binary", "pacing": "realtime"}})
    await c.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"Tell me a story {i}"}]})
    await c.send("response.create", response={"max_output_tokens": tokens})
    first_a: float | None = None
    audio_a = 0.0
    while True:
        ev = await c.until({"audio.binary", "session.migrated", "connection.closed", "response.done"}, timeout=120)
        if ev["type"] == "audio.binary":
            if first_a is None:
                first_a = ev["_t"]
                heard.set()
            audio_a += _audio_s(ev)
        elif ev["type"] == "session.migrated":
            t_migrated = ev["_t"]
            break
        elif ev["type"] == "connection.closed":
            return {"ok": False, "error": f"closed {ev['code']} before session.migrated"}
    await c.close()
    c2 = await DuplexClient.connect(b, session_id=c.session_id, resume_token=c.resume_token)
    t_resumed = time.monotonic()
    await c2.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go on"}]})
    await c2.send("response.create", response={"max_output_tokens": tokens})
    ev = await c2.until("audio.binary", timeout=120)
    t_first_b = ev["_t"]
    await c2.close()
    playout_end = (first_a or t_migrated) + audio_a
    return {"ok": True, "resume_s": t_resumed - t_migrated, "gap_heard_s": max(0.0, t_first_b - playout_end),
            "migrated_after_first_audio_s": t_migrated - (first_a or t_migrated), "audio_from_a_s": audio_a}


async def run_level(a: str, b: str, http_a: str, n: int, tokens: int, timeout_s: float) -> dict[str, Any]:
    heard = [asyncio.Event() for _ in range(n)]
    tasks = [asyncio.ensure_future(_listener(a, b, i, heard[i], tokens)) for i in range(n)]
    await asyncio.wait_for(asyncio.gather(*(h.wait() for h in heard)), 120)
    async with httpx.AsyncClient(timeout=timeout_s + 60, trust_env=False) as http:
        report = (await http.post(http_a + "/admin/drain", json={"timeout_s": timeout_s})).json()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    ok = [r for r in results if isinstance(r, dict) and r.get("ok")]
    errors = sorted({str(r if not isinstance(r, dict) else r.get("error")) for r in results if not (isinstance(r, dict) and r.get("ok"))})
    return {
        "sessions": n, "moved": len(report.get("moved", [])), "failed": report.get("failed", []), "drain_s": report.get("seconds"),
        "resumed": len(ok), "errors": errors,
        "resume_s": summarize([r["resume_s"] for r in ok]), "gap_heard_s": summarize([r["gap_heard_s"] for r in ok]),
        "migrated_after_first_audio_s": summarize([r["migrated_after_first_audio_s"] for r in ok]),
    }


def main_migrate(args: Any) -> int:
    import yaml

    from latency_bench.server import ServerProcess

    levels = [int(x) for x in str(args.sessions).split(",") if x.strip()]
    if not levels or min(levels) < 1:
        print("error: --sessions levels must be >= 1")
        return 2
    log_dir = Path(args.json).parent if args.json else Path("bench-out")
    log_dir.mkdir(parents=True, exist_ok=True)
    prefix = f"omni-rt-bench-{secrets.token_hex(4)}"
    lv: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for level in levels:
            # a fresh pair per level: a drained node admits nothing more
            servers = []
            try:
                for k, node in enumerate(("a", "b")):
                    deploy = Path(tmp) / f"{node}-{level}.yaml"
                    overlay = _overlay(prefix, node)
                    if args.deploy:
                        overlay = {**yaml.safe_load(Path(args.deploy).read_text()), "sessions": overlay["sessions"]}
                    deploy.write_text(yaml.safe_dump(overlay))
                    s = ServerProcess(port=args.port + k, deploy=deploy, log_path=log_dir / f"migrate-{node}-server.log", env=dict(os.environ))
                    s.start()
                    servers.append(s)
                for s in servers:
                    s.wait_ready(timeout_s=600)
                a, b = (f"ws://127.0.0.1:{args.port + k}/v1/duplex" for k in (0, 1))
                lv.append(asyncio.run(run_level(a, b, f"http://127.0.0.1:{args.port}", level, args.tokens, args.timeout)))
            finally:
                for s in servers:
                    s.stop()
    result = {"schema": SCHEMA, "created": utc_now(), "machine": machine_info(), "tokens": args.tokens, "drain_timeout_s": args.timeout,
              "sessions": args.sessions, "levels": lv}
    print(f"{'N':>3} {'moved':>6} {'resumed':>8} {'drain s':>8} {'resume p50':>11} {'p99':>7} {'gap heard p50':>14} {'max':>7}")
    for x in lv:
        f = lambda d, k: f"{d[k]:.3f}" if d.get(k) is not None else "-"  # noqa: E731
        print(f"{x['sessions']:>3} {x['moved']:>6} {x['resumed']:>8} {x['drain_s']!s:>8} {f(x['resume_s'], 'p50'):>11} {f(x['resume_s'], 'p99'):>7} "
              f"{f(x['gap_heard_s'], 'p50'):>14} {f(x['gap_heard_s'], 'max'):>7}")
    for x in lv:
        if x["errors"] or x["failed"]:
            print(f"N={x['sessions']}: errors {json.dumps(x['errors'])} failed {json.dumps(x['failed'])}")
    finish(args.json, result)
    return 1 if any(x["resumed"] != x["sessions"] for x in lv) else 0
