"""/v1/world rollout sessions on the shared server: state per session, resume from the
buffer, fenced cancel and supersede, memory freed, bad input."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

from clients.world import WorldClient
from tests.harness import ADMIN_HEADERS, ADMIN_KEY, http_client

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
        for x, y in zip(ACTIONS_A, ACTIONS_B):
            fa, fb = await asyncio.gather(a.step(x), b.step(y))
            got_a.append(fa)
            got_b.append(fb)
    assert all(close(x, y) for x, y in zip(alone_a + alone_b, got_a + got_b))
    # the history conditions the next frame: after different actions the frames differ
    assert not close(alone_a[2], alone_b[2])


async def test_a_resumed_session_continues_from_its_buffer(server):
    straight = await rollout(server, 7, ACTIONS_A)
    w = await world(server, 7)
    first = [await w.step(a) for a in ACTIONS_A[:2]]
    sid, token = w.session_id, w.resume_token
    await w.close()  # dropped: the session is detached, its buffer kept
    w2 = await WorldClient.connect(url(server), ADMIN_KEY, session_id=sid, resume_token=token)
    async with w2:
        assert w2.first["type"] == "session.resumed" and w2.session["frame_index"] == 2
        third = await w2.step(ACTIONS_A[2])
    assert all(close(x, y) for x, y in zip(straight, first + [third]))


async def test_a_resume_elsewhere_takes_the_session_over_and_the_old_socket_leaves_it_alone(server):
    a = await world(server, 9)
    await a.step(ACTIONS_A[0])
    b = await WorldClient.connect(url(server), ADMIN_KEY, session_id=a.session_id, resume_token=a.resume_token)
    try:
        assert b.first["type"] == "session.resumed" and b.session["frame_index"] == 1
        await a.close()  # the old socket goes away after the takeover
        await asyncio.sleep(0.3)
        await b.step(ACTIONS_A[1])
        await b.step(ACTIONS_A[2])
        assert b.session["id"] == a.session_id
    finally:
        await b.close()


async def test_cancel_and_supersede_are_fenced(server):
    w = await world(server, 3)
    async with w:
        await w.update(steps=40)
        await w.send("world.step", action=ACTIONS_A[0])
        started = await w.until("world.step.started")
        await w.until("world.step.progress")
        await w.send("session.update", session={"width": 128})  # not while a step runs
        assert (await w.until("error"))["error"]["code"] == "step_active"
        await w.send("world.cancel")
        seen: list = []
        cancelled = await w.until("world.step.cancelled", seen)
        assert cancelled["step_id"] == started["step_id"] and cancelled["reason"] == "cancelled"
        # supersede: a second step replaces the running one
        await w.send("world.step", action=ACTIONS_A[1])
        s1 = await w.until("world.step.started")
        await w.until("world.step.progress")
        await w.update(steps=4)  # applies to the next step
        await w.send("world.step", action=ACTIONS_A[2])
        after: list = []
        sup = await w.until("world.step.cancelled", after)
        assert sup["step_id"] == s1["step_id"] and sup["reason"] == "superseded"
        done = await w.until("world.step.done", after)
        # nothing of a cancelled step after its cancellation, and it left no frame behind
        later = after[after.index(sup) + 1 :]
        assert {e.get("step_id") for e in later if e["type"].startswith("world.")} <= {done["step_id"]}
        assert not any(e["type"] == "world.frame" and e["step_id"] == s1["step_id"] for e in after)
        assert done["frame_index"] == 0


async def test_closing_frees_the_latent_buffer(server):
    before = buffer_bytes(server)
    w = await world(server, 5)
    await w.step(ACTIONS_A[0])
    await w.step(ACTIONS_A[1])
    assert buffer_bytes(server) > before
    sid = w.session_id
    await w.send("session.close")
    assert (await w.until("session.closed"))["type"] == "session.closed"
    await w.close()
    for _ in range(50):
        if buffer_bytes(server) == before:
            break
        await asyncio.sleep(0.1)
    assert buffer_bytes(server) == before
    with http_client(server.url, ADMIN_HEADERS) as http:
        assert http.get(f"/v1/sessions/{sid}").status_code in (404, 410)
    # an operator's close (eviction) frees it too
    w = await world(server, 6)
    await w.step(ACTIONS_A[0])
    with http_client(server.url, ADMIN_HEADERS) as http:
        assert http.delete(f"/v1/sessions/{w.session_id}").status_code == 200
    for _ in range(50):
        if buffer_bytes(server) == before:
            break
        await asyncio.sleep(0.1)
    assert buffer_bytes(server) == before
    await w.close()


@pytest.mark.parametrize(
    "event, code",
    [
        ({"type": "world.step"}, "invalid_value"),
        ({"type": "world.step", "action": [1, 2]}, "invalid_value"),
        ({"type": "world.step", "action": ["a", 1, 2, 3]}, "invalid_value"),
        ({"type": "world.step", "action": [1e400, 0, 0, 0]}, "invalid_value"),
        ({"type": "world.step", "action": [10**400, 0, 0, 0]}, "invalid_value"),
        ({"type": "session.update", "session": {"width": 100}}, "invalid_value"),
        ({"type": "session.update", "session": {"steps": 0}}, "invalid_value"),
        ({"type": "session.update", "session": {"colour": "red"}}, "unknown_parameter"),
        ({"type": "world.cancel"}, "no_active_step"),
        ({"type": "world.teleport"}, "invalid_event"),
    ],
)
async def test_bad_events_get_error_events_and_the_session_goes_on(server, event, code):
    w = await world(server, 2)
    async with w:
        await w.send(**event)
        err = await w.until("error")
        assert err["error"]["code"] == code, err
        await w.ws.send("{not json")
        assert (await w.until("error"))["error"]["code"] == "invalid_json"
        frame = await w.step(ACTIONS_A[0])
        assert frame.shape == (64, 64, 3)
