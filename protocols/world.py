"""`/v1/world`: world-model rollout sessions over a WebSocket (JSON events, in the
style of the realtime API).

Client events (each may carry an `event_id`, echoed on errors):
- `session.update {session: {prompt, width, height, steps, seed, image_format}}` —
  any subset; a new size starts the history over. → `session.updated`.
- `world.step {action: [numbers]}` — denoise the next frames conditioned on the
  session's latent history and the action. → `world.step.started {step_id,
  frame_index}`, `world.step.progress {step_id, step, steps}`…, then per frame
  `world.frame {step_id, frame_index, format, width, height, image: base64}` (the
  model's `frames_per_step`: 4 on diffusion forcing, the rollout's first step 1), and
  `world.step.done {step_id, frame_index: the last}`. A step sent while one runs
  supersedes it.
- `world.cancel` — stop the running step. → `world.step.cancelled {step_id, reason}`.
  Cancelled or superseded steps are fenced: none of their frames or progress arrive
  after the `world.step.cancelled`, and the history does not take their frame.
- `world.reset {prompt?, seed?}` — empty the history, frame index 0 → `world.reset.done`.
- `session.close` → `session.closed`, then close 1000.

Server: `session.created {session, resume_token}` first (`session` holds the settings
plus `action_dim`, `history_frames`, `frame_index`). The latent history lives in the
session (at most `history_frames` frames); a dropped connection detaches it (the
running step is cancelled) and `?session_id=…&resume_token=…` resumes it within the
grace period (`session.resumed`, the rollout continues from its buffer). Errors:
`error {error: {type, code, message, param, event_id}}`, the socket stays open. Over
a cap: an `error` event `session_limit`, then close 1013.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np
from aiohttp import web

from omni_rt import metrics
from omni_rt.errors import RequestAborted
from omni_rt.payloads import Fence
from protocols.auth import principal_of
from protocols.errors import to_omni
from protocols.events import EventError as WorldError
from protocols.events import JsonEvents, prompt_token_error
from protocols.registry import Mount
from protocols.ws import accept, close_attachment, numbered_json, reject, serve_events
from sessions import Session, SessionError, SessionManager

log = logging.getLogger("protocols.world")

FORMATS = {"jpeg": "JPEG", "png": "PNG"}


def encode_frame(img: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format=FORMATS[fmt], **({"quality": 90} if fmt == "jpeg" else {}))
    return buf.getvalue()


@runtime_checkable
class WorldModel(Protocol):
    """What this wire needs from the world pipeline's stage."""

    def describe(self) -> dict[str, Any]: ...


