"""Video on the `video_edit` pipeline: asynchronous jobs (`/v1/videos`, OpenAI's Videos
API) and live generation with prompt edits (`/v1/realtime/video`).

Jobs. `POST /v1/videos` (JSON, or multipart form fields as the openai SDK sends them):
`prompt` (required), `model`, `seconds` ("1".."12", default "4"), `size` (`WxH`,
multiples of 16 up to 512; default 128x128), plus `fps` (default 8), `seed`, `steps`.
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

import asyncio
import base64
import io
import json
import logging
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from aiohttp import web

from omni_rt.errors import ClientError, NotFound, OmniError, RequestAborted
from omni_rt.payloads import Fence
from omni_rt.specs import PipelineSpec
from protocols.auth import principal_of
from protocols.errors import to_omni
from protocols.events import EventError as WorldError
from protocols.events import JsonEvents
from protocols.http import json_response
from protocols.registry import Mount
from protocols.world import FORMATS, WorldModel, encode_frame
from protocols.ws import DISCONNECTED, Socket, accept, numbered_json, reject, write_events
from sessions import Session, SessionError, SessionManager

log = logging.getLogger("protocols.videos")

MAX_SIDE = 512
MAX_SECONDS = 12
KEEP_FINISHED = 64  # finished jobs kept (with their MP4) before the oldest is dropped


def encode_mp4(frames: list[np.ndarray], fps: int) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height = frames[0].shape[1], frames[0].shape[0]
        stream.pix_fmt = "yuv420p"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def _size(raw: Any, multiple: int, param: str = "size") -> tuple[int, int]:
    m = re.fullmatch(r"(\d{1,4})x(\d{1,4})", str(raw))
    if m is None or not all(multiple <= int(v) <= MAX_SIDE and int(v) % multiple == 0 for v in m.groups()):
        raise ClientError(f"Unsupported size '{raw}': use 'WIDTHxHEIGHT', each side a multiple of {multiple} up to {MAX_SIDE}.", param=param, code="invalid_value")
    return int(m.group(1)), int(m.group(2))


def _int(raw: Any, name: str, lo: int, hi: int) -> int:
    try:
        v = int(str(raw))
    except ValueError:
        raise ClientError(f"Invalid '{name}': {raw!r} is not an integer.", param=name, code="invalid_value") from None
    if not lo <= v <= hi:
        raise ClientError(f"Invalid '{name}': {v}; it must be between {lo} and {hi}.", param=name, code="invalid_value")
    return v


@dataclass(eq=False)
class VideoJob:
    id: str
    principal: str
    model: str
    prompt: str
    width: int
    height: int
    seconds: int
    fps: int
    seed: int
    steps: int | None
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "queued"
    progress: int = 0
    completed_at: int | None = None
    error: dict[str, str] | None = None
    mp4: bytes | None = None
    session: Session | None = None
    task: "asyncio.Task[None] | None" = None

    def wire(self) -> dict[str, Any]:
        return {
            "id": self.id, "object": "video", "model": self.model, "status": self.status, "progress": self.progress,
            "created_at": self.created_at, "completed_at": self.completed_at, "expires_at": None, "prompt": self.prompt,
            "size": f"{self.width}x{self.height}", "seconds": str(self.seconds), "remixed_from_video_id": None, "error": self.error,
        }


class VideoJobs:
    def __init__(self, sessions: SessionManager, pipeline: PipelineSpec, describe: Callable[[], dict[str, Any]]) -> None:
        self.sessions = sessions
        self.pipeline = pipeline
        self.describe = describe
        self.jobs: dict[str, VideoJob] = {}

    async def create(self, raw: dict[str, Any], principal: str) -> VideoJob:
        known = {"prompt", "model", "seconds", "size", "fps", "seed", "steps", "input_reference"}
        bad = sorted(set(raw) - known)
        if bad:
            raise ClientError(f"Unrecognized request argument supplied: {bad[0]}", param=bad[0], code="unknown_parameter")
        prompt = raw.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip() or len(prompt) > 32000:
            raise ClientError("'prompt' is required: a non-empty string of at most 32000 characters.", param="prompt", code="missing_required_parameter")
        if raw.get("input_reference") is not None:
            raise ClientError("input_reference is not supported by this server.", param="input_reference", code="invalid_value")
        model = raw.get("model") or self.pipeline.models[0]
        if model not in self.pipeline.models:
            raise ClientError(f"The model '{model}' does not exist; available: {', '.join(self.pipeline.models)}.", param="model", code="model_not_found")
        d = self.describe()
        width, height = _size(raw.get("size") or f"{d['default_size']}x{d['default_size']}", int(d["size_multiple"]))
        seconds = _int(raw.get("seconds", 4), "seconds", 1, MAX_SECONDS)
        fps = _int(raw.get("fps", 8), "fps", 1, 30)
        seed = _int(raw["seed"], "seed", 0, 2**31 - 1) if raw.get("seed") is not None else secrets.randbelow(2**31)
        steps = _int(raw["steps"], "steps", 1, int(d["max_steps"])) if raw.get("steps") is not None else None
        session = await self.sessions.open("video", self.pipeline.name, principal=principal)
        job = VideoJob(f"video_{secrets.token_hex(12)}", principal, model, prompt, width, height, seconds, fps, seed, steps, session=session)
        self.jobs[job.id] = job
        job.task = asyncio.get_running_loop().create_task(self._run(job))
        self._trim()
        return job

    async def _run(self, job: VideoJob) -> None:
        assert job.session is not None
        session, total = job.session, job.seconds * job.fps
        frames: dict[int, np.ndarray] = {}
        outcome = "failed"
        try:
            job.status = "in_progress"
            stream = session.submit({"prompt": job.prompt, "width": job.width, "height": job.height, "frames": total,
                                     "seed": job.seed, "steps": job.steps})
            stream.end_input()
            async with stream:
                async for _stage, p, _last in stream.payloads():
                    session.touch()
                    if "progress" in p.meta:
                        job.progress = min(99, int(100 * p.meta["progress"] / max(1, p.meta["total"])))
                    else:
                        frames[int(p.meta["frame_index"])] = p.arrays["image"]
            job.mp4 = await asyncio.to_thread(encode_mp4, [frames[i] for i in sorted(frames)], job.fps)
            job.status, job.progress, job.completed_at = "completed", 100, int(time.time())
            outcome = "completed"
        except OmniError as exc:
            job.status = "failed"
            job.error = {"code": "generation_failed", "message": exc.public_message()}
        except asyncio.CancelledError:
            job.status = "failed"
            job.error = {"code": "cancelled", "message": "the job was deleted"}
            outcome = "deleted"
            raise
        except Exception as exc:  # noqa: BLE001 - this job only; it must not stay in_progress
            log.exception("video job %s failed", job.id)
            job.status = "failed"
            job.error = {"code": "generation_failed", "message": f"internal error ({type(exc).__name__})"}
        finally:
            await asyncio.shield(self.sessions.end(session, outcome))
            job.session = None

    def _trim(self) -> None:
        done = [j for j in self.jobs.values() if j.status in ("completed", "failed")]
        for j in sorted(done, key=lambda j: j.created_at)[: max(0, len(done) - KEEP_FINISHED)]:
            self.jobs.pop(j.id, None)

    def get(self, job_id: str, principal: Any) -> VideoJob:
        job = self.jobs.get(job_id)
        if job is None or (not principal.admin and job.principal != principal.name):
            raise NotFound(f"Video '{job_id}' not found.", param="video_id", code="video_not_found")
        return job

    async def delete(self, job: VideoJob) -> None:
        self.jobs.pop(job.id, None)
        if job.task is not None and not job.task.done():
            job.task.cancel()
            await asyncio.gather(job.task, return_exceptions=True)


# ---- live generation with prompt edits -------------------------------------------------------


class VideoConnection(JsonEvents):
    def __init__(self, session: Session, model: dict[str, Any]) -> None:
        self.session = session
        self.model = model
        size = int(model["default_size"])
        self.cfg: dict[str, Any] = {"prompt": "", "width": size, "height": size, "steps": int(model["default_steps"]),
                                    "seed": secrets.randbelow(2**31), "chunk_frames": 4, "image_format": "jpeg"}
        self.version = 0  # prompt version
        self.task: asyncio.Task[None] | None = None
        self.gen_id: str | None = None
        self.history: list[np.ndarray] = []
        self.next_frame = 0
        self.total = 0
        self.restart = False

    def emit(self, type: str, fence: Fence | None = None, **data: Any) -> None:
        self.session.emit(type, data, fence=fence)

    def wire(self) -> dict[str, Any]:
        return {"id": self.session.id, "object": "video.session", **self.cfg, "prompt_version": self.version}

    async def handle(self, raw: str | bytes) -> None:
        ev = self.read_event(raw)
        if ev is None:
            return
        self.session.touch()
        try:
            kind = ev["type"]
            if kind == "session.update":
                self.update(ev.get("session"))
                self.emit("session.updated", session=self.wire())
            elif kind == "generation.start":
                self.start(ev.get("frames"))
            elif kind == "prompt_update":
                await self.prompt_update(ev.get("prompt"))
            elif kind == "generation.cancel":
                if not await self.cancel():
                    raise WorldError("No generation is running.", "no_active_generation")
                self.emit("generation.cancelled", generation_id=self.gen_id, frames_done=self.next_frame)
            else:
                raise WorldError(f"Unknown event type {kind!r}; known: session.update, generation.start, prompt_update, generation.cancel.",
                                 "invalid_event", "type")
        except WorldError as exc:
            self.error(exc.message, exc.code, exc.param, ev.get("event_id"))
        except SessionError as exc:  # the session is ending; it says so itself
            log.info("video session %s: %s", self.session.id, exc)

    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def update(self, body: Any) -> None:
        if not isinstance(body, dict):
            raise WorldError("'session' must be an object.", param="session")
        if self.running():
            raise WorldError("Settings cannot change during a generation; use prompt_update for the prompt.", "generation_active")
        known = {"prompt", "width", "height", "steps", "seed", "chunk_frames", "image_format"}
        bad = sorted(set(body) - known)
        if bad:
            raise WorldError(f"Unknown session field(s) {bad}; known: {sorted(known)}.", "unknown_parameter", f"session.{bad[0]}")
        limits = {"width": (16, MAX_SIDE), "height": (16, MAX_SIDE), "steps": (1, int(self.model["max_steps"])), "seed": (0, 2**31 - 1), "chunk_frames": (1, 16)}
        cfg = dict(self.cfg)
        for k, v in body.items():
            if k == "prompt":
                if not isinstance(v, str) or len(v) > 4000:
                    raise WorldError("'session.prompt' must be a string of at most 4000 characters.", param="session.prompt")
            elif k == "image_format":
                if v not in FORMATS:
                    raise WorldError(f"'session.image_format' must be one of {', '.join(FORMATS)}.", param="session.image_format")
            else:
                lo, hi = limits[k]
                mult = int(self.model["size_multiple"]) if k in ("width", "height") else 1
                if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi or v % mult:
                    raise WorldError(f"'session.{k}' must be an integer in {lo}..{hi}" + (f", a multiple of {mult}." if mult > 1 else "."), param=f"session.{k}")
            cfg[k] = v
        self.cfg = cfg

    def start(self, frames: Any) -> None:
        if self.running():
            raise WorldError("A generation is already running.", "generation_active")
        if not isinstance(frames, int) or isinstance(frames, bool) or not 1 <= frames <= 240:
            raise WorldError("'frames' must be an integer between 1 and 240.", param="frames")
        self.gen_id = f"gen_{secrets.token_hex(6)}"
        self.history, self.next_frame, self.total = [], 0, frames
        self.emit("generation.started", generation_id=self.gen_id, frames=frames)
        self.task = asyncio.get_running_loop().create_task(self._generate(self.gen_id))

    async def _generate(self, gen_id: str) -> None:
        while self.next_frame < self.total:
            n = min(int(self.cfg["chunk_frames"]), self.total - self.next_frame)
            params = {**self.cfg, "frames": n, "start_frame": self.next_frame, "history": list(self.history)}
            version = self.version
            stream = self.session.submit(params)
            stream.end_input()
            fence = self.session.fence
            try:
                async with stream:
                    async for _stage, p, _last in stream.payloads():
                        if "image" not in p.arrays:
                            continue
                        data = await asyncio.to_thread(encode_frame, p.arrays["image"], self.cfg["image_format"])
                        if fence.is_stale_against(self.session.fence):
                            break
                        self.history = (self.history + [p.arrays["latents"]])[-int(self.model["history_frames"]) :]
                        h, w = p.arrays["image"].shape[:2]
                        # committed (fenced just above): it goes out even if an edit follows,
                        # before that edit's acknowledgement
                        self.emit("video.frame", generation_id=gen_id, frame_index=self.next_frame, prompt_version=version,
                                  format=self.cfg["image_format"], width=w, height=h, image=base64.b64encode(data).decode())
                        self.next_frame += 1
                        self.emit("generation.progress", generation_id=gen_id, frames_done=self.next_frame, frames=self.total)
            except RequestAborted:
                pass
            except Exception as exc:  # noqa: BLE001 - this session only; it hears why
                err = to_omni(exc, f"video session {self.session.id}")
                self.emit("error", fence, error={"type": "server_error", "code": "generation_failed", "message": err.public_message(), "param": None, "event_id": None})
                return
            if self.restart:
                self.restart = False
                continue  # a prompt edit: go on from the next frame under the new prompt
            if fence.is_stale_against(self.session.fence):
                return  # cancelled
        self.emit("generation.done", generation_id=gen_id, frames=self.total)

    async def prompt_update(self, prompt: Any) -> None:
        if not isinstance(prompt, str) or len(prompt) > 4000:
            raise WorldError("'prompt' must be a string of at most 4000 characters.", param="prompt")
        self.cfg["prompt"] = prompt
        self.version += 1
        if self.running() and self.session.is_open:
            # fence the chunk rendered under the old prompt; the generation continues
            self.restart = True
            await self.session.signal("cancel")
        self.emit("prompt_update.applied", prompt_version=self.version, from_frame=self.next_frame, generation_id=self.gen_id)

    async def cancel(self) -> bool:
        if not self.running():
            return False
        assert self.task is not None
        if self.session.is_open:
            await self.session.signal("cancel")
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        return True


def mount(m: Mount) -> None:
    sessions, pipeline, model = m.sessions, m.pipeline, m.processor(WorldModel)
    jobs = VideoJobs(sessions, pipeline, model.describe)

    async def create(request: web.Request) -> web.StreamResponse:
        ctype = request.content_type
        raw: Any
        if ctype in ("multipart/form-data", "application/x-www-form-urlencoded"):
            form = await request.post()
            files = [k for k, v in form.items() if not isinstance(v, str)]
            if files:
                raise ClientError(f"File fields are not supported ({', '.join(files)}).", param=files[0])
            raw = dict(form.items())
        else:
            try:
                raw = json.loads(await request.read() or b"null")
            except (ValueError, UnicodeDecodeError) as exc:
                raise ClientError(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
            if not isinstance(raw, dict):
                raise ClientError("The request body must be a JSON object.", code="invalid_json")
        job = await jobs.create(raw, principal_of(request).name)
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
        return web.Response(body=job.mp4, content_type="video/mp4")

    async def delete(request: web.Request) -> web.StreamResponse:
        job = jobs.get(request.match_info["video_id"], principal_of(request))
        await jobs.delete(job)
        return json_response({"id": job.id, "object": "video.deleted", "deleted": True})

    async def live(request: web.Request) -> web.StreamResponse:
        try:
            session = await sessions.open("video", pipeline.name, principal=principal_of(request).name)
        except SessionError as exc:
            return await reject(request, exc)
        conn = VideoConnection(session, model.describe())
        sock: Socket | None = None
        writer: asyncio.Task[None] | None = None
        ended: asyncio.Future[Any] | None = None
        try:
            sock = await accept(request)
            conn.emit("session.created", session=conn.wire())
            writer = asyncio.get_running_loop().create_task(write_events(sock, session, numbered_json()))
            ended = asyncio.ensure_future(session.closed.wait())
            while (data := await sock.receive(writer, ended)) is not None:
                await conn.handle(data)
        except DISCONNECTED:
            pass
        finally:
            if ended is not None:
                ended.cancel()
            await conn.cancel()
            await sessions.end(session, "client_disconnected")
            if writer is not None:
                writer.cancel()
                await asyncio.gather(writer, return_exceptions=True)
            if sock is not None:
                await sock.close(1000)
        return sock.ws if sock is not None else web.Response(status=500)

    m.route("POST", "/v1/videos", create, "video jobs (OpenAI); GET/DELETE /v1/videos/{id}, …/content")
    m.route("GET", "/v1/videos", list_videos)
    m.route("GET", "/v1/videos/{video_id}", get_video)
    m.route("GET", "/v1/videos/{video_id}/content", content)
    m.route("DELETE", "/v1/videos/{video_id}", delete)
    m.websocket("/v1/realtime/video", live, "live video generation with prompt edits")
