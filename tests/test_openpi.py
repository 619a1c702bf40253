"""OpenPI robot loops on the shared server: the real `openpi-client` (installed without
its numpy<2 pin), DROID- and ALOHA-shaped observations, the reset extension, an
ActionChunkBroker loop, episode isolation, batching == one by one, bad input."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from typing import Any

import msgpack
import numpy as np
import pytest
import websockets.exceptions
import websockets.sync.client
from openpi_client import msgpack_numpy as openpi_msgpack
from openpi_client.action_chunk_broker import ActionChunkBroker
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from clients.openpi import PolicyClient, aloha_observation, droid_observation
from pipelines.tiny.pi0 import IMAGE_SIZE
from protocols.openpi import ProtocolError, flatten, packb, unpackb
from testkit.harness import ADMIN_HEADERS, ALICE_KEY, http_client
from tests.conftest import REPO


def ws_url(server, path: str = "") -> str:
    return server.url.replace("http://", "ws://") + path


def host_port(server) -> tuple[str, int]:
    return server.host, server.port


# ---- the codec (no server) ----------------------------------------------------------------


def test_codec_reads_what_openpi_client_writes_and_back():
    obs = aloha_observation(3)
    obs["scalar"] = np.float32(1.5)
    got = unpackb(openpi_msgpack.packb(obs))
    assert got["prompt"] == obs["prompt"]
    assert got["scalar"] == np.float32(1.5) and isinstance(got["scalar"], np.float32)
    for cam, img in obs["images"].items():
        assert got["images"][cam].dtype == np.uint8 and np.array_equal(got["images"][cam], img)
        assert not got["images"][cam].flags.writeable  # read-only views of the frame, as openpi's
    reply: dict[str, Any] = {"actions": np.arange(12, dtype=np.float32).reshape(3, 4), "server_timing": {"infer_ms": 1.0}}
    back = openpi_msgpack.unpackb(packb(reply))
    assert np.array_equal(back["actions"], reply["actions"]) and back["actions"].dtype == np.float32
    assert back["server_timing"] == {"infer_ms": 1.0}


def _raw_array(dtype: str, shape: list[int], data: bytes, keys: type = bytes) -> bytes:
    k = (lambda s: s.encode()) if keys is bytes else (lambda s: s)
    return msgpack.packb({"x": {k("__ndarray__"): True, k("data"): data, k("dtype"): dtype, k("shape"): shape}})


@pytest.mark.parametrize(
    "frame, message",
    [
        (_raw_array("|O", [1], b"\0" * 8), "object, void, complex"),
        (_raw_array("<c16", [1], b"\0" * 16), "object, void, complex"),
        (_raw_array("|V4", [1], b"\0" * 4), "object, void, complex"),
        (_raw_array("<U4", [1], b"\0" * 16), "refused"),
        (_raw_array("<f4", [2, 2], b"\0" * 12), "needs 16 bytes, got 12"),
        (_raw_array("<f4", [-1], b""), "non-negative"),
        (_raw_array("nonsense", [1], b"\0"), "unknown array dtype"),
        (_raw_array("(1,f4", [1], b"\0" * 4), "unknown array dtype"),
        (msgpack.packb({"x": list(range(70000))}), "msgpack"),
        (_raw_array("<f4", [1], b"\0" * 4, keys=str), "bytes keys"),
        (msgpack.packb({"a": 1})[:-1], "msgpack"),
        (b"\xc1\xc1\xc1", "msgpack"),
        (msgpack.packb({1: 2}), "msgpack"),
        (msgpack.packb({"a": 1}) + b"\x01", "one msgpack message"),
    ],
)
def test_codec_refuses_bad_frames_with_clear_errors(frame, message):
    with pytest.raises(ProtocolError, match=re.escape(message)):
        unpackb(frame)


def test_flatten_joins_nested_keys_and_refuses_odd_values():
    arrays, texts = flatten(unpackb(openpi_msgpack.packb(aloha_observation(0))))
    assert sorted(arrays) == ["images/cam_high", "images/cam_left_wrist", "images/cam_right_wrist", "state"]
    assert texts == {"prompt": "fold the towel"}
    assert flatten({"s": [1.0, 2.0]})[0]["s"].dtype == np.float64
    cases: list[tuple[dict[Any, Any], str]] = [({"s": ["a", 1]}, "numeric"), ({"s": b"raw"}, "unsupported"), ({b"k": 1}, "keys are strings")]
    for bad, msg in cases:
        with pytest.raises(ProtocolError, match=msg):
            flatten(bad)


# ---- the real openpi-client against the server --------------------------------------------


@pytest.mark.integration
@pytest.mark.vllm
def test_openpi_client_at_the_root_gets_metadata_then_actions(server):
    host, port = host_port(server)
    policy = WebsocketClientPolicy(host, port, api_key=ALICE_KEY)
    try:
        meta = policy.get_server_metadata()
        assert meta["layout"] == "droid" and meta["action_horizon"] == meta["chunk_size"] == 16 and meta["action_dim"] == 8
        assert meta["architecture"] == "PI0ForConditionalGeneration" and meta["max_state_dim"] == 32
        assert meta["normalization"] == {"state": None, "actions": None}  # the tiny base policy carries no stats
        assert meta["image_keys"] == ["observation/exterior_image_1_left", "observation/wrist_image_left"]
        assert meta["image_resolution"] == [IMAGE_SIZE, IMAGE_SIZE] and "reset" in meta["extensions"]  # observations are 224: resized
        assert {"aloha", "droid"} <= set(meta["layouts"])
        seen = set()
        for i in range(30):
            out = policy.infer(droid_observation(i))
            a = out["actions"]
            assert a.shape == (16, 8) and a.dtype == np.float32 and np.isfinite(a).all()
            seen.add(a.tobytes())
            assert out["policy_timing"]["infer_ms"] > 0
            assert out["server_timing"]["infer_ms"] >= out["policy_timing"]["infer_ms"]
            assert ("prev_total_ms" in out["server_timing"]) == (i > 0)
        assert len(seen) == 30  # every observation got its own chunk
    finally:
        policy._ws.close()


@pytest.mark.integration
@pytest.mark.vllm
def test_openpi_client_declares_its_control_rate_in_the_address(server):
    """openpi-client unchanged takes a whole address: the rate in its query string makes
    the robot one that load-aware admission weighs."""
    policy = WebsocketClientPolicy(ws_url(server, "/?control_hz=15&replan_steps=8"), api_key=ALICE_KEY)
    try:
        assert policy.get_server_metadata()["realtime"] == {"control_hz": 15.0, "replan_steps": 8, "budget_ms": pytest.approx(1000 * 8 / 15)}
        assert policy.infer(droid_observation(0))["actions"].shape == (16, 8)
    finally:
        policy._ws.close()


@pytest.mark.integration
@pytest.mark.vllm
def test_aloha_layout_over_v1_openpi_with_chw_images(server):
    url = ws_url(server, "/v1/openpi?layout=aloha")
    policy = WebsocketClientPolicy(url, api_key=ALICE_KEY)
    try:
        meta = policy.get_server_metadata()
        assert meta["layout"] == "aloha" and meta["state_dims"] == [14]
        for i in range(5):
            a = policy.infer(aloha_observation(i))["actions"]
            assert a.shape == (meta["action_horizon"], 14) and np.isfinite(a).all()
        # HWC images at another resolution are accepted too (resized by the checkpoint's processor)
        obs = aloha_observation(9)
        obs["images"] = {k: np.ascontiguousarray(v.transpose(1, 2, 0)[:160]) for k, v in obs["images"].items()}
        assert policy.infer(obs)["actions"].shape == (meta["action_horizon"], 14)
    finally:
        policy._ws.close()


@pytest.mark.integration
@pytest.mark.vllm
def test_reset_extension_starts_the_episode_over(server):
    host, port = host_port(server)
    policy = WebsocketClientPolicy(host, port, api_key=ALICE_KEY)
    try:
        obs = droid_observation(5)
        first = [policy.infer(obs)["actions"] for _ in range(3)]
        # the policy is stateful: the same observation gives a different chunk later in the episode
        assert not np.allclose(first[0], first[1])
        reply = policy.infer({"endpoint": "reset"})
        assert reply["reset"] is True and reply["seed"] == 0
        again = [policy.infer(obs)["actions"] for _ in range(3)]
        for a, b in zip(first, again, strict=True):
            assert np.array_equal(a, b)
        # a new seed starts a different episode
        policy.infer({"endpoint": "reset", "seed": 7})
        assert not np.allclose(policy.infer(obs)["actions"], first[0])
    finally:
        policy._ws.close()


@pytest.mark.integration
@pytest.mark.vllm
def test_action_chunk_broker_loop(server):
    host, port = host_port(server)
    policy = WebsocketClientPolicy(host, port, api_key=ALICE_KEY)
    calls = []

    class Counting:
        def infer(self, obs):
            calls.append(1)
            return policy.infer(obs)

        def reset(self):
            policy.reset()

    try:
        horizon = policy.get_server_metadata()["action_horizon"]
        assert horizon == 16
        broker = ActionChunkBroker(Counting(), action_horizon=horizon)
        steps = [broker.infer(droid_observation(i))["actions"] for i in range(40)]
        assert all(s.shape == (8,) for s in steps)
        assert len(calls) == 3  # chunks of 16: calls at steps 0, 16 and 32
    finally:
        policy._ws.close()


@pytest.mark.integration
@pytest.mark.vllm
def test_example_robot_loop_runs_at_its_control_rate(server):
    host, port = host_port(server)
    proc = subprocess.run(
        [sys.executable, "examples/robot_loop.py", "--host", host, "--port", str(port), "--api-key", ALICE_KEY,
         "--hz", "15", "--steps", "45", "--max-missed", "5"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "45 ticks" in proc.stdout and "policy calls" in proc.stdout


# ---- sessions: isolation, batching, caps, lifecycle ---------------------------------------


async def _episode(server, seed: int, obs_seeds: list[int], layout: str | None = None) -> list[np.ndarray]:
    async with await PolicyClient.connect(ws_url(server), ALICE_KEY, seed=seed, layout=layout) as robot:
        make = aloha_observation if layout == "aloha" else droid_observation
        return [(await robot.infer(make(s)))["actions"] for s in obs_seeds]


@pytest.mark.integration
@pytest.mark.vllm
async def test_episodes_are_isolated_between_interleaved_robots(server):
    obs_a, obs_b = [1, 2, 3, 4, 5], [11, 12, 13, 14, 15]
    alone_a = await _episode(server, 1, obs_a)
    alone_b = await _episode(server, 2, obs_b)
    a = await PolicyClient.connect(ws_url(server), ALICE_KEY, seed=1)
    b = await PolicyClient.connect(ws_url(server), ALICE_KEY, seed=2)
    async with a, b:
        got_a, got_b = [], []
        for sa, sb in zip(obs_a, obs_b, strict=True):
            got_a.append((await a.infer(droid_observation(sa)))["actions"])
            got_b.append((await b.infer(droid_observation(sb)))["actions"])
    for x, y in zip(alone_a + alone_b, got_a + got_b, strict=True):
        assert np.array_equal(x, y)
    # the state matters (chunks are smoothed toward the previous one), so the test can fail:
    fresh_second = await _episode(server, 1, [obs_a[1]])
    assert not np.allclose(fresh_second[0], alone_a[1])


def _batch_histogram(server) -> tuple[float, float]:
    with http_client(server.url, ADMIN_HEADERS) as http:
        text = http.get("/metrics").text
    count = float(re.search(r'omni_rt_engine_batch_size_count\{engine="policy"\} (\S+)', text).group(1))
    ones = float(re.search(r'omni_rt_engine_batch_size_bucket\{engine="policy",le="1.0"\} (\S+)', text).group(1))
    return count, ones


@pytest.mark.integration
@pytest.mark.vllm
async def test_concurrent_robots_are_batched_and_get_what_they_get_one_by_one(server):
    n = 8
    specs = [(100 + i, [200 + i, 300 + i, 400 + i], "aloha" if i % 3 == 0 else None) for i in range(n)]
    one_by_one = [await _episode(server, seed, obs, layout) for seed, obs, layout in specs]
    count0, ones0 = _batch_histogram(server)
    together = await asyncio.gather(*(_episode(server, seed, obs, layout) for seed, obs, layout in specs))
    count1, ones1 = _batch_histogram(server)
    assert (count1 - count0) - (ones1 - ones0) > 0, "no engine step ran more than one robot"
    for alone, batched in zip(one_by_one, together, strict=True):
        for x, y in zip(alone, batched, strict=True):
            np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5)


@pytest.mark.integration
@pytest.mark.vllm
def test_without_a_key_the_handshake_is_refused_and_plain_get_still_serves_the_page(server):
    host, port = host_port(server)
    with pytest.raises(websockets.exceptions.InvalidStatus):
        WebsocketClientPolicy(host, port)
    with http_client(server.url, {}) as http:
        page = http.get("/")
        assert page.status_code == 200 and "OpenPI" in page.text
        assert http.get("/healthz").status_code == 200


# ---- bad input: text error + close 1011, that connection only -----------------------------


def _obj_array() -> bytes:
    return msgpack.packb({"observation/joint_position": {b"__ndarray__": True, b"data": b"\0" * 8, b"dtype": "|O", b"shape": [1]}})


def _droid(**change) -> dict:
    obs = droid_observation(0)
    for k, v in change.items():
        key = k.replace("__", "/")
        if v is None:
            obs.pop(key)
        else:
            obs[key] = v
    return obs


BAD_INPUT = {
    "wrong_image_dtype": (lambda: openpi_msgpack.packb(_droid(observation__wrist_image_left=np.zeros((224, 224, 3), np.int32))), "uint8"),
    "wrong_image_shape": (lambda: openpi_msgpack.packb(_droid(observation__wrist_image_left=np.zeros((224, 224), np.uint8))), "expected an RGB image"),
    "four_channel_image": (lambda: openpi_msgpack.packb(_droid(observation__wrist_image_left=np.zeros((224, 224, 4), np.uint8))), "expected an RGB image"),
    "state_over_max_state_dim": (lambda: openpi_msgpack.packb(_droid(observation__joint_position=np.zeros(40))), "at most 32 state dims"),
    "prompt_over_token_limit": (lambda: openpi_msgpack.packb(_droid(prompt="pick up the red cup and " * 20)), "at most 48 (max_prompt_tokens)"),
    "wrong_state_shape": (lambda: openpi_msgpack.packb(_droid(observation__joint_position=np.zeros(6))), "expected shape [7]"),
    "nan_state": (lambda: openpi_msgpack.packb(_droid(observation__joint_position=np.full(7, np.nan))), "NaN"),
    "missing_key": (lambda: openpi_msgpack.packb(_droid(observation__wrist_image_left=None)), "missing 'observation/wrist_image_left'"),
    "prompt_not_string": (lambda: openpi_msgpack.packb(_droid(prompt=np.zeros(3))), "prompt is a string"),
    "object_array": (_obj_array, "refused"),
    "complex_array": (lambda: _raw_array("<c8", [2], b"\0" * 16), "refused"),
    "str_keyed_array_map": (lambda: _raw_array("<f4", [1], b"\0" * 4, keys=str), "bytes keys"),
    "truncated_msgpack": (lambda: openpi_msgpack.packb(droid_observation(0))[:-100], "msgpack"),
    "garbage": (lambda: bytes(range(256)) * 4, "msgpack"),
    "not_a_map": (lambda: msgpack.packb([1, 2, 3]), "msgpack map"),
    "unknown_endpoint": (lambda: msgpack.packb({"endpoint": "teleport"}), "unknown endpoint"),
    "bad_reset_seed": (lambda: msgpack.packb({"endpoint": "reset", "seed": "x"}), "seed must be an integer"),
    "oversized_frame": (lambda: b"\0" * (100 * 1024 * 1024), "exceeds"),
    "text_frame": (lambda: "hello", "text frame"),
}


def _expect_error(server, frame) -> tuple[str, int | None]:
    """Send one bad frame on a fresh connection: the text error and the close code."""
    with websockets.sync.client.connect(
        ws_url(server), compression=None, max_size=None, additional_headers={"Authorization": f"Api-Key {ALICE_KEY}"}
    ) as ws:
        openpi_msgpack.unpackb(ws.recv())  # metadata
        ws.send(frame)
        msg = ws.recv(timeout=60)
        assert isinstance(msg, str), f"expected a text error frame, got {type(msg).__name__}"
        try:
            ws.recv(timeout=10)
        except websockets.ConnectionClosed:
            pass
        return msg, ws.close_code


@pytest.mark.integration
@pytest.mark.vllm
def test_bad_input_gets_a_text_error_and_1011_while_another_robot_keeps_going(server):
    host, port = host_port(server)
    other = WebsocketClientPolicy(host, port, api_key=ALICE_KEY)
    try:
        before = other.infer(droid_observation(42))["actions"]
        for name, (make, message) in BAD_INPUT.items():
            text, code = _expect_error(server, make())
            assert message in text, f"{name}: {text!r}"
            assert code == 1011, f"{name}: close code {code}"
            # the other robot's loop is unaffected
            assert other.infer(droid_observation(42))["actions"].shape == before.shape
    finally:
        other._ws.close()


# ---- the π0 overlays on directories laid out as the public repos are -----------------------


@pytest.mark.integration
@pytest.mark.parametrize("overlay, layout, observation, dims", [
    ("pi0.yaml", "transformers", aloha_observation, 14),
    ("pi0-droid.yaml", "lerobot", droid_observation, 8),
])
def test_the_pi0_overlays_check_and_serve_with_a_hub_shaped_paligemma_processor(models_dir, tmp_path, overlay, layout, observation, dims):
    """examples/deploy/pi0*.yaml as written (paths and the CPU aside): a π0 embedding
    PaliGemma's 257,152 ids and a processor folder holding its 257,153 tokens (`<image>`
    at 257152) pass `omni-rt check`, serve, and answer openpi-client's `infer`."""
    import yaml

    from testkit.pi0_hub import paligemma_processor, pi0_dir
    from tests.conftest import start_server

    models = tmp_path / "models"
    policy = pi0_dir(models / ("pi0_base" if layout == "transformers" else "pi0-droid"), models_dir / "tiny-pi0", layout)
    processor = paligemma_processor(models / "paligemma2-3b-mix-224")
    text = (REPO / "examples" / "deploy" / overlay).read_text()
    text = text.replace("/models/pi0_base", str(policy)).replace("/models/pi0-droid", str(policy))
    text = text.replace("/models/paligemma2-3b-mix-224", str(processor)).replace("device: cuda, dtype: bfloat16", "device: cpu, dtype: float32")
    data = yaml.safe_load(text)
    assert data["pipelines"]["robot"]["stages"]["policy"]["processor_args"]["processor"] == str(processor)
    data["server"] = {"models_dir": str(models_dir)}
    deploy = tmp_path / overlay
    deploy.write_text(yaml.safe_dump(data))
    check = subprocess.run([sys.executable, "-m", "omni_server.cli", "check", "--deploy", str(deploy)], cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-2000:]
    robot_only = {**data, "pipelines": {**{n: {"enabled": False} for n in ("voice", "tts", "asr", "image", "world", "video", "video_edit")},
                                         "robot": data["pipelines"]["robot"]}}
    proc = start_server(robot_only, tmp_path, models_dir)
    try:
        client = WebsocketClientPolicy(proc.host, proc.port)
        try:
            meta = client.get_server_metadata()
            assert meta["action_dim"] == dims and meta["architecture"] == "PI0ForConditionalGeneration"
            out = client.infer(observation(0, size=IMAGE_SIZE))
            assert out["actions"].shape[1] == dims and np.isfinite(out["actions"]).all()
        finally:
            client._ws.close()
    finally:
        proc.stop()
