"""Stages placed outside the server, on real Ray (omni_rt.placement).

The in-process server (testkit: the real app over fake engines) with the
`code2wav` stage placed in a Ray actor (`process` on this node, or `ray` on a node of
a multi-node test cluster, `ray.cluster_utils.Cluster`): stream = batch (the same
audio as in process), abort and barge-in across the boundary (no stale audio, the
remote work freed), an actor killed mid-answer (the answer fails with
`stage_unavailable`, the session goes on, Ray restarts the actor and a later answer
succeeds), two front ends sharing one actor, and every misconfiguration refused with
the stage named. The last test runs the real tiny engines: SNAC in an actor on another
node, equal to the in-process server for the same seed.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

from omni_rt import placement
from omni_rt.placement import RemoteStage
from omni_rt.specs import SpecError
from testkit import Speeds, serve
from testkit.wire import barge_in, connect

pytestmark = pytest.mark.integration  # a Ray cluster and stage processes of their own

SPEECH = {"model": "tts", "input": "one two three four five six", "voice": "tara", "response_format": "pcm", "seed": 3}


def remote(kind: str = "process", pipelines: tuple[str, ...] = ("tts",), **placement_args: Any) -> dict[str, Any]:
    """An overlay placing code2wav in a Ray actor, its edge through the ray connector."""
    p = {"kind": kind, "num_cpus": 0, **placement_args}
    return {"pipelines": {name: {"stages": {"code2wav": {"placement": p}}, "edges": {"talker->code2wav": {"connector": "ray"}}}
                          for name in pipelines}}


@pytest.fixture
def fresh_ray() -> Iterator[None]:
    """Each test connects Ray its own way (an instance of the server's own, or a test
    cluster); the connection is per process, so it is closed after each."""
    yield
    ray.shutdown()
    placement._shared = False


@pytest.fixture
def cluster(fresh_ray: None) -> Iterator[Cluster]:
    """Three nodes on this machine: A (the head, where the server's process is), B and
    C, each with a resource of its own and `decoder` on B and C."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1}, "object_store_memory": 80 << 20})
    c.add_node(num_cpus=1, resources={"node_b": 1, "decoder": 1}, object_store_memory=80 << 20)
    c.add_node(num_cpus=1, resources={"node_c": 1, "decoder": 1}, object_store_memory=80 << 20)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


def _remote_stage(h: Any, stage: str = "code2wav") -> RemoteStage:
    proc = h.runtime.pools[stage].replicas[0].processor
    assert isinstance(proc, RemoteStage)
    return proc


async def _speech(h: Any, **kw: Any) -> tuple[int, bytes]:
    r = await h.client.post("/v1/audio/speech", json={**SPEECH, **kw})
    return r.status, await r.read()


async def test_a_stage_in_a_process_of_its_own_gives_the_same_audio(fresh_ray):
    async with serve(["tts"]) as h:
        status, local = await _speech(h)
        assert status == 200 and len(local) == 6 * 2048 * 2
    async with serve(["tts"], remote()) as h:
        status, body = await _speech(h)
        assert status == 200 and body == local  # stream = batch across the boundary
        proc = _remote_stage(h)
        assert proc.info["pid"] != os.getpid() and proc.info["node"] == ray.get_runtime_context().get_node_id()
        # the actor's decoder reported its chunks back to this server's meter, and its
        # process's CPU with them: admission weighs the placed stage
        meters = h.runtime.orchestrator.meters
        assert meters.generation.rtfs(), "the placed decoder's stream never reached the server's meter"
        assert meters._placed.get(proc.info["pid"], 0.0) > 0.0
        health = (await (await h.client.get("/health")).json())["stages"]["code2wav"]
        assert health["healthy"] and health["replicas"][0]["remote"]["placement"] == "process"
        assert health["replicas"][0]["remote"]["actor"] == "omni-rt:tts:code2wav:0"


async def test_abort_and_barge_in_reach_the_remote_stage_and_nothing_stale_follows(fresh_ray):
    slow = Speeds(token_s=0.004, step_s=0.01)
    async with serve(["voice", "tts"], remote(pipelines=("voice", "tts")), speeds=slow) as h:
        proc = _remote_stage(h)
        # a client that goes away mid-answer: the remote request is aborted, its work freed
        r = await h.client.post("/v1/audio/speech", json={**SPEECH, "input": " ".join(["word"] * 300)})
        await r.content.readany()
        r.close()
        await _until(lambda: h.runtime.orchestrator.running() == [])
        assert await _until_remote_idle(proc)
        # barge-in on the realtime socket: the cancelled answer's audio never follows
        ws = await connect(h, "/v1/realtime?model=gpt-realtime")
        await ws.until("session.created")
        rid, done, second, stale = await barge_in(ws)
        assert done["response"]["id"] == rid and done["response"]["status"] == "cancelled"
        assert second["response"]["status"] == "completed"
        assert stale == []
        await ws.ws.close()
        assert await _until_remote_idle(proc)


async def test_an_actor_killed_mid_answer_fails_that_answer_and_the_session_goes_on(fresh_ray):
    slow = Speeds(token_s=0.004, step_s=0.01)
    async with serve(["voice", "tts"], remote(pipelines=("voice", "tts")), speeds=slow) as h:
        proc = _remote_stage(h)
        ws = await connect(h, "/v1/realtime?model=gpt-realtime")
        await ws.until("session.created")
        await ws.send("session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        await ws.until("session.updated")
        await ws.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]})
        await ws.send("response.create", response={"max_output_tokens": 400})
        await ws.until("response.output_audio.delta")
        os.kill(proc.info["pid"], signal.SIGKILL)  # the process holding code2wav dies
        failed = await ws.until("response.done", timeout=30)
        assert failed["response"]["status"] == "failed"
        assert failed["response"]["status_details"]["error"]["code"] == "stage_unavailable"
        # the session is still there; once Ray has restarted the actor, the next answer is whole
        assert await _until(lambda: proc.unavailable() is None, 60)
        await ws.send("response.create", response={"max_output_tokens": 8})
        ok = await ws.until("response.done", timeout=30)
        assert ok["response"]["status"] == "completed"
        assert any(e["type"] == "response.output_audio.delta" and e.get("response_id") == ok["response"]["id"] for e in ws.seen)
        await ws.ws.close()


