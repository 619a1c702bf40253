"""Live session migration between two real nodes on Redis (`omni-rt serve` processes on
the tiny checkpoints, one Redis prefix): `omni-rt drain` moves a duplex conversation
and a world rollout from node A to node B, where their clients resume; SIGTERM drains
before the process exits; a node killed with `kill -9` loses only what it held."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from clients.duplex import DuplexClient
from clients.world import WorldClient
from testkit.harness import ADMIN_HEADERS, ADMIN_KEY, http_client
from tests.conftest import REPO, start_server

pytestmark = [pytest.mark.integration]

ACTIONS = [[0.5, -0.25, 0.0, 1.0], [0.0, 1.0, -0.5, 0.0], [-1.0, 0.5, 0.25, 0.0]]


def overlay(prefix: str, node: str, pipelines: tuple[str, ...]) -> dict:
    import pipelines as builtin

    return {
        "server": {"api_keys": [{"key": ADMIN_KEY, "principal": "ops", "admin": True}], "drain_timeout_s": 20},
        "sessions": {"store": "redis", "redis_prefix": prefix, "node_id": node, "slot_lease_ttl_s": 3, "reaper_interval_s": 0.5},
        "pipelines": {name: {"enabled": name in pipelines} for name in builtin.load_all()},
    }


@pytest.fixture(scope="module")
def prefix():
    p = f"omni-rt-nodes-{secrets.token_hex(4)}"
    yield p
    import redis

    r = redis.Redis()
    keys = list(r.scan_iter(f"{p}:*"))
    if keys:
        r.delete(*keys)
    r.close()


@pytest.fixture(scope="module")
def nodes(prefix, models_dir, tmp_path_factory):
    """Node A and node B, each serving the voice and world pipelines."""
    procs = []
    try:
        for name in ("a", "b"):
            procs.append(start_server(overlay(prefix, name, ("voice", "world")), tmp_path_factory.mktemp(f"node-{name}"), models_dir))
        yield procs
    finally:
        for p in procs:
            p.stop()


def ws(node, path: str) -> str:
    return node.url.replace("http://", "ws://") + path


async def ask(c: DuplexClient, text: str, tokens: int = 6) -> dict:
    await c.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
    await c.send("response.create", response={"max_output_tokens": tokens})
    return await c.until("response.done")


async def items(c: DuplexClient, ids: list[str]) -> list[dict]:
    out = []
    for item_id in ids:
        await c.send("conversation.item.retrieve", item_id=item_id)
        out.append((await c.until("conversation.item.retrieved"))["item"])
    return out


async def world(node, seed: int) -> WorldClient:
    w = await WorldClient.connect(ws(node, "/v1/world"), ADMIN_KEY)
    await w.update(prompt="a forest path", width=64, height=64, steps=4, seed=seed, image_format="png")
    return w


@pytest.mark.vllm
async def test_drain_moves_a_duplex_call_and_a_world_rollout_to_the_other_node(nodes):
    a, b = nodes
    # the reference rollout: node B alone, three steps
    ref = await world(b, 11)
    expected = [await ref.step(act) for act in ACTIONS]
    await ref.close()

    call = await DuplexClient.connect(ws(a, "/v1/duplex"), ADMIN_KEY)
    await call.update(turn_detection=None, instructions="Answer in one sentence.")
    seen: list = []
    await call.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello there"}]})
    await call.send("response.create", response={"max_output_tokens": 6})
    first = await call.until("response.done", seen)
    assert first["response"]["status"] == "completed"
    ids = [e["item"]["id"] for e in seen if e["type"] == "conversation.item.done"]
    assert len(ids) == 2  # the question and the answer
    history = await items(call, ids)
    roll = await world(a, 11)
    shown = [await roll.step_frames(act) for act in ACTIONS[:2]]  # a step may render several frames
    got = [frames[-1] for frames in shown]

    # the operator drains node A with the CLI
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "omni_server.cli", "drain", "--url", a.url, "--api-key", ADMIN_KEY, "--timeout", "20"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "2 moved" in done.stderr and time.monotonic() - t0 < 30
    moved = await call.until("session.migrated")
    assert moved["session_id"] == call.session_id
    await call.until("connection.closed")
    assert call.closed[0] == 1012
    assert (await roll.until("session.migrated"))["session_id"] == roll.session["id"]
    with http_client(a.url, ADMIN_HEADERS) as http:
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert http.get("/v1/sessions").json()["data"] == []

    # both resume on node B
    call2 = await DuplexClient.connect(ws(b, "/v1/duplex"), ADMIN_KEY, session_id=call.session_id, resume_token=call.resume_token)
    assert call2.first["type"] == "session.resumed" and call2.session["instructions"] == "Answer in one sentence."
    assert await items(call2, ids) == history
    again = await ask(call2, "Tell me more")
    assert again["response"]["status"] == "completed"
    await call2.close()

    roll2 = await WorldClient.connect(ws(b, "/v1/world"), ADMIN_KEY, session_id=roll.session["id"], resume_token=roll.resume_token)
    assert roll2.session["frame_index"] == sum(len(f) for f in shown)
    got.append(await roll2.step(ACTIONS[2]))
    assert all(np.array_equal(x, y) for x, y in zip(got, expected, strict=True))  # bit-identical frames (PNG)
    await roll2.close()
    with http_client(b.url, ADMIN_HEADERS) as http:
        body = http.get("/metrics").text
        assert 'omni_rt_sessions_migrated_total{direction="in",kind="duplex"} 1.0' in body
        assert 'omni_rt_sessions_migrated_total{direction="in",kind="world"} 1.0' in body


async def test_sigterm_drains_then_exits_and_kill_9_loses_only_what_was_in_memory(nodes, prefix, models_dir, tmp_path_factory):
    _a, b = nodes
    # SIGTERM: the session moves before the process exits
    c = start_server(overlay(prefix, "c", ("world",)), tmp_path_factory.mktemp("node-c"), models_dir)
    try:
        w = await world(c, 5)
        await w.step(ACTIONS[0])
        os.kill(c.proc.pid, signal.SIGTERM)
        assert (await w.until("session.migrated"))["session_id"] == w.session["id"]
        assert c.proc.wait(timeout=60) == 0
        assert "draining" in c.log_file.read_text()
        w2 = await WorldClient.connect(ws(b, "/v1/world"), ADMIN_KEY, session_id=w.session["id"], resume_token=w.resume_token)
        assert w2.session["frame_index"] == 1
        await w2.close()
    finally:
        c.stop()

    # kill -9: nothing is drained; the session's state was only in that process
    d = start_server(overlay(prefix, "d", ("world",)), tmp_path_factory.mktemp("node-d"), models_dir)
    try:
        w = await world(d, 5)
        await w.step(ACTIONS[0])
        sid, token = w.session["id"], w.resume_token
        os.kill(d.proc.pid, signal.SIGKILL)
        d.proc.wait(timeout=30)
        with pytest.raises(RuntimeError) as refused:  # its directory entry says where it lived, until the lease lapses
            await WorldClient.connect(ws(b, "/v1/world"), ADMIN_KEY, session_id=sid, resume_token=token)
        assert "session_elsewhere" in str(refused.value) or "session_not_found" in str(refused.value)
        deadline = time.monotonic() + 20
        with http_client(b.url, ADMIN_HEADERS) as http:
            while http.get("/v1/sessions").json()["cluster"]["total"] > 0:  # its slot lapses with its lease
                assert time.monotonic() < deadline, "the dead node's slot never lapsed"
                time.sleep(0.5)
        fresh = await world(b, 5)  # node B keeps serving
        await fresh.step(ACTIONS[0])
        await fresh.close()
    finally:
        d.stop()
