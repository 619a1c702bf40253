"""The pages and the dashboard's data in-process over fakes: every page is linked from
`/` and loads without a key, their shared files and vendored chart library are served
(nothing else under static/), the dashboard's snapshot and live stream show sessions,
admission decisions and stages, for admins only. (The pages' scripts in a real
browser: tests/test_pages.py.)"""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from clients.world import WorldClient, WorldError
from testkit import Speeds, serve
from ui.dashboard import Window, quantile

ADMIN, ALICE = "k-admin-pages-1", "k-alice-pages-1"
KEYS = {"api_keys": [{"key": ADMIN, "principal": "ops", "admin": True}, {"key": ALICE, "principal": "alice"}]}
PAGES = ["/demo", "/demo/world", "/demo/video", "/dashboard"]


def auth(key: str = ADMIN) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture
async def h():
    async with serve(["world", "video_edit", "voice"], {"server": KEYS, "sessions": {"principal_caps": {"alice": 1}}},
                     speeds=Speeds(diffusion_step_s=0.001)) as harness:
        yield harness


async def test_the_index_links_every_page_and_each_loads_without_a_key(h):
    index = await (await h.client.get("/")).text()
    for path in PAGES:
        assert f'href="{path}"' in index, path
        r = await h.client.get(path)
        body = await r.text()
        assert r.status == 200 and r.content_type == "text/html", path
        assert '<link rel="stylesheet" href="/static/omni.css">' in body and "http://" not in body and "https://" not in body, path
        for src in re.findall(r'(?:src|href)="(/static/[^"]+)"', body):  # everything a page loads is here
            assert (await h.client.get(src)).status == 200, (path, src)
    # what the pages call still needs a key
    assert (await h.client.get("/v1/dashboard")).status == 401
    r = await h.client.get("/v1/world", headers={"upgrade": "websocket", "connection": "upgrade", "sec-websocket-version": "13",
                                                  "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ=="})
    assert r.status == 401


async def test_static_serves_the_shared_files_and_nothing_else(h):
    r = await h.client.get("/static/vendor/uplot/uPlot.iife.min.js")
    assert r.status == 200 and "javascript" in r.content_type and "uPlot" in await r.text()
    lic = await (await h.client.get("/static/vendor/uplot/LICENSE")).text()
    assert "MIT License" in lic
    assert (await h.client.get("/static/omni.css")).content_type == "text/css"
    for bad in ["/static/nope.js", "/static/world.html", "/static/..%2fpages.py", "/static/vendor"]:
        r = await h.client.get(bad)
        assert r.status == 404, bad
        assert (await r.json())["error"]["code"] == "not_found", bad
    # dot segments are resolved before routing: outside /static/ a key is needed again
    r = await h.client.get("/static/%2e%2e/pages.py")
    assert r.status == 401 and r.url.path == "/pages.py"


async def test_pages_not_mounted_are_not_linked():
    async with serve(["tts"]) as h:
        index = await (await h.client.get("/")).text()
        assert 'href="/dashboard"' in index and 'href="/demo/world"' not in index and 'href="/demo"' not in index
        assert (await h.client.get("/demo/world")).status == 404


