"""Video jobs (/v1/videos with the official openai SDK) and live generation with
prompt edits (/v1/realtime/video) on the shared server."""

from __future__ import annotations

import asyncio
import io
import json
import time

import av
import openai
import pytest
from websockets.asyncio.client import connect

from tests.harness import ADMIN_HEADERS, ADMIN_KEY, LIMITED_KEY, http_client

# (the openai SDK marks its Sora client deprecated; the wire API is what is tested)
pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]


def sdk(server, key: str = ADMIN_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def engine_load(server) -> int:
    with http_client(server.url, ADMIN_HEADERS) as http:
        return http.get("/health").json()["stages"]["video_dit"]["replicas"][0]["engine"]["load"]


def test_sdk_job_reports_progress_and_its_mp4_decodes(server):
    c = sdk(server)
    v = c.videos.create(prompt="a paper boat on a river", seconds="2", size="64x48", extra_body={"fps": 6, "seed": 3})
    assert v.object == "video" and v.status in ("queued", "in_progress") and v.size == "64x48" and v.seconds == "2"
    progress = [v.progress]
    while v.status in ("queued", "in_progress"):
        time.sleep(0.1)
        v = c.videos.retrieve(v.id)
        progress.append(v.progress)
    assert v.status == "completed" and v.progress == 100 and v.completed_at
    assert progress == sorted(progress) and len(set(progress)) > 2  # visible while it ran, never backwards
    data = c.videos.download_content(v.id).read()
    with av.open(io.BytesIO(data)) as movie:
        frames = [f.to_ndarray(format="rgb24") for f in movie.decode(video=0)]
    assert len(frames) == 12 and frames[0].shape == (48, 64, 3)
    assert v.id in [x.id for x in c.videos.list().data]


def test_deleting_a_running_job_stops_its_work_and_frees_its_slot(server):
    c = sdk(server, LIMITED_KEY)  # principal "limited": one session at a time
    v = c.videos.create(prompt="a long clip", seconds="12", size="128x128")
    time.sleep(0.5)
    assert c.videos.retrieve(v.id).status == "in_progress"
    with pytest.raises(openai.RateLimitError):
        c.videos.create(prompt="a second one", seconds="1", size="64x64")
    assert c.videos.delete(v.id).deleted
    for _ in range(50):
        if engine_load(server) == 0:
            break
        time.sleep(0.1)
    assert engine_load(server) == 0
    with pytest.raises(openai.NotFoundError):
        c.videos.retrieve(v.id)
    short = c.videos.create(prompt="the slot came back", seconds="1", size="64x64", extra_body={"fps": 2})
    c.videos.delete(short.id)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "size": "100x100"}, "size"),
        ({"prompt": "x", "size": "4096x4096"}, "size"),
        ({"prompt": "x", "seconds": "40"}, "seconds"),
        ({"prompt": "x", "seconds": "four"}, "seconds"),
        ({"prompt": "x", "fps": 0}, "fps"),
        ({"prompt": "x", "steps": -1}, "steps"),
        ({"prompt": "x", "model": "no-such-model"}, "model"),
        ({"prompt": "x", "colour": "red"}, "colour"),
        ({"seconds": "1"}, "prompt"),
    ],
)
def test_bad_job_requests_are_400s_naming_the_field(server, body, param):
    with http_client(server.url, ADMIN_HEADERS) as http:
        r = http.post("/v1/videos", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


def test_unknown_and_unfinished_videos(server):
    with http_client(server.url, ADMIN_HEADERS) as http:
        assert http.get("/v1/videos/video_nope").status_code == 404
        assert http.delete("/v1/videos/video_nope").status_code == 404
        v = http.post("/v1/videos", json={"prompt": "x", "seconds": "6", "size": "128x128"}).json()
        r = http.get(f"/v1/videos/{v['id']}/content")
        assert r.status_code == 409 and r.json()["error"]["code"] == "video_not_ready"
        assert http.delete(f"/v1/videos/{v['id']}").json()["deleted"] is True


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


@pytest.mark.parametrize(
    "event, code",
    [
        ({"type": "generation.start", "frames": 0}, "invalid_value"),
        ({"type": "generation.start"}, "invalid_value"),
        ({"type": "session.update", "session": {"width": 30}}, "invalid_value"),
        ({"type": "session.update", "session": {"fps": 3}}, "unknown_parameter"),
        ({"type": "prompt_update", "prompt": 5}, "invalid_value"),
        ({"type": "generation.cancel"}, "no_active_generation"),
        ({"type": "no.such.event"}, "invalid_event"),
    ],
)
async def test_bad_live_events_get_error_events(server, event, code):
    ws = await live(server)
    try:
        await ws.send(json.dumps(event))
        err = await events_until(ws, {"error"}, [])
        assert err["error"]["code"] == code, err
        await ws.send("{nope")
        assert (await events_until(ws, {"error"}, []))["error"]["code"] == "invalid_json"
        await ws.send(json.dumps({"type": "session.update", "session": {"width": 64, "height": 64, "steps": 2}}))
        await ws.send(json.dumps({"type": "generation.start", "frames": 2}))
        assert (await events_until(ws, {"generation.done"}, []))["frames"] == 2
    finally:
        await ws.close()
