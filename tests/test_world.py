"""/v1/world rollout sessions on the shared server: state per session, resume from the
buffer, fenced cancel and supersede, memory freed, bad input."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

from clients.world import WorldClient
from testkit.harness import ADMIN_HEADERS, ADMIN_KEY, http_client
from testkit.wire import drop

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

ACTIONS_A = [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]
ACTIONS_B = [[-1.0, 0.5, 0.0, 0.0], [0.0, -1.0, 0.5, 0.0], [0.5, 0.0, -1.0, 0.0]]


def url(server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/world"


async def world(server, seed: int, prompt: str = "a forest path") -> WorldClient:
    w = await WorldClient.connect(url(server), ADMIN_KEY)
    await w.update(prompt=prompt, width=64, height=64, steps=4, seed=seed)
    return w


def close(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and int(np.abs(a.astype(int) - b.astype(int)).max()) <= 2  # JPEG of equal-up-to-rounding frames


def buffer_bytes(server) -> float:
    with http_client(server.url, ADMIN_HEADERS) as http:
        return float(re.search(r"^omni_rt_world_buffer_bytes (\S+)", http.get("/metrics").text, re.M).group(1))


async def rollout(server, seed: int, actions: list[list[float]]) -> list[np.ndarray]:
    w = await world(server, seed)
    async with w:
        return [await w.step(a) for a in actions]


async def test_sessions_never_see_each_others_state(server):
    alone_a = await rollout(server, 1, ACTIONS_A)
    alone_b = await rollout(server, 1, ACTIONS_B)  # same seed, other actions
    a, b = await world(server, 1), await world(server, 1)
    async with a, b:
        got_a, got_b = [], []
        for x, y in zip(ACTIONS_A, ACTIONS_B, strict=True):
            fa, fb = await asyncio.gather(a.step(x), b.step(y))
            got_a.append(fa)
            got_b.append(fb)
    assert all(close(x, y) for x, y in zip(alone_a + alone_b, got_a + got_b, strict=True))
    # the history conditions the next frame: after different actions the frames differ
    assert not close(alone_a[2], alone_b[2])


async def test_a_resumed_session_continues_from_its_buffer(server):
    straight = await rollout(server, 7, ACTIONS_A)
    w = await world(server, 7)
    first = [await w.step(a) for a in ACTIONS_A[:2]]
    sid, token = w.session_id, w.resume_token
    drop(w.ws)  # dropped (no close frame): the session is detached, its buffer kept
    w2 = await WorldClient.connect(url(server), ADMIN_KEY, session_id=sid, resume_token=token)
    async with w2:
        # the rollout's first step renders 1 frame, every later one frames_per_step (4 on diffusion forcing)
        assert w2.first["type"] == "session.resumed" and w2.session["frame_index"] == 1 + w2.session["frames_per_step"] == 5
        third = await w2.step(ACTIONS_A[2])
    assert all(close(x, y) for x, y in zip(straight, first + [third], strict=True))




async def test_a_prompt_longer_than_the_text_encoder_reads_is_refused(server):
    w = await WorldClient.connect(url(server), ADMIN_KEY)
    async with w:
        limit = w.session.get("max_prompt_tokens") or 128  # the tiny tokenizer: a character a token
        await w.send("session.update", session={"prompt": "x" * (2 * limit)})
        err = await w.until("error", timeout=30)
        assert err["error"]["param"] == "session.prompt" and f"at most {limit}" in err["error"]["message"]
        assert (await w.update(prompt="a forest path"))["session"]["prompt"] == "a forest path"  # the session goes on
