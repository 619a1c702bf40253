"""Video jobs (`/v1/videos`, OpenAI's Videos API) on the `video` pipeline: each job is a
`video` session that renders the whole clip in one request, then encodes it as H.264
MP4 (PyAV)."""

from __future__ import annotations

import asyncio
import io
import logging
import re
import secrets
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Protocol, runtime_checkable

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from omni_rt.errors import ClientError, NotFound, OmniError
from omni_rt.specs import PipelineSpec
from protocols.events import prompt_token_error
from sessions import Session, SessionManager

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


def _not_bool(v: Any) -> Any:
    if isinstance(v, bool):
        raise PydanticCustomError("invalid_type", "Input should be an integer, not a boolean")
    return v


# an integer as JSON writes it, or as a form field's text ("4")
WireInt = Annotated[int, BeforeValidator(_not_bool)]


class VideoCreate(BaseModel):
    """`POST /v1/videos`, from JSON or form fields (the openai SDK sends multipart, every
    value as text): the values' types and ranges. The size's multiple and the steps' and
    frames' bounds depend on the model (`VideoJobs.create`)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=32000)
    model: str | None = Field(default=None, max_length=256)
    seconds: WireInt = Field(default=4, ge=1, le=MAX_SECONDS)
    size: str | None = Field(default=None, max_length=32)
    fps: WireInt = Field(default=8, ge=1, le=30)
    seed: WireInt | None = Field(default=None, ge=0, le=2**31 - 1)
    steps: WireInt | None = Field(default=None, ge=1)
    input_reference: None = None  # image-to-video is not served

    @field_validator("prompt")
    @classmethod
    def _has_text(cls, v: str) -> str:
        if not v.strip():
            raise PydanticCustomError("invalid_value", "'prompt' must not be blank")
        return v


@runtime_checkable
class VideoModel(Protocol):
    """What the video wires need from the pipeline's entry stage: `describe()` gives
    `default_size`, `size_multiple`, `max_steps` and, where the model bounds a clip,
    `max_frames`."""

    def describe(self) -> dict[str, Any]: ...


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
    mp4: Path | None = None  # the finished clip, served with Range (players seek)
    session: Session | None = None
    task: asyncio.Task[None] | None = None

    def wire(self) -> dict[str, Any]:
        return {
            "id": self.id, "object": "video", "model": self.model, "status": self.status, "progress": self.progress,
            "created_at": self.created_at, "completed_at": self.completed_at, "expires_at": None, "prompt": self.prompt,
            "size": f"{self.width}x{self.height}", "seconds": str(self.seconds), "remixed_from_video_id": None, "error": self.error,
        }


class VideoJobs:
    def __init__(self, sessions: SessionManager, pipeline: PipelineSpec, describe: Callable[[], dict[str, Any]],
                 count: Callable[[str], int] | None = None) -> None:
        self.sessions = sessions
        self.pipeline = pipeline
        self.describe = describe
        self.count = count  # the stage's prompt_tokens, where it has one
        self.jobs: dict[str, VideoJob] = {}
        # the finished clips, on disk while their jobs are kept (gone with the process)
        self._dir = tempfile.TemporaryDirectory(prefix="omni-rt-videos-")

    async def create(self, req: VideoCreate, principal: str) -> VideoJob:
        prompt = req.prompt
        model = req.model or self.pipeline.models[0]
        if model not in self.pipeline.models:
            raise ClientError(f"The model '{model}' does not exist; available: {', '.join(self.pipeline.models)}.", param="model", code="model_not_found")
        d = self.describe()
        too_long = prompt_token_error(self.count, d.get("max_prompt_tokens"), prompt)
        if too_long:
            raise ClientError(too_long, param="prompt", code="invalid_value")
        width, height = _size(req.size or f"{d['default_size']}x{d['default_size']}", int(d["size_multiple"]))
        seconds, fps = req.seconds, req.fps
        seed = req.seed if req.seed is not None else secrets.randbelow(2**31)
        steps = req.steps
        if steps is not None and steps > int(d["max_steps"]):
            raise ClientError(f"Invalid 'steps': {steps}; this model takes at most {d['max_steps']}.", param="steps", code="invalid_value")
        if d.get("max_frames") is not None and seconds * fps > int(d["max_frames"]):
            raise ClientError(
                f"This model makes at most {d['max_frames']} frames per clip; {seconds} seconds at {fps} fps is {seconds * fps}. "
                "Ask for fewer seconds or a lower fps.",
                param="seconds",
                code="invalid_value",
            )
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
                                     "fps": job.fps, "seed": job.seed, "steps": job.steps})
            stream.end_input()
            async with stream:
                async for _stage, p, _last in stream.payloads():
                    session.touch()
                    if "progress" in p.meta:
                        job.progress = min(99, int(100 * p.meta["progress"] / max(1, p.meta["total"])))
                    else:
                        frames[int(p.meta["frame_index"])] = p.arrays["image"]
            clip = [frames[i] for i in sorted(frames)]
            path = Path(self._dir.name) / f"{job.id}.mp4"
            await asyncio.to_thread(lambda: path.write_bytes(encode_mp4(clip, job.fps)))
            job.mp4 = path
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
            _unlink(j)

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
        _unlink(job)


def _unlink(job: VideoJob) -> None:
    if job.mp4 is not None:
        job.mp4.unlink(missing_ok=True)
        job.mp4 = None


