"""Live video editing bench: how soon a prompt edit shows in the stream.

Each trial opens `/v1/realtime/video`, starts a generation (64x64 unless `--size`,
chunks of `--chunk-frames`), waits for frame `--edit-after`, sends `prompt_update` and
measures: edit sent → `prompt_update.applied`, and edit sent → the first frame
rendered under the new prompt. Also the frame rate while generating.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from websockets.asyncio.client import connect

from latency_bench import finish, machine_info, utc_now
from latency_bench.stats import summarize

SCHEMA = "omni-rt.latency_bench.video_edit/1"


async def _trial(url: str, api_key: str | None, i: int, size: int, steps: int | None, chunk: int, edit_after: int) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with connect(url, additional_headers=headers, max_size=None) as ws:
        json.loads(await ws.recv())
        session = {"prompt": "a quiet street", "width": size, "height": size, "chunk_frames": chunk, "seed": i, **({"steps": steps} if steps else {})}
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        await ws.send(json.dumps({"type": "generation.start", "frames": edit_after + 3 * chunk}))
        t_start = time.perf_counter()
        t_edit = t_ack = t_first = None
        frames = 0
        while True:
            ev = json.loads(await asyncio.wait_for(ws.recv(), 120))
            now = time.perf_counter()
            if ev["type"] == "error":
                return {"ok": False, "error": ev["error"]["message"]}
            if ev["type"] == "video.frame":
                frames += 1
                if ev["frame_index"] == edit_after and t_edit is None:
                    t_edit = time.perf_counter()
                    await ws.send(json.dumps({"type": "prompt_update", "prompt": "the same street in snow"}))
                elif t_edit is not None and ev["prompt_version"] == 1 and t_first is None:
                    t_first = now
            elif ev["type"] == "prompt_update.applied":
                t_ack = now
            elif ev["type"] == "generation.done":
                break
        wall = time.perf_counter() - t_start
    if t_edit is None or t_ack is None or t_first is None:
        return {"ok": False, "error": "the edit was not observed"}
    return {"ok": True, "edit_to_ack_s": t_ack - t_edit, "edit_to_first_new_frame_s": t_first - t_edit, "fps": frames / wall}


def main_video_edit(args: Any) -> int:
    from latency_bench.server import bench_url

    async def go(url: str) -> list[dict[str, Any]]:
        return [await _trial(url, args.api_key, i, args.size, args.steps, args.chunk_frames, args.edit_after) for i in range(args.trials)]

    with bench_url(args, "video-edit", "ws", "/v1/realtime/video") as url:
        trials = asyncio.run(go(url))
    ok = [t for t in trials if t["ok"]]
    result = {
        "schema": SCHEMA, "created": utc_now(), "machine": machine_info(), "url": url, "size": args.size, "steps": args.steps,
        "chunk_frames": args.chunk_frames, "trials": len(trials), "failed": len(trials) - len(ok),
        "errors": sorted({t["error"] for t in trials if not t["ok"]}),
        "edit_to_ack_s": summarize([t["edit_to_ack_s"] for t in ok]),
        "edit_to_first_new_frame_s": summarize([t["edit_to_first_new_frame_s"] for t in ok]),
        "frames_per_s": summarize([t["fps"] for t in ok]),
    }
    f = lambda d, k: f"{d[k] * 1000:.1f}" if d.get(k) is not None else "-"  # noqa: E731
    print(f"video edit ({len(ok)}/{len(trials)} trials, {args.size}x{args.size}, chunks of {args.chunk_frames})")
    print(f"edit -> applied ms p50 {f(result['edit_to_ack_s'], 'p50')}; edit -> first new-prompt frame ms p50 "
          f"{f(result['edit_to_first_new_frame_s'], 'p50')} p90 {f(result['edit_to_first_new_frame_s'], 'p90')}; "
          f"frames/s p50 {result['frames_per_s'].get('p50')}")
    finish(args.json, result)
    return 1 if result["failed"] else 0
