"""/v1/images/generations on the shared server with the official openai SDK."""

from __future__ import annotations

import asyncio
import base64
import io
import re
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image

from clients.images import ImageClient, ImageError
from testkit.harness import ADMIN_HEADERS, ADMIN_KEY, http_client

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


def sdk(server, key: str = ADMIN_KEY) -> Any:  # the server takes values the SDK's types do not list
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def decode(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def test_sdk_images_generate_decodes_to_the_requested_size(server):
    r = sdk(server).images.generate(model="omni-rt-image", prompt="a lighthouse at dusk", size="256x128", n=2, extra_body={"seed": 5})
    assert len(r.data) == 2 and r.size == "256x128" and r.output_format == "png"
    imgs = [decode(d.b64_json) for d in r.data]
    assert all(im.format == "PNG" and im.size == (256, 128) for im in imgs)
    a, b = (np.asarray(im) for im in imgs)
    assert np.abs(a.astype(int) - b.astype(int)).max() > 10  # seed 5 and 6
    again = sdk(server).images.generate(prompt="a lighthouse at dusk", size="256x128", extra_body={"seed": 5})
    # same seed, same image (made alone now, in a batch of two before: equal up to rounding)
    assert np.abs(np.asarray(decode(again.data[0].b64_json)).astype(int) - a.astype(int)).max() <= 1
    for fmt, name in (("jpeg", "JPEG"), ("webp", "WEBP")):
        r = sdk(server).images.generate(prompt="x", size="64x64", output_format=fmt, extra_body={"num_inference_steps": 2})
        assert decode(r.data[0].b64_json).format == name


async def test_concurrent_requests_share_denoising_steps(server):
    def batches() -> tuple[float, float]:
        with http_client(server.url, ADMIN_HEADERS) as http:
            text = http.get("/metrics").text
        count = float(re.search(r'omni_rt_engine_batch_size_count\{engine="dit"\} (\S+)', text).group(1))
        total = float(re.search(r'omni_rt_engine_batch_size_sum\{engine="dit"\} (\S+)', text).group(1))
        return count, total

    c0, t0 = batches()
    async with ImageClient(server.url, ADMIN_KEY) as c:
        results = await asyncio.gather(*(c.generate(f"prompt {i}", size="128x128", seed=i, num_inference_steps=8) for i in range(4)))
        assert all(r[0].shape == (128, 128, 3) for r in results)
        with pytest.raises(ImageError) as bad:
            await c.generate("x", size="1x1")
        assert bad.value.status == 400
    c1, t1 = batches()
    assert (t1 - t0) / (c1 - c0) > 1.5, "concurrent requests did not share steps"