class WorldConnection(JsonEvents):
    def __init__(self, session: Session, sessions: SessionManager, model: dict[str, Any], count: Callable[[str], int] | None = None) -> None:
        self.session = session
        self.sessions = sessions
        self.model = model
        self.count = count  # the stage's prompt_tokens, where it has one
        if "world" not in session.data:
            size = int(model["default_size"])
            session.data["world"] = {
                "prompt": "", "width": size, "height": size, "steps": int(model["default_steps"]),
                "seed": secrets.randbelow(2**31), "image_format": "jpeg", "history": [], "frame_index": 0,
            }
            session.add_finalizer(lambda: self._account(-self.buffer_bytes()))
        self.task: asyncio.Task[None] | None = None
        self.step_id: str | None = None
        self.moving = False  # handed off (a drain): steps are refused here
        session.exporter = self.export  # the latest attachment's connection moves it

    # ---- moving to another node (a drain) -------------------------------------------------
    async def export(self, left_s: float) -> dict[str, Any]:
        """At a clean point (the running step has rendered its frames; at the drain's
        deadline it is cancelled and its frames are not in the history): the settings,
        the latent history and the frame index. The next step's noise comes from the
        seed and the frame index, so it renders on the new node as it would have here."""
        deadline = time.monotonic() + max(0.0, left_s - 0.5)
        while self.task is not None and not self.task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.moving = True
        await self.cancel("migrated")
        return {"world": dict(self.state)}

    @classmethod
    def restore(cls, session: Session, state: dict[str, Any]) -> None:
        world = state["world"]
        keys = {"prompt", "width", "height", "steps", "seed", "image_format", "history", "frame_index"}
        if not isinstance(world, dict) or set(world) != keys or not all(isinstance(a, np.ndarray) for a in world["history"]):
            raise ValueError("the world state does not match this release")
        if world["image_format"] not in FORMATS:
            raise ValueError(f"image format {world['image_format']!r} is not served here")
        session.data["world"] = dict(world)
        nbytes = sum(int(a.nbytes) for a in world["history"])
        cls._account(nbytes)
        session.add_finalizer(lambda: cls._account(-sum(int(a.nbytes) for a in session.data.get("world", {}).get("history", []))))

    @property
    def state(self) -> dict[str, Any]:
        return self.session.data["world"]

    def buffer_bytes(self) -> int:
        return sum(int(a.nbytes) for a in self.session.data.get("world", {}).get("history", []))

    @staticmethod
    def _account(delta: int) -> None:
        metrics.WORLD_BUFFER_BYTES.inc(delta)

    def wire(self) -> dict[str, Any]:
        st = self.state
        return {
            "id": self.session.id, "object": "world.session", "prompt": st["prompt"], "width": st["width"], "height": st["height"],
            "steps": st["steps"], "seed": st["seed"], "image_format": st["image_format"], "frame_index": st["frame_index"],
            "action_dim": self.model["action_dim"], "history_frames": self.model["history_frames"],
            "frames_per_step": int(self.model.get("frames_per_step", 1)), "max_prompt_tokens": self.model.get("max_prompt_tokens"),
        }

    def emit(self, type: str, fence: Fence | None = None, **data: Any) -> None:
        self.session.emit(type, data, fence=fence)

    # ---- client events ------------------------------------------------------------------
    async def handle(self, raw: str | bytes) -> bool:
        """One client event; False when the client asked to close."""
        ev = self.read_event(raw)
        if ev is None:
            return True
        self.session.touch()
        eid = ev.get("event_id")
        try:
            kind = ev["type"]
            if self.moving and kind != "session.close":
                raise WorldError("This session is moving to another node; resume it there and send this again.", "session_moving")
            if kind == "session.update":
                self.update(ev.get("session"))
                self.emit("session.updated", session=self.wire())
            elif kind == "world.step":
                await self.step(ev.get("action"))
            elif kind == "world.cancel":
                if not await self.cancel("cancelled"):
                    raise WorldError("No step is running.", "no_active_step")
            elif kind == "world.reset":
                await self.reset(ev)
            elif kind == "session.close":
                return False
            else:
                raise WorldError(f"Unknown event type {kind!r}; known: session.update, world.step, world.cancel, world.reset, session.close.", "invalid_event", "type")
        except WorldError as exc:
            self.error(exc, eid)
        except SessionError as exc:  # the session is ending (operator, lease): it says so itself
            log.info("world session %s: %s", self.session.id, exc)
        return True

    def update(self, body: Any) -> None:
        if not isinstance(body, dict):
            raise WorldError("'session' must be an object.", param="session")
        known = {"prompt", "width", "height", "steps", "seed", "image_format"}
        bad = set(body) - known
        if bad:
            raise WorldError(f"Unknown session field(s) {sorted(bad)}; known: {sorted(known)}.", "unknown_parameter", f"session.{sorted(bad)[0]}")
        st, m = dict(self.state), self.model
        if ("width" in body or "height" in body) and self.task is not None and not self.task.done():
            raise WorldError("The frame size cannot change while a step runs; cancel it first.", "step_active", "session.width")
        if "prompt" in body:
            if not isinstance(body["prompt"], str) or len(body["prompt"]) > 4000:
                raise WorldError("'session.prompt' must be a string of at most 4000 characters.", param="session.prompt")
            too_long = prompt_token_error(self.count, m.get("max_prompt_tokens"), body["prompt"])
            if too_long:
                raise WorldError(too_long, param="session.prompt")
            st["prompt"] = body["prompt"]
        for side in ("width", "height"):
            if side in body:
                v = body[side]
                mult = int(m["size_multiple"])
                if not isinstance(v, int) or isinstance(v, bool) or not mult <= v <= 512 or v % mult:
                    raise WorldError(f"'session.{side}' must be a multiple of {mult} between {mult} and 512.", param=f"session.{side}")
                st[side] = v
        if "steps" in body:
            v = body["steps"]
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= int(m["max_steps"]):
                raise WorldError(f"'session.steps' must be an integer between 1 and {m['max_steps']}.", param="session.steps")
            st["steps"] = v
        if "seed" in body:
            v = body["seed"]
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**31:
                raise WorldError("'session.seed' must be an integer in 0..2^31-1.", param="session.seed")
            st["seed"] = v
        if "image_format" in body:
            if not isinstance(body["image_format"], str) or body["image_format"] not in FORMATS:
                raise WorldError(f"'session.image_format' must be one of {', '.join(FORMATS)}.", param="session.image_format")
            st["image_format"] = body["image_format"]
        if (st["width"], st["height"]) != (self.state["width"], self.state["height"]):
            self._account(-self.buffer_bytes())
            st["history"] = []  # latents of another size cannot condition this one
        self.state.update(st)  # in place: a running step holds this dict

    async def step(self, action: Any) -> None:
        dim = int(self.model["action_dim"])
        if not isinstance(action, list) or len(action) != dim or not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in action):
            raise WorldError(f"'action' must be a list of {dim} numbers.", param="action")
        try:
            finite = bool(np.isfinite(np.asarray(action, np.float64)).all())
        except OverflowError:
            finite = False
        if not finite:
            raise WorldError("'action' must be finite.", param="action")
        await self.cancel("superseded")
        st = self.state
        self.step_id = f"step_{secrets.token_hex(6)}"
        params = {
            "prompt": st["prompt"], "width": st["width"], "height": st["height"], "steps": st["steps"], "seed": st["seed"],
            "frame_index": st["frame_index"], "history": list(st["history"]), "action": [float(a) for a in action],
        }
        stream = self.session.submit(params)
        stream.end_input()
        fence = self.session.fence  # the new turn's
        self.emit("world.step.started", fence, step_id=self.step_id, frame_index=st["frame_index"])
        self.task = asyncio.get_running_loop().create_task(self._run(stream, self.step_id, fence))

    async def _run(self, stream: Any, step_id: str, fence: Fence) -> None:
        try:
            async with stream:
                async for _stage, p, last in stream.payloads():
                    if "progress" in p.meta:
                        self.emit("world.step.progress", fence, step_id=step_id, step=p.meta["progress"], steps=p.meta["total"])
                        continue
                    st = self.state
                    data = await asyncio.to_thread(encode_frame, p.arrays["image"], st["image_format"])
                    if fence.is_stale_against(self.session.fence):
                        return
                    # the frame and the history advance together (no await in between)
                    history = (st["history"] + [p.arrays["latents"]])[-int(self.model["history_frames"]) :]
                    self._account(sum(int(a.nbytes) for a in history) - self.buffer_bytes())
                    st["history"] = history
                    frame = st["frame_index"]
                    st["frame_index"] = frame + 1
                    h, w = p.arrays["image"].shape[:2]
                    # committed: sent even if a cancel follows (it was fenced just above)
                    self.emit("world.frame", step_id=step_id, frame_index=frame, format=st["image_format"], width=w, height=h,
                              image=base64.b64encode(data).decode())
                    if last:  # a step may render several frames (the model's frames_per_step)
                        self.emit("world.step.done", step_id=step_id, frame_index=frame)
        except RequestAborted:
            pass
        except Exception as exc:  # noqa: BLE001 - this session only; it hears why
            err = to_omni(exc, f"world session {self.session.id}")
            self.emit("error", fence, error={"type": "server_error", "code": "step_failed", "message": err.public_message(), "param": None, "event_id": None})

    async def cancel(self, reason: str) -> bool:
        """Stop the running step, if any: the epoch advances first, so nothing of it is
        delivered after the `world.step.cancelled` that follows."""
        task = self.task
        if task is None or task.done():
            return False
        if self.session.is_open:
            await self.session.signal("cancel")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        self.emit("world.step.cancelled", step_id=self.step_id, reason=reason)
        return True

    async def reset(self, ev: dict[str, Any]) -> None:
        body = {k: ev[k] for k in ("prompt", "seed") if k in ev}
        if body:
            self.update(body)
        await self.cancel("reset")
        self._account(-self.buffer_bytes())
        self.state["history"] = []
        self.state["frame_index"] = 0
        self.emit("world.reset.done", session=self.wire())


