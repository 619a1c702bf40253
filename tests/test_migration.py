"""Draining a node: its sessions move through the session store (Redis) to another node
and the clients resume there. Two in-process nodes (the real app over fakes) share one
Redis prefix, as two servers behind a load balancer do."""

from __future__ import annotations

import asyncio
import secrets

import msgpack
import numpy as np
import pytest
import redis.asyncio as aioredis

from clients.duplex import DuplexClient
from clients.realtime import RealtimeError
from clients.world import WorldClient
from protocols.duplex import Duplex
from sessions import migration
from sessions.errors import Draining, InvalidResumeToken, UnknownPipeline
from testkit import serve

REDIS_URL = "redis://127.0.0.1:6379/0"
ACTIONS = [[0.5, -0.25, 0.0, 1.0], [0.0, 1.0, -0.5, 0.0], [-1.0, 0.5, 0.25, 0.0]]


@pytest.fixture
async def prefix():
    p = f"omni-rt-test-{secrets.token_hex(4)}"
    yield p
    r = aioredis.Redis.from_url(REDIS_URL)
    keys = [k async for k in r.scan_iter(f"{p}:*")]
    if keys:
        await r.delete(*keys)
    await r.aclose()


def node(pipelines: list[str], prefix: str, name: str, **sessions):
    return serve(pipelines, {"sessions": {"store": "redis", "redis_url": REDIS_URL, "redis_prefix": prefix, "node_id": name,
                                       "slot_lease_ttl_s": 600, **sessions}})


async def ask(c: DuplexClient, text: str, tokens: int = 4) -> dict:
    await c.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
    await c.send("response.create", response={"max_output_tokens": tokens})
    return await c.until("response.done")


def items_of(h, sid: str) -> list[tuple[str, str, str]]:
    s = h.sessions.get(sid)
    return [(it.id, it.role, it.text_for_prompt()) for it in s.kept(Duplex).conv.items.values()]


async def test_a_duplex_conversation_moves_to_another_node_with_its_history(prefix):
    async with node(["voice"], prefix, "a") as a, node(["voice"], prefix, "b") as b:
        c = await DuplexClient.connect(a.url("/v1/duplex", ws=True))
        sid, token = c.session_id, str(c.resume_token)
        await c.update(turn_detection=None, instructions="Be brief.", audio={"output": {"format": {"type": "audio/pcm", "rate": 16000}}})
        first = await ask(c, "Hello there")
        assert first["response"]["status"] == "completed"
        await ask(c, "And how are you?")
        before = items_of(a, sid)
        assert len(before) == 4  # two questions, two answers
        # the operator drains node a while the client is attached
        drained = await a.client.post("/admin/drain", json={"timeout_s": 5})
        report = await drained.json()
        assert drained.status == 200 and [m["session_id"] for m in report["moved"]] == [sid] and report["remaining"] == 0
        moved = await c.until("session.migrated")
        assert moved["session_id"] == sid and moved["reason"] == "drain"
        await c.until("connection.closed")
        assert c.closed is not None and c.closed[0] == 1012
        last_seq = c.last_seq
        # a is draining: health says so, nothing new is admitted there
        health = await a.client.get("/health")
        assert health.status == 503 and (await health.json())["status"] == "draining"
        with pytest.raises(RealtimeError) as refused:
            await DuplexClient.connect(a.url("/v1/duplex", ws=True))
        assert refused.value.event["error"]["code"] == "capacity"

        # the client resumes on b: same conversation, same settings, the sequence goes on
        c2 = await DuplexClient.connect(b.url("/v1/duplex", ws=True), session_id=sid, resume_token=token)
        assert c2.first["type"] == "session.resumed" and c2.session["id"] == sid
        assert c2.first["server_event_seq"] > last_seq
        assert c2.session["instructions"] == "Be brief." and c2.session["audio"]["output"]["format"]["rate"] == 16000
        assert items_of(b, sid) == before
        third = await ask(c2, "One more thing")
        assert third["response"]["status"] == "completed"
        after = items_of(b, sid)
        assert after[:4] == before and len(after) == 6
        assert b.sessions.stats["moved_in"] == 1 and a.sessions.stats["moved_out"] == 1
        # the state was taken: a second resume with the old token is not another copy
        assert await b.sessions.store.get_state(sid) is None
        await c2.close()


