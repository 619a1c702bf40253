"""Asyncio client for omni-rt's world-model rollouts (`/v1/world`).

    async with await WorldClient.connect("ws://127.0.0.1:8000/v1/world", api_key) as w:
        await w.update(prompt="a forest path", width=128, height=128, seed=1)
        frame = await w.step([0.1, 0.0, 0.0, 1.0])   # uint8 [H, W, 3]

`w.resume_token` and `w.session_id` resume a dropped rollout:
`WorldClient.connect(url, key, session_id=…, resume_token=…)`.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from typing import Any
from urllib.parse import urlencode

import numpy as np
from websockets.asyncio.client import ClientConnection, connect

from clients.closing import close
from clients.errors import ErrorEvent


class WorldError(ErrorEvent):
    """The world session sent an `error` event."""


def decode_frame(ev: dict[str, Any]) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(ev["image"]))).convert("RGB"))


class WorldClient:
    def __init__(self, ws: ClientConnection, first: dict[str, Any]) -> None:
        self.ws = ws
        self.first = first
        self.session = first.get("session", {})
        self.session_id = self.session.get("id")
        self.resume_token = first.get("resume_token")

    @classmethod
    async def connect(cls, url: str, api_key: str | None = None, *, session_id: str | None = None, resume_token: str | None = None) -> WorldClient:
        if session_id:
            url += ("&" if "?" in url else "?") + urlencode({"session_id": session_id, "resume_token": resume_token or ""})
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        ws = await connect(url, additional_headers=headers, max_size=None)
        first = json.loads(await ws.recv())
        if first.get("type") == "error":
            await ws.close()
            raise WorldError(first)
        return cls(ws, first)

    async def send(self, type: str, **fields: Any) -> None:
        await self.ws.send(json.dumps({"type": type, **fields}))

    async def recv(self, timeout: float = 120) -> dict[str, Any]:
        return json.loads(await asyncio.wait_for(self.ws.recv(), timeout))

    async def until(self, types: str | set[str], seen: list[dict[str, Any]] | None = None, timeout: float = 120) -> dict[str, Any]:
        want = {types} if isinstance(types, str) else types
        while True:
            ev = await self.recv(timeout)
            if seen is not None:
                seen.append(ev)
            if ev["type"] in want:
                return ev
            if ev["type"] == "error" and "error" not in want:
                raise WorldError(ev)

    async def update(self, **session: Any) -> dict[str, Any]:
        await self.send("session.update", session=session)
        ev = await self.until("session.updated")
        self.session = ev["session"]
        return ev

    async def step(self, action: list[float], seen: list[dict[str, Any]] | None = None) -> np.ndarray:
        """Send one action; the step's last frame (a model may render several frames a
        step, `session["frames_per_step"]`: `step_frames` returns them all)."""
        return (await self.step_frames(action, seen))[-1]

    async def step_frames(self, action: list[float], seen: list[dict[str, Any]] | None = None) -> list[np.ndarray]:
        await self.send("world.step", action=action)
        frames: list[np.ndarray] = []
        while True:
            ev = await self.until({"world.frame", "world.step.done"}, seen)
            if ev["type"] == "world.step.done":
                return frames
            frames.append(decode_frame(ev))

    async def close(self) -> None:
        await close(self.ws)

    async def __aenter__(self) -> WorldClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