def mount(m: Mount) -> None:
    sessions, pipeline, model = m.sessions, m.pipeline.name, m.processor(WorldModel)
    sessions.restorers[("world", pipeline)] = WorldConnection.restore

    async def world(request: web.Request) -> web.StreamResponse:
        principal = principal_of(request).name
        sid, token = request.query.get("session_id"), request.query.get("resume_token")
        try:
            if sid:
                session = await sessions.resume(sid, token, principal)
                resumed = True
            else:
                session = await sessions.open("world", pipeline, principal=principal)
                resumed = False
        except SessionError as exc:
            return await reject(request, exc)
        conn = WorldConnection(session, sessions, model.describe(), getattr(model, "prompt_tokens", None))
        attachment = session.attachment  # a resume elsewhere takes the session over
        try:
            sock = await accept(request)
        except BaseException:
            await sessions.detach(session.id)
            raise
        kind = "session.resumed" if resumed else "session.created"
        conn.emit(kind, session=conn.wire(), resume_token=await sessions.issue_resume_token(session))

        async def on_exit(why: str) -> None:
            if not session.attached_as(attachment):
                return  # taken over by a resume elsewhere: the new attachment owns it
            try:
                await conn.cancel("client_disconnected")
                if why == "client_closed" or (why == "client_left" and sock.closed_normally):
                    # session.close, or a normal close frame: the slot is free at once
                    # (only a dropped connection leaves the session resumable)
                    conn.emit("session.closed")
                    await sessions.end(session, "closed")
                elif why == "server_error":
                    await sessions.end(session, "server_error")
                else:
                    await sessions.detach(session.id)  # resumable within disconnect_grace_s
            except SessionError as exc:
                log.info("world session %s: %s", session.id, exc)

        why = await serve_events(sock, session, numbered_json(), conn.handle, on_exit)
        await close_attachment(sock, session, why)
        return sock.ws

    m.websocket("/v1/world", world, "world-model rollouts (action in, frames out)")