async def test_a_stage_on_another_node_and_its_restart_elsewhere_when_the_node_dies(cluster):
    async with serve(["tts"], remote("ray", resources={"decoder": 0.5}, max_restarts=-1) | {"server": {"ray_address": cluster.address}}) as h:
        proc = _remote_stage(h)
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        first_node = proc.info["node"]
        assert "decoder" in nodes[first_node]  # on B or C, not on the server's node A
        status, body = await _speech(h)
        assert status == 200 and len(body) == 6 * 2048 * 2
        # the node holding the stage goes away: Ray restarts the actor on the other one
        worker = next(n for n in cluster.worker_nodes if n.node_id == first_node)
        cluster.remove_node(worker, allow_graceful=False)
        assert await _until(lambda: proc.unavailable() is not None, 30)
        assert await _until(lambda: proc.unavailable() is None, 120)
        status, again = await _speech(h)
        assert status == 200 and again == body
        assert proc._health["pid"] != proc.info["pid"]


async def test_two_front_ends_share_one_actor_and_one_redis_cap_and_a_different_definition_is_refused(cluster):
    import uuid

    store = {"store": "redis", "redis_prefix": f"omni-rt-test-{uuid.uuid4().hex[:8]}", "max_total": 1, "slot_lease_ttl_s": 300}
    shared = remote("ray", resources={"decoder": 0.5}) | {"server": {"ray_address": cluster.address}, "sessions": store}
    slow = Speeds(token_s=0.004, step_s=0.01)
    async with serve(["tts"], shared, speeds=slow) as a, serve(["tts"], shared, speeds=slow) as b:
        pa, pb = _remote_stage(a), _remote_stage(b)
        assert not pa.owned and not pb.owned  # shared actors belong to the cluster, not to a front end
        assert pa.info["pid"] == pb.info["pid"]  # the second front end attached to the first one's actor
        for h in (a, b):
            status, _ = await _speech(h)
            assert status == 200
        served = (await pa.actor.health.remote())["served"]
        assert served >= 2
        # one cap for both: while A speaks, B is refused
        long = await a.client.post("/v1/audio/speech", json={**SPEECH, "input": " ".join(["word"] * 200)})
        await long.content.readany()
        refused = await b.client.post("/v1/audio/speech", json=SPEECH)
        assert refused.status == 429 and (await refused.json())["error"]["code"] == "session_limit"
        await long.read()
        other = remote("ray", resources={"decoder": 0.5}, max_restarts=3) | {"server": {"ray_address": cluster.address}}
        with pytest.raises(SpecError, match="code2wav.*another definition"):
            async with serve(["tts"], other):
                pass
    actor = ray.get_actor("omni-rt:tts:code2wav:0", namespace=placement.NAMESPACE)  # detached: outlives its front ends
    ray.kill(actor)