async def test_the_dashboard_shows_sessions_admission_and_stages_to_admins_only(h):
    assert (await h.client.get("/v1/dashboard", headers=auth(ALICE))).status == 403
    w = await WorldClient.connect(h.url("/v1/world", ws=True), ALICE)
    await w.update(prompt="a forest path", width=32, height=32, steps=2, seed=1)
    await w.step([1.0, 0.0, 0.0, 0.0])
    with pytest.raises(WorldError):  # alice's cap is 1: refused, and the dashboard says why
        await WorldClient.connect(h.url("/v1/world", ws=True), ALICE)
    r = await h.client.get("/v1/dashboard", headers=auth())
    snap = await r.json()
    assert r.status == 200 and snap["object"] == "dashboard.snapshot"
    sessions = snap["sessions"]
    assert sessions["total"] == 1 and sessions["by_kind"] == {"world": 1} and sessions["by_principal"] == {"alice": 1}
    (row,) = sessions["data"]
    assert row["kind"] == "world" and row["principal"] == "alice" and row["state"] == "active"
    refused, admitted = snap["admission"]["recent"][:2]
    assert refused == {**refused, "kind": "world", "principal": "alice", "admitted": False, "reason": "principal"}
    assert "alice" in refused["message"] or "principal" in refused["message"]
    assert admitted["admitted"] and admitted["session_id"] == row["id"] and "load" not in admitted  # a world session is not weighed
    assert snap["admission"]["admitted_total"] == 1 and snap["admission"]["refused_total"] == 1
    stages = {s["stage"]: s for s in snap["stages"]}
    assert {"world_dit", "thinker", "video_dit"} <= set(stages) and stages["thinker"]["replicas"] == 1
    assert all(isinstance(s["in_flight"], int) for s in stages.values())
    assert set(snap["load"]) >= {"server_cpu_busy", "machine_cpu_percent", "load_avg_1_5_15", "worst_rtf"}
    await w.close()


async def test_a_weighed_session_carries_what_the_admission_measured(h):
    ws = await h.client.ws_connect("/v1/realtime", headers=auth())
    assert json.loads((await ws.receive()).data)["type"] == "session.created"
    snap = await (await h.client.get("/v1/dashboard", headers=auth())).json()
    latest = snap["admission"]["recent"][0]
    assert latest["kind"] == "realtime" and latest["admitted"]
    assert {"predicted_rtf", "session_cost_rtf", "cost_from", "admitting"} <= set(latest["load"])
    assert snap["admission"]["open_realtime"] == 1
    await ws.close()


async def test_the_live_stream_sends_snapshots_and_sees_a_session_open(h):
    r = await h.client.get("/v1/dashboard/events?interval=0.25", headers=auth())
    assert r.status == 200 and r.content_type == "text/event-stream"

    async def snapshot() -> dict:
        block = b""
        while not block.endswith(b"\n\n"):
            block += await asyncio.wait_for(r.content.readline(), 5)
        name, data = block.decode().strip().split("\n")
        assert name == "event: snapshot"
        return json.loads(data.removeprefix("data: "))

    first = await snapshot()
    assert first["sessions"]["total"] == 0 and first["figures_over"] == {"span": "lifetime"}
    w = await WorldClient.connect(h.url("/v1/world", ws=True), ADMIN)
    for _ in range(20):
        later = await snapshot()
        if later["sessions"]["total"] == 1:
            break
    assert later["sessions"]["by_kind"] == {"world": 1} and later["figures_over"] == {"span": "window", "seconds": 60.0}
    r.close()
    await w.close()
    for bad in ["0", "x", "11", "nan"]:
        r = await h.client.get(f"/v1/dashboard/events?interval={bad}", headers=auth())
        assert r.status == 400 and (await r.json())["error"]["param"] == "interval", bad


def test_quantiles_interpolate_inside_the_bucket_as_prometheus_does():
    buckets = [(0.1, 0.0), (0.2, 50.0), (0.5, 90.0), (1.0, 100.0), (float("inf"), 100.0)]
    assert quantile(buckets, 0.5) == pytest.approx(0.2)
    assert quantile(buckets, 0.25) == pytest.approx(0.15)
    assert quantile(buckets, 0.7) == pytest.approx(0.35)
    assert quantile(buckets, 0.99) == pytest.approx(0.95)
    assert quantile([(0.1, 0.0), (float("inf"), 0.0)], 0.5) is None
    assert quantile([(0.1, 1.0), (float("inf"), 4.0)], 0.9) == pytest.approx(0.1)  # past the last bound: that bound


def test_a_window_compares_with_the_oldest_reading_in_its_span():
    w = Window(10.0)
    assert w.take(0.0, {"n": 0}) is None
    assert w.take(4.0, {"n": 1}) == {"n": 0}
    assert w.take(9.0, {"n": 2}) == {"n": 0}
    assert w.take(15.0, {"n": 3}) == {"n": 1}  # 0 fell out of the 10 s span
