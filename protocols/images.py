"""`POST /v1/images/generations` (OpenAI Images API) on the image pipeline.

OpenAI's fields: `prompt` (required), `model`, `n`, `size` (`WxH` or `auto`),
`response_format` (`b64_json`; `url` is refused: this server keeps no files),
`output_format` (`png` default, `jpeg`, `webp`), `output_compression` (0-100, jpeg and
webp), and `quality`, `style`, `background`, `moderation`, `user` (accepted, no
effect). Extensions: `seed` (image i uses seed + i), `negative_prompt`,
`num_inference_steps`, `guidance_scale` (> 1 turns classifier-free guidance on, with
`negative_prompt` as the unconditional text). Each call is a one-shot session (429
`session_limit` over a cap). Bad input: 400 in OpenAI's shape naming the field.
"""

from __future__ import annotations

import asyncio
import base64
import io
import re
import time
from collections.abc import Callable
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from omni_rt import metrics
from omni_rt.errors import ClientError, OmniError, RequestAborted
from omni_rt.specs import PipelineSpec
from protocols.auth import principal_of
from protocols.http import json_response, read_json, validate_body
from protocols.registry import Mount
from sessions import SessionManager

FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


class ImageRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=32000)
    model: str | None = None
    n: int = Field(default=1, ge=1)
    size: str | None = None
    response_format: Literal["b64_json", "url"] | None = None
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | None = Field(default=None, ge=0, le=100)
    quality: str | None = None
    style: str | None = None
    background: str | None = None
    moderation: str | None = None
    user: str | None = None
    stream: Literal[False] | None = None
    # extensions
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    negative_prompt: str | None = Field(default=None, max_length=32000)
    num_inference_steps: int | None = Field(default=None, ge=1)
    guidance_scale: float | None = Field(default=None, ge=0, le=50)


def encode_image(img: np.ndarray, fmt: str, compression: int | None) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    kw: dict[str, Any] = {}
    if fmt in ("jpeg", "webp"):
        kw["quality"] = 90 if compression is None else max(1, 100 - compression)
    Image.fromarray(img).save(buf, format=FORMATS[fmt], **kw)
    return buf.getvalue()


@runtime_checkable
class ImageModel(Protocol):
    """What this wire needs from the image pipeline's stage."""

    def limits(self) -> dict[str, Any]: ...


class ImageService:
    def __init__(self, sessions: SessionManager, pipeline: PipelineSpec, limits: Callable[[], dict[str, Any]]) -> None:
        self.sessions = sessions
        self.pipeline = pipeline
        self.limits = limits

    def validate(self, raw: Any) -> tuple[ImageRequest, dict[str, Any]]:
        req = validate_body(ImageRequest, raw)
        lim = self.limits()
        if req.model is not None and req.model not in self.pipeline.models:
            raise ClientError(f"The model '{req.model}' does not exist; available: {', '.join(self.pipeline.models)}.", param="model", code="model_not_found")
        if req.response_format == "url":
            raise ClientError("response_format 'url' is not supported (this server stores no images); use 'b64_json'.", param="response_format", code="invalid_value")
        if req.n > lim["max_n"]:
            raise ClientError(f"Invalid 'n': {req.n}; at most {lim['max_n']} images per request.", param="n", code="invalid_value")
        size = req.size or "auto"
        if size == "auto":
            size = lim["default_size"]
        m = re.fullmatch(r"(\d{1,5})x(\d{1,5})", size)
        mult, side = lim["size_multiple"], lim["max_side"]
        if m is None or not all(mult <= int(v) <= side and int(v) % mult == 0 for v in m.groups()):
            raise ClientError(f"Unsupported size '{req.size}': use 'auto' or 'WIDTHxHEIGHT' with each side a multiple of {mult} between {mult} and {side}.",
                param="size",
                code="invalid_value",
            )
        steps = req.num_inference_steps or lim["default_steps"]
        if steps > lim["max_steps"]:
            raise ClientError(f"Invalid 'num_inference_steps': {steps}; at most {lim['max_steps']}.", param="num_inference_steps", code="invalid_value")
        if req.output_compression is not None and req.output_format == "png":
            raise ClientError("output_compression applies to jpeg and webp only.", param="output_compression", code="invalid_value")
        width, height = (int(v) for v in m.groups())
        params = {
            "prompt": req.prompt,
            "n": req.n,
            "width": width,
            "height": height,
            "steps": steps,
            "seed": req.seed,
            "negative_prompt": req.negative_prompt,
            "guidance_scale": req.guidance_scale,
        }
        return req, params

    async def generate(self, raw: Any, principal: str) -> web.Response:
        req, params = self.validate(raw)
        t0 = time.monotonic()
        session = await self.sessions.open("oneshot", self.pipeline.name, principal=principal)
        images: dict[int, np.ndarray] = {}
        outcome = "failed"
        try:
            stream = session.submit(params)
            stream.end_input()
            async with stream:
                async for _stage, p, _last in stream.payloads():
                    session.touch()
                    if "image" in p.arrays:
                        images[int(p.meta["index"])] = p.arrays["image"]
            outcome = "completed"
        except RequestAborted as exc:
            raise OmniError(f"the request was stopped ({session.close_reason or exc.reason})", code="session_closed", http_status=503) from None
        finally:
            await asyncio.shield(self.sessions.end(session, outcome))
        fmt = req.output_format
        encoded = await asyncio.to_thread(lambda: [encode_image(images[i], fmt, req.output_compression) for i in sorted(images)])
        metrics.E2E_SECONDS.labels(api="images").observe(time.monotonic() - t0)
        body = {
            "created": int(time.time()),
            "data": [{"b64_json": base64.b64encode(b).decode()} for b in encoded],
            "output_format": fmt,
            "size": f"{params['width']}x{params['height']}",
            "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0, "images": len(encoded), "steps": params["steps"] * req.n},
        }
        return json_response(body, headers={"x-session-id": session.id})


def mount(m: Mount) -> None:
    images = ImageService(m.sessions, m.pipeline, m.processor(ImageModel).limits)

    async def generations(request: web.Request) -> web.StreamResponse:
        return await images.generate(await read_json(request), principal_of(request).name)

    m.route("POST", "/v1/images/generations", generations, "text to image (OpenAI)")