async def test_misconfigurations_are_refused_naming_the_stage(fresh_ray):
    from omni_rt.specs import parse_overlay

    with pytest.raises(SpecError, match="code2wav runs outside the server.*ray connector; 'inproc' is inproc"):
        async with serve(["tts"], {"pipelines": {"tts": {"stages": {"code2wav": {"placement": {"kind": "ray"}}}}}}):
            pass
    with pytest.raises(SpecError, match="placement"):
        parse_overlay({"pipelines": {"tts": {"stages": {"code2wav": {"placement": {"kind": "elsewhere"}}}}}}, "test")
    with pytest.raises(SpecError, match="stage code2wav: no node of the Ray cluster offers gpu_x=1"):
        async with serve(["tts"], remote("ray", resources={"gpu_x": 1})):
            pass
    ray.shutdown()
    with pytest.raises(SpecError, match="does not answer"):
        async with serve(["tts"], remote("ray") | {"server": {"ray_address": "127.0.0.1:1"}}):
            pass


async def _until(cond: Any, seconds: float = 10.0) -> bool:
    for _ in range(int(seconds / 0.05)):
        if cond():
            return True
        await asyncio.sleep(0.05)
    return bool(cond())


async def _until_remote_idle(proc: RemoteStage, seconds: float = 10.0) -> bool:
    for _ in range(int(seconds / 0.05)):
        if (await proc.actor.health.remote())["inflight"] == 0:
            return True
        await asyncio.sleep(0.05)
    return False


async def test_real_snac_on_another_node_gives_the_in_process_audio(cluster, models_dir):
    """The real tiny SNAC decoder (torch engine) in an actor on node B, the talker in
    the server's process on node A: the same audio as all in process for the same seed
    (within the float tolerance of a convolution's summation order on another thread
    count; where chunks are cut depends on timing, what they make up does not)."""
    import numpy as np

    from tests.test_tts_pipeline import ATOL, TEXT, edge, synth

    local, local_chunks = await synth(models_dir, edge("chunk"), TEXT)
    placement.connect(cluster.address)
    over = edge("chunk")
    over["pipelines"]["tts"]["edges"]["talker->code2wav"]["connector"] = "ray"
    over["pipelines"]["tts"]["stages"] = {"code2wav": {"placement": {"kind": "ray", "num_cpus": 0, "resources": {"node_b": 0.5}}}}
    remote_audio, remote_chunks = await synth(models_dir, over, TEXT)
    assert len(remote_chunks) > 3 and len(local_chunks) > 3
    np.testing.assert_allclose(remote_audio, local, atol=ATOL, rtol=0)


def test_ray_connector_inlines_small_payloads_and_stores_big_ones(cluster):
    """A payload up to Ray's inline limit travels inside its handle; a bigger one is an
    object in the store, read on another node by Ray's transfer and kept by its owner
    until the request is cleaned up."""
    import numpy as np

    from omni_rt.connectors.ray import INLINE_MAX_BYTES, RayConnector
    from omni_rt.payloads import Fence, Payload, PayloadKind

    placement.connect(cluster.address)
    conn = RayConnector()
    fence = Fence("s")
    small = Payload(PayloadKind.AUDIO, fence, {"x": np.arange(16, dtype=np.float32)})
    big = Payload(PayloadKind.AUDIO, fence, {"x": np.ones(INLINE_MAX_BYTES, dtype=np.float32)})
    hs, hb = conn.put("r", "small", small), conn.put("r", "big", big)
    assert hs.locator is not None and hb.locator is not None
    assert "ref" not in hs.locator and "ref" in hb.locator

    @ray.remote(num_cpus=0, resources={"node_b": 0.1})
    def read(handles: list[Any]) -> tuple[str, list[float]]:
        import ray as r

        reader = RayConnector()
        return r.get_runtime_context().get_node_id(), [float(reader.get(h).arrays["x"].sum()) for h in handles]

    node, sums = ray.get(read.remote([hs, hb]), timeout=60)
    assert sums == [120.0, float(INLINE_MAX_BYTES)]
    assert node == next(n["NodeID"] for n in ray.nodes() if "node_b" in n["Resources"])
    assert node != ray.get_runtime_context().get_node_id()
    assert conn.get(hs) is small  # in the writer's process the payload itself
    health = conn.health()
    assert health["puts"] == 2 and health["inlined"] == 1 and health["live_keys"] == 2
    assert conn.cleanup("r") == 2 and conn.live_keys() == 0
