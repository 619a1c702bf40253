"""Video: asynchronous jobs (`/v1/videos`, OpenAI's Videos API; wire `videos`, the
`video` pipeline) and live generation with prompt edits (`/v1/realtime/video`; wire
`video_live`, the `video_edit` pipeline).

Jobs. `POST /v1/videos` (JSON, or multipart form fields as the openai SDK sends them):
`prompt` (required), `model`, `seconds` ("1".."12", default "4"), `size` (`WxH`,
multiples of 16 up to 512; default 128x128), plus `fps` (default 8), `seed`, `steps`.
The clip has `seconds` × `fps` frames, at most the model's `max_frames` (400 above).
→ the video object `{id, object: "video", model, status: queued|in_progress|completed|
failed, progress (0-100), created_at, completed_at, size, seconds, prompt, error}`.
Each job is a `video` session (429 `session_limit` over a cap) that ends, freeing its
slot, when the job completes, fails or is deleted. `GET /v1/videos` (yours; admins
all), `GET /v1/videos/{id}` (progress while it runs), `GET /v1/videos/{id}/content`
(`video/mp4`, H.264 by PyAV; 409 `video_not_ready` before completion), `DELETE
/v1/videos/{id}` (a running job stops at the next denoising step).

Live (WebSocket `/v1/realtime/video`, JSON events): server first `session.created
{session}`. Client: `session.update {session: {prompt, width, height, steps, seed,
chunk_frames, image_format}}` → `session.updated`; `generation.start {frames}` →
`generation.started {generation_id, frames}`, then per frame `video.frame
{generation_id, frame_index, prompt_version, format, width, height, image: base64}`
and `generation.progress {frames_done, frames}`, finally `generation.done`;
`prompt_update {prompt}` → `prompt_update.applied {prompt_version, from_frame}`: the
running chunk is cancelled (fenced: no frame rendered under the old prompt arrives
after this event) and generation continues from the next frame with the new prompt;
`generation.cancel` → `generation.cancelled`. Errors: `error` events, the socket stays
open. Each connection is a `video` session.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from omni_rt.errors import ClientError
from protocols.auth import principal_of
from protocols.http import json_response, read_form, read_json, validate_body
from protocols.registry import Mount
from protocols.videos.jobs import VideoCreate, VideoJobs, VideoModel
from protocols.videos.live import VideoConnection
from protocols.ws import accept, close_attachment, numbered_json, reject, serve_events
from sessions import SessionError


def mount(m: Mount) -> None:
    """OpenAI's Videos API: `/v1/videos` jobs on this pipeline."""
    sessions, pipeline, model = m.sessions, m.pipeline, m.processor(VideoModel)
    jobs = VideoJobs(sessions, pipeline, model.describe, getattr(model, "prompt_tokens", None))

    async def create(request: web.Request) -> web.StreamResponse:
        raw: Any
        if request.content_type in ("multipart/form-data", "application/x-www-form-urlencoded"):
            raw = await read_form(request)
            files = [k for k, v in raw.items() if not isinstance(v, str)]
            if files:
                raise ClientError(f"File fields are not supported ({', '.join(files)}).", param=files[0])
        else:
            raw = await read_json(request)
        job = await jobs.create(validate_body(VideoCreate, raw), principal_of(request).name)
        return json_response(job.wire())

    async def list_videos(request: web.Request) -> web.StreamResponse:
        p = principal_of(request)
        data = [j.wire() for j in sorted(jobs.jobs.values(), key=lambda j: j.created_at, reverse=True) if p.admin or j.principal == p.name]
        return json_response({"object": "list", "data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
                              "last_id": data[-1]["id"] if data else None})

    async def get_video(request: web.Request) -> web.StreamResponse:
        return json_response(jobs.get(request.match_info["video_id"], principal_of(request)).wire())

    async def content(request: web.Request) -> web.StreamResponse:
        video_id = request.match_info["video_id"]
        job = jobs.get(video_id, principal_of(request))
        variant = request.query.get("variant", "video")
        if variant != "video":
            raise ClientError(f"Unsupported variant '{variant}'; this server has 'video'.", param="variant")
        if job.mp4 is None:
            raise ClientError(f"Video '{video_id}' is {job.status}; its content is ready when it has completed.", code="video_not_ready", http_status=409)
        return web.FileResponse(job.mp4, headers={"Content-Type": "video/mp4"})  # Range and If-Range as files are served

    async def delete(request: web.Request) -> web.StreamResponse:
        job = jobs.get(request.match_info["video_id"], principal_of(request))
        await jobs.delete(job)
        return json_response({"id": job.id, "object": "video.deleted", "deleted": True})

    m.route("POST", "/v1/videos", create, "video jobs (OpenAI); GET/DELETE /v1/videos/{id}, …/content")
    m.route("GET", "/v1/videos", list_videos)
    m.route("GET", "/v1/videos/{video_id}", get_video)
    m.route("GET", "/v1/videos/{video_id}/content", content)
    m.route("DELETE", "/v1/videos/{video_id}", delete)


def mount_live(m: Mount) -> None:
    """`/v1/realtime/video`: live generation with prompt edits on this pipeline."""
    sessions, pipeline, model = m.sessions, m.pipeline, m.processor(VideoModel)

    async def live(request: web.Request) -> web.StreamResponse:
        try:
            session = await sessions.open("video", pipeline.name, principal=principal_of(request).name)
        except SessionError as exc:
            return await reject(request, exc)
        conn = VideoConnection(session, model.describe(), getattr(model, "prompt_tokens", None))
        try:
            sock = await accept(request)
        except BaseException:
            await sessions.end(session, "client_disconnected")
            raise
        conn.emit("session.created", session=conn.wire())

        async def on_message(data: str | bytes) -> bool:
            await conn.handle(data)
            return True

        async def on_exit(why: str) -> None:
            await conn.cancel()
            await sessions.end(session, "server_error" if why == "server_error" else "client_disconnected")

        why = await serve_events(sock, session, numbered_json(), on_message, on_exit)
        await close_attachment(sock, session, why)
        return sock.ws

    m.websocket("/v1/realtime/video", live, "live video generation with prompt edits")
