"""Client for omni-rt's `POST /v1/images/generations` (the OpenAI Images API plus
omni-rt's `seed`, `negative_prompt`, `num_inference_steps`, `guidance_scale`).

    async with ImageClient("http://127.0.0.1:8000", api_key) as c:
        images = await c.generate("a red cat", size="256x256", n=2, seed=1)   # uint8 [H, W, 3] each

CLI: ``python -m clients.images --url http://127.0.0.1:8000 --prompt "a red cat" --out cat.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import sys
from typing import Any

import httpx
import numpy as np

from clients.errors import HttpApiError


class ImageError(HttpApiError):
    """An images call was refused or failed."""


class ImageClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 300.0) -> None:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout)

    async def generate_raw(self, prompt: str, **fields: Any) -> dict[str, Any]:
        body = {"prompt": prompt, **{k: v for k, v in fields.items() if v is not None}}
        r = await self.http.post("/v1/images/generations", json=body)
        if r.status_code != 200:
            raise ImageError.from_response(r)
        return r.json()

    async def generate(self, prompt: str, **fields: Any) -> list[np.ndarray]:
        from PIL import Image

        body = await self.generate_raw(prompt, **fields)
        return [np.asarray(Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))).convert("RGB")) for d in body["data"]]

    async def close(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> ImageClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _main(args: argparse.Namespace) -> int:
    from PIL import Image

    async with ImageClient(args.url, args.api_key) as c:
        images = await c.generate(args.prompt, size=args.size, n=args.n, seed=args.seed, num_inference_steps=args.steps)
    for i, img in enumerate(images):
        path = args.out if len(images) == 1 else args.out.replace(".png", f"-{i}.png")
        Image.fromarray(img).save(path)
        print(f"wrote {path} ({img.shape[1]}x{img.shape[0]})")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Generate images with an omni-rt (or OpenAI-compatible) server.")
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--size")
    ap.add_argument("--n", type=int, default=1)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--out", default="image.png")
    try:
        return asyncio.run(_main(ap.parse_args(argv)))
    except ImageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
