"""Robots in load-aware admission, in-process (testkit: the real app over a
fake policy): a robot that declares its control rate (`?control_hz=…&replan_steps=…`)
is weighed like a voice session and refused with openpi's text frame and close 1013
over capacity; its calls report their share of its budget to the meter; a robot that
declares no rate is not weighed; a bad rate is refused as bad input."""

from __future__ import annotations

import asyncio

import aiohttp

from clients.openpi import droid_observation, packb, unpackb
from testkit import serve

OVERLAY = {"sessions": {"realtime_admission": {"session_cost_rtf": 0.3, "window_s": 0.5}}}


async def _robot(h, query: str = "") -> tuple[aiohttp.ClientWebSocketResponse, aiohttp.WSMessage]:
    ws = await h.client.ws_connect(f"/v1/openpi{query}")
    return ws, await asyncio.wait_for(ws.receive(), 5)


async def _refusal(ws: aiohttp.ClientWebSocketResponse, first: aiohttp.WSMessage) -> tuple[str, int | None]:
    assert first.type is aiohttp.WSMsgType.TEXT, first
    closing = await asyncio.wait_for(ws.receive(), 5)
    assert closing.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    return first.data, ws.close_code


async def test_robots_with_a_declared_rate_are_weighed_and_refused_over_capacity():
    async with serve(["robot"], OVERLAY) as h:
        # with a prior cost of 0.3 a session, two robots fit under 0.65
        robots = []
        for _ in range(2):
            ws, meta = await _robot(h, "?control_hz=15&replan_steps=8")
            md = unpackb(meta.data)
            assert md["realtime"] == {"control_hz": 15.0, "replan_steps": 8, "budget_ms": 1000.0 * 8 / 15}
            robots.append(ws)
        extra, first = await _robot(h, "?control_hz=15")
        text, code = await _refusal(extra, first)
        assert text.startswith("capacity:") and "retry in 5 s" in text and code == 1013
        assert h.sessions.health()["realtime_admission"]["refusing"] is True
        # a robot that declares no rate has no deadline to keep: not weighed
        plain, meta = await _robot(h)
        assert meta.type is aiohttp.WSMsgType.BINARY and "realtime" not in unpackb(meta.data)
        assert h.sessions.realtime_sessions() == 2
        # each call reports its time over the robot's budget (8 actions at 15 Hz)
        await robots[0].send_bytes(packb(droid_observation(0, size=32)))
        reply = unpackb((await asyncio.wait_for(robots[0].receive(), 5)).data)
        assert reply["actions"].ndim == 2
        worst = h.sessions.meters.generation.worst()
        assert worst is not None and 0 < worst <= reply["server_timing"]["infer_ms"] / (1000.0 * 8 / 15) + 1e-9
        for ws in (*robots, plain):
            await ws.close()


async def test_a_bad_control_rate_is_refused_as_bad_input():
    async with serve(["robot"]) as h:
        for query, message in (("?control_hz=fast", "control_hz must be a number"), ("?control_hz=0", "control_hz must be in"),
                               ("?control_hz=15&replan_steps=0", "replan_steps must be an integer in 1.."),
                               ("?control_hz=15&replan_steps=9999", "replan_steps must be an integer in 1.."),
                               ("?replan_steps=4", "replan_steps needs control_hz")):
            ws, first = await _robot(h, query)
            text, code = await _refusal(ws, first)
            assert message in text and code == 1011, (query, text, code)
        ok, meta = await _robot(h, "?control_hz=50")  # the server goes on
        assert meta.type is aiohttp.WSMsgType.BINARY
        await ok.close()
