"""Video jobs (/v1/videos with the official openai SDK) and live generation with
prompt edits (/v1/realtime/video) on the shared server."""

from __future__ import annotations

import asyncio
import io
import json
import time
from typing import Any

import av
import openai
import pytest
from websockets.asyncio.client import connect

from testkit.harness import ADMIN_HEADERS, ADMIN_KEY, http_client

# (the openai SDK marks its Sora client deprecated; the wire API is what is tested)
pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]


def sdk(server, key: str = ADMIN_KEY) -> Any:  # sizes and lengths the SDK's types do not list
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def engine_load(server) -> int:
    with http_client(server.url, ADMIN_HEADERS) as http:
        return http.get("/health").json()["stages"]["video_dit"]["replicas"][0]["engine"]["load"]


def test_sdk_job_reports_progress_and_its_mp4_decodes(server):
    c = sdk(server)
    # the video pipeline's tiny Wan: 12 frames asked, a 13-frame clip made (4k+1), 12 sent
    v = c.videos.create(prompt="a paper boat on a river", seconds="2", size="64x48", extra_body={"fps": 6, "seed": 3, "steps": 50})
    assert v.object == "video" and v.status in ("queued", "in_progress") and v.size == "64x48" and v.seconds == "2"
    progress = [v.progress]
    while v.status in ("queued", "in_progress"):
        time.sleep(0.01)
        v = c.videos.retrieve(v.id)
        progress.append(v.progress)
    assert v.status == "completed" and v.progress == 100 and v.completed_at
    assert progress == sorted(progress) and len(set(progress)) > 2  # visible while it ran, never backwards
    data = c.videos.download_content(v.id).read()
    with av.open(io.BytesIO(data)) as movie:
        frames = [f.to_ndarray(format="rgb24") for f in movie.decode(video=0)]
    assert len(frames) == 12 and frames[0].shape == (48, 64, 3)
    assert v.id in [x.id for x in c.videos.list().data]


async def live(server):
    ws = await connect(server.url.replace("http://", "ws://") + "/v1/realtime/video",
                       additional_headers={"Authorization": f"Bearer {ADMIN_KEY}"}, max_size=None)
    assert json.loads(await ws.recv())["type"] == "session.created"
    return ws


async def events_until(ws, types, seen):
    while True:
        ev = json.loads(await asyncio.wait_for(ws.recv(), 120))
        seen.append(ev)
        if ev["type"] in types:
            return ev


async def test_a_prompt_edit_takes_effect_at_the_next_boundary_with_no_stale_frames(server):
    ws = await live(server)
    try:
        await ws.send(json.dumps({"type": "session.update", "session": {"prompt": "a cat", "width": 64, "height": 64, "steps": 6, "chunk_frames": 4, "seed": 1}}))
        await ws.send(json.dumps({"type": "generation.start", "frames": 16}))
        seen: list = []
        while True:
            ev = await events_until(ws, {"video.frame"}, seen)
            if ev["frame_index"] == 5:
                break
        await ws.send(json.dumps({"type": "prompt_update", "prompt": "a dog"}))
        after: list = []
        ack = await events_until(ws, {"prompt_update.applied"}, after)
        done = await events_until(ws, {"generation.done"}, after)
        later = [e for e in after[after.index(ack) + 1 :] if e["type"] == "video.frame"]
        assert ack["prompt_version"] == 1 and later and all(e["prompt_version"] == 1 for e in later)
        frames = [e["frame_index"] for e in seen + after if e["type"] == "video.frame"]
        assert frames == list(range(16)) and done["frames"] == 16  # no frame lost or repeated
        assert later[0]["frame_index"] == ack["from_frame"]
        # cancel: nothing of the generation after generation.cancelled
        await ws.send(json.dumps({"type": "generation.start", "frames": 40}))
        await events_until(ws, {"video.frame"}, [])
        await ws.send(json.dumps({"type": "generation.cancel"}))
        tail: list = []
        await events_until(ws, {"generation.cancelled"}, tail)
        await ws.send(json.dumps({"type": "session.update", "session": {"steps": 2}}))
        await events_until(ws, {"session.updated"}, tail)
        assert not [e for e in tail[tail.index(next(e for e in tail if e["type"] == "generation.cancelled")) + 1 :] if e["type"].startswith(("video.", "generation."))]
    finally:
        await ws.close()


