"""Live video generation with prompt edits (`/v1/realtime/video`): a `video` session
renders chunk after chunk, each conditioned on the frames before it; a prompt edit
cancels the running chunk through the fence and generation goes on from the next frame
under the new prompt."""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
from collections.abc import Callable
from typing import Any

import numpy as np

from omni_rt.errors import RequestAborted
from omni_rt.payloads import Fence
from protocols.errors import to_omni
from protocols.events import EventError as WorldError
from protocols.events import JsonEvents, prompt_token_error
from protocols.videos.jobs import MAX_SIDE
from protocols.world import FORMATS, encode_frame
from sessions import Session, SessionError

log = logging.getLogger("protocols.videos")


class VideoConnection(JsonEvents):
    def __init__(self, session: Session, model: dict[str, Any], count: Callable[[str], int] | None = None) -> None:
        self.session = session
        self.model = model
        self.count = count  # the stage's prompt_tokens, where it has one
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
            self.error(exc, ev.get("event_id"))
        except SessionError as exc:  # the session is ending; it says so itself
            log.info("video session %s: %s", self.session.id, exc)

    def check_tokens(self, prompt: str, param: str) -> None:
        too_long = prompt_token_error(self.count, self.model.get("max_prompt_tokens"), prompt)
        if too_long:
            raise WorldError(too_long, param=param)

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
                self.check_tokens(v, "session.prompt")
            elif k == "image_format":
                if not isinstance(v, str) or v not in FORMATS:
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
            # frames_left: a model that makes frames in groups may show more than n (never past the end)
            params = {**self.cfg, "frames": n, "frames_left": self.total - self.next_frame, "start_frame": self.next_frame,
                      "history": list(self.history)}
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
        self.check_tokens(prompt, "prompt")
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