async def test_a_world_rollout_moved_between_steps_continues_bit_identically(prefix):
    async with node(["world"], prefix, "a") as a, node(["world"], prefix, "b") as b:
        # the reference: one node, three steps
        async with await WorldClient.connect(a.url("/v1/world", ws=True)) as ref:
            await ref.update(seed=7, prompt="a forest path", image_format="png")
            expected = [await ref.step(act) for act in ACTIONS]
        w = await WorldClient.connect(a.url("/v1/world", ws=True))
        await w.update(seed=7, prompt="a forest path", image_format="png")
        sid, token = w.session["id"], w.resume_token
        got = [await w.step(act) for act in ACTIONS[:2]]
        history = [x.copy() for x in a.sessions.get(sid).data["world"]["history"]]
        report = await (await a.client.post("/admin/drain", json={"timeout_s": 5})).json()
        assert [m["session_id"] for m in report["moved"]] == [sid]
        assert (await w.until("session.migrated"))["session_id"] == sid
        await w.close()
        w2 = await WorldClient.connect(b.url("/v1/world", ws=True), session_id=sid, resume_token=token)
        assert w2.session["frame_index"] == 2 and w2.session["seed"] == 7
        moved = b.sessions.get(sid).data["world"]["history"]
        assert len(moved) == len(history) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(moved, history, strict=True))
        got.append(await w2.step(ACTIONS[2]))
        assert all(np.array_equal(x, y) for x, y in zip(got, expected, strict=True))
        await w2.close()


async def test_a_detached_duplex_session_moves_with_what_its_client_has_not_read(prefix):
    async with node(["voice"], prefix, "a") as a, node(["voice"], prefix, "b") as b:
        c = await DuplexClient.connect(a.url("/v1/duplex", ws=True))
        sid, token = c.session_id, str(c.resume_token)
        await c.update(turn_detection=None)
        await c.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]})
        await c.until("conversation.item.done")
        await c.drop()
        for _ in range(100):
            if a.sessions.get(sid).state.value == "detached":
                break
            await asyncio.sleep(0.01)
        a.sessions.get(sid).emit("heartbeat", {"interval_s": 0})  # an event produced while it was away
        report = await a.sessions.drain(5)
        assert [m["session_id"] for m in report["moved"]] == [sid]
        c2 = await DuplexClient.connect(b.url("/v1/duplex", ws=True), session_id=sid, resume_token=token)
        assert c2.first["replayed_events"] >= 1
        assert (await c2.until("heartbeat"))["interval_s"] == 0
        await c2.close()


async def test_sessions_that_cannot_move_finish_and_end_with_1012(prefix):
    async with node(["voice"], prefix, "a") as a:
        rt = await a.client.ws_connect("/v1/realtime")
        created = await rt.receive_json()
        assert created["type"] == "session.created"
        report = await a.sessions.drain(5)
        assert [e["session_id"] for e in report["ended"]] == [created["session"]["id"]] and not report["moved"]
        while (await rt.receive()).type.name == "TEXT":
            pass
        assert rt.close_code == 1012


async def test_bad_resumes_of_a_moved_session_are_refused_and_restore_nothing(prefix):
    async with node(["voice"], prefix, "a") as a, node(["voice"], prefix, "b") as b, node(["tts"], prefix, "c") as c_node:
        c = await DuplexClient.connect(a.url("/v1/duplex", ws=True))
        sid, token = c.session_id, str(c.resume_token)
        await c.update(turn_detection=None)
        await ask(c, "Hello")
        await a.sessions.drain(5)
        await c.close()
        blob = await b.sessions.store.get_state(sid)
        assert blob is not None
        # a forged token
        with pytest.raises(RealtimeError) as bad:
            await DuplexClient.connect(b.url("/v1/duplex", ws=True), session_id=sid, resume_token="forged-" + token)
        assert bad.value.event["error"]["code"] == "invalid_resume_token"
        # a node without the pipeline
        with pytest.raises(UnknownPipeline, match="does not serve"):
            await c_node.sessions.resume(sid, token)
        # a draining node does not adopt
        b.sessions.draining = True
        with pytest.raises(Draining):
            await b.sessions.resume(sid, token)
        b.sessions.draining = False
        # a blob of another version
        doc = msgpack.unpackb(blob, ext_hook=migration._ext)
        await b.sessions.store.put_state(sid, msgpack.packb({**doc, "version": 99}, default=migration._default), 30, {"session_id": sid, "state": "migrated"})
        with pytest.raises(migration.MigrationError, match="version 99"):
            await b.sessions.resume(sid, token)
        # a state its wire cannot use: refused, and the slot it took is given back
        broken = {**doc, "state": {**doc["state"], "transport": {**doc["state"]["transport"], "in_rate": 12345}}}
        await b.sessions.store.put_state(sid, msgpack.packb(broken, default=migration._default), 30, {"session_id": sid, "state": "migrated"})
        with pytest.raises(migration.MigrationFailed):
            await b.sessions.resume(sid, token)
        assert (await b.sessions.counts())["total"] == 0 and not b.sessions.sessions()
        # garbage
        await b.sessions.store.put_state(sid, b"\x00not msgpack", 30, {"session_id": sid, "state": "migrated"})
        with pytest.raises(migration.MigrationError, match="does not decode"):
            await b.sessions.resume(sid, token)
        # the real state still resumes after all that
        await b.sessions.store.put_state(sid, blob, 30, {"session_id": sid, "state": "migrated"})
        with pytest.raises(InvalidResumeToken):
            await b.sessions.resume(sid, None)
        s = await b.sessions.resume(sid, token)
        assert s.id == sid and len(s.kept(Duplex).conv.items) == 2


