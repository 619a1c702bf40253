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
from typing import Any, Callable, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from omni_rt import metrics
from omni_rt.request import RequestAborted
from omni_rt.specs import PipelineSpec
from omni_rt.stage import StageError
from protocols.auth import principal_of
from protocols.openai_http import APIError, open_oneshot, parse_json, validate_body
from sessions import SessionManager

FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


class ImageRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=32000)
    model: str | None = None
    n: int = Field(1, ge=1)
    size: str | None = None
    response_format: Literal["b64_json", "url"] | None = None
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | None = Field(None, ge=0, le=100)
    quality: str | None = None
    style: str | None = None
    background: str | None = None
    moderation: str | None = None
    user: str | None = None
    stream: Literal[False] | None = None
    # extensions
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    negative_prompt: str | None = Field(None, max_length=32000)
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = Field(None, ge=0, le=50)


def encode_image(img: np.ndarray, fmt: str, compression: int | None) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    kw: dict[str, Any] = {}
    if fmt in ("jpeg", "webp"):
        kw["quality"] = 90 if compression is None else max(1, 100 - compression)
    Image.fromarray(img).save(buf, format=FORMATS[fmt], **kw)
    return buf.getvalue()


class ImageService:
    def __init__(self, sessions: SessionManager, pipeline: PipelineSpec, limits: Callable[[], dict[str, Any]]) -> None:
        self.sessions = sessions
        self.pipeline = pipeline
        self.limits = limits

    def validate(self, raw: Any) -> tuple[ImageRequest, dict[str, Any]]:
        req = validate_body(ImageRequest, raw)
        lim = self.limits()
        if req.model is not None and req.model not in self.pipeline.models:
            raise APIError(400, f"The model '{req.model}' does not exist; available: {', '.join(self.pipeline.models)}.", param="model", code="model_not_found")
        if req.response_format == "url":
            raise APIError(400, "response_format 'url' is not supported (this server stores no images); use 'b64_json'.", param="response_format", code="invalid_value")
        if req.n > lim["max_n"]:
            raise APIError(400, f"Invalid 'n': {req.n}; at most {lim['max_n']} images per request.", param="n", code="invalid_value")
        size = req.size or "auto"
        if size == "auto":
            size = lim["default_size"]
        m = re.fullmatch(r"(\d{1,5})x(\d{1,5})", size)
        mult, side = lim["size_multiple"], lim["max_side"]
        if m is None or not all(mult <= int(v) <= side and int(v) % mult == 0 for v in m.groups()):
            raise APIError(
                400,
                f"Unsupported size '{req.size}': use 'auto' or 'WIDTHxHEIGHT' with each side a multiple of {mult} between {mult} and {side}.",
                param="size",
                code="invalid_value",
            )
        steps = req.num_inference_steps or lim["default_steps"]
        if steps > lim["max_steps"]:
            raise APIError(400, f"Invalid 'num_inference_steps': {steps}; at most {lim['max_steps']}.", param="num_inference_steps", code="invalid_value")
        if req.output_compression is not None and req.output_format == "png":
            raise APIError(400, "output_compression applies to jpeg and webp only.", param="output_compression", code="invalid_value")
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

    async def generate(self, raw: Any, principal: str) -> JSONResponse:
        req, params = self.validate(raw)
        t0 = time.monotonic()
        session = await open_oneshot(self.sessions, self.pipeline.name, principal)
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
        except StageError as exc:
            raise APIError(500, f"generation failed: {exc}", type="server_error", code="generation_failed") from None
        except RequestAborted as exc:
            raise APIError(503, f"the request was stopped ({session.close_reason or exc.reason})", type="server_error", code="session_closed") from None
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
        return JSONResponse(body, headers={"x-session-id": session.id})


def build_images_router(images: ImageService) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/images/generations")
    async def generations(request: Request) -> JSONResponse:
        return await images.generate(await parse_json(request), principal_of(request).name)

    return router