def test_a_state_over_its_bound_is_refused() -> None:
    core = {"id": "sess_x"}
    with pytest.raises(migration.MigrationError, match="over sessions.migration_max_bytes"):
        migration.encode(core, {"latents": np.zeros(1 << 16, np.float32)}, 1 << 16)
    blob = migration.encode(core, {"latents": np.arange(6, dtype=np.float16).reshape(2, 3)}, 1 << 16)
    back = migration.decode("sess_x", blob, 1 << 16)["state"]["latents"]
    assert back.dtype == np.float16 and back.shape == (2, 3) and np.array_equal(back, np.arange(6).reshape(2, 3))
    with pytest.raises(migration.MigrationError, match="names another session"):
        migration.decode("sess_y", blob, 1 << 16)


async def test_the_memory_store_keeps_a_moved_state_for_its_ttl_only() -> None:
    from sessions import MemoryStore

    store = MemoryStore()
    await store.put_state("sess_x", b"blob", 0.05, {"session_id": "sess_x", "state": "migrated"})
    assert await store.get_state("sess_x") == b"blob" and (await store.lookup("sess_x"))["state"] == "migrated"
    await asyncio.sleep(0.06)
    assert await store.get_state("sess_x") is None and await store.lookup("sess_x") is None


async def test_a_moved_session_is_weighed_like_a_new_one_where_it_resumes(prefix):
    """A rolling deploy must not push the receiving node past real time: a moved voice
    session goes through the same load-aware admission as a new one. Node b, already
    serving one session at 0.45 a session, refuses it with capacity (retry-after); its
    state stays in the store, and once b has room the client resumes it there."""
    async with node(["voice"], prefix, "a") as a, node(["voice"], prefix, "b", realtime_admission={"session_cost_rtf": 0.45}) as b:
        c = await DuplexClient.connect(a.url("/v1/duplex", ws=True))
        sid, token = c.session_id, str(c.resume_token)
        await c.update(turn_detection=None)
        assert (await ask(c, "Hello there"))["response"]["status"] == "completed"
        resident = await DuplexClient.connect(b.url("/v1/duplex", ws=True))  # b's one session
        report = await (await a.client.post("/admin/drain", json={"timeout_s": 5})).json()
        assert [m["session_id"] for m in report["moved"]] == [sid]
        with pytest.raises(RealtimeError) as refused:  # 2 x 0.45 = 0.9 > 0.8
            await DuplexClient.connect(b.url("/v1/duplex", ws=True), session_id=sid, resume_token=token)
        assert refused.value.event["error"]["code"] == "capacity" and "retry in" in refused.value.event["error"]["message"]
        assert b.sessions.stats["moved_in"] == 0 and await b.sessions.store.get_state(sid) is not None
        assert [d for d in b.sessions.decisions if d.get("reason") == "capacity"][-1]["message"].startswith("moved: ")
        await resident.close()
        await b.sessions.end(b.sessions.get(resident.session_id), "closed")
        c2 = await DuplexClient.connect(b.url("/v1/duplex", ws=True), session_id=sid, resume_token=token)
        assert c2.first["type"] == "session.resumed" and b.sessions.stats["moved_in"] == 1
        assert (await ask(c2, "Still there?"))["response"]["status"] == "completed"
        await c2.close()
