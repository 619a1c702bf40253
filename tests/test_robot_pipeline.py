"""The robot pipeline without a server: transformers' π0 at step granularity on the
torch engine (== its own `sample_actions`, batched == one by one, tensors left on the
device), observation preparation by the checkpoint's processor, normalisation from
the checkpoint's statistics, lerobot's checkpoint format, configuration errors."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from omni_rt.engines.base import Engine
from omni_rt.engines.torch_engine import TorchEngine
from omni_rt.payloads import Fence, Payload, PayloadKind
from omni_rt.stage import StageError
from pipelines.tiny.pi0 import IMAGE_SIZE
from testkit.pi0_hub import IMAGE_TOKEN, VOCAB, lerobot_keys, paligemma_processor
from testkit.pi0_hub import pi0_dir as hub_pi0_dir
from tests.conftest import REPO


class TwoOps(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.calls: list[tuple[str, int]] = []

    def encode(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        self.calls.append(("encode", a.shape[0]))
        return self.lin(a) + b.sum(-1, keepdim=True)

    def both(self, a: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls.append(("both", a.shape[0]))
        return {"sum": a.sum(-1), "twice": a * 2}


async def test_torch_engine_batches_named_inputs_per_op_and_signature():
    module = TwoOps()
    engine = TorchEngine(lambda: module, name="two", max_batch=8, max_wait_ms=0.0)
    await engine.start()
    try:
        rng = np.random.default_rng(0)
        items = [{"a": rng.standard_normal(4).astype(np.float32), "b": rng.standard_normal(2).astype(np.float32)} for _ in range(5)]
        alone = [await engine.run(x, op="encode") for x in items]
        module.calls.clear()
        odd = {"a": rng.standard_normal(4).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}  # other shape
        together = await asyncio.gather(
            *(engine.run(x, op="encode") for x in items), engine.run(odd, op="encode"), engine.run(items[0]["a"], op="both")
        )
        # one batch of the five same-shaped items, one for the odd shape, one for the other op
        assert sorted(module.calls) == [("both", 1), ("encode", 1), ("encode", 5)]
        for x, y in zip(alone, together[:5], strict=True):
            np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-6)
        both = together[-1]
        assert set(both) == {"sum", "twice"} and np.allclose(both["twice"], items[0]["a"] * 2)
    finally:
        await engine.stop()


async def test_torch_engine_gives_tensors_back_for_tensors_and_passes_a_batch_on_uncopied():
    module = TwoOps()
    engine = TorchEngine(lambda: module, name="two", max_batch=8, max_wait_ms=0.0)
    await engine.start()
    try:
        rows = [torch.full((4,), float(i)) for i in range(3)]
        out = await asyncio.gather(*(engine.run({"a": r}, op="both") for r in rows))
        assert all(isinstance(o["twice"], torch.Tensor) and o["twice"].device == engine.device for o in out)
        base = out[0]["twice"].data_ptr()
        assert [o["twice"].data_ptr() for o in out] == [base + 16 * i for i in range(3)]  # rows of one batch output
        seen: list[torch.Tensor] = []

        def both(a: torch.Tensor) -> dict[str, torch.Tensor]:
            seen.append(a)
            return {"sum": a.sum(-1), "twice": a * 2}

        module.both = both  # type: ignore[method-assign]
        again = await asyncio.gather(*(engine.run({"a": o["twice"]}, op="both") for o in out))
        assert seen[0].data_ptr() == base and seen[0].shape == (3, 4)  # the same rows in order: the batch itself, not a copy
        assert [float(o["sum"]) for o in again] == [0.0, 8.0, 16.0]
        swapped = await asyncio.gather(*(engine.run({"a": o["twice"]}, op="both") for o in reversed(out)))
        assert seen[1].data_ptr() != base and [float(o["sum"]) for o in swapped] == [16.0, 8.0, 0.0]
        plain = await engine.run({"a": np.ones(4, np.float32)}, op="both")
        assert isinstance(plain["twice"], np.ndarray)  # numpy in, numpy out
    finally:
        await engine.stop()


def _spec(model_dir, **args):
    from omni_rt.specs import load_pipeline
    from pipelines import PIPELINE_DIR

    spec = load_pipeline(PIPELINE_DIR / "robot.yaml").profiles["default"].stages[0]
    return spec.model_copy(update={"model": str(model_dir), "processor_args": {**spec.processor_args, **args}})


def _processor(model_dir, engine=None, **args):
    from pipelines.robot import PolicyProcessor

    return PolicyProcessor(_spec(model_dir, **args), engine or _Steps(), {})


class _Steps(Engine):
    """A StepEngine that is never called (these tests exercise input preparation)."""

    name = "unused"

    def load(self) -> int:
        return 0

    async def run(self, x, priority=1, op=None):
        raise AssertionError("not used")


def _obs(arrays, text=None):
    return Payload(PayloadKind.OBSERVATION, Fence("s"), arrays=arrays, meta={"text": text or {}})


@pytest.fixture
def pi0_dir(models_dir):
    return models_dir / "tiny-pi0"


@pytest.mark.integration
def test_prepare_runs_the_checkpoints_processor_for_a_layout(pi0_dir):
    proc = _processor(pi0_dir)
    side, n = proc.size[0], proc.image_tokens
    assert (side, n) == (IMAGE_SIZE, (IMAGE_SIZE // 14) ** 2)  # the model's resolution, 14-pixel patches
    rng = np.random.default_rng(0)
    chw = {f"images/cam_{c}": rng.integers(0, 256, (3, side, side), dtype=np.uint8) for c in ("high", "left_wrist", "right_wrist")}
    state = rng.standard_normal(14)
    x = proc.prepare(proc.layout("aloha"), _obs({**chw, "state": state}, {"prompt": "fold"}))
    # three cameras of n tokens each, then BOS + prompt + newline padded to 48
    assert x["pixel_values"].shape == (3, 3, side, side) and x["pixel_attention_mask"].all()
    assert x["input_ids"].shape == (3 * n + 48,) and (x["input_ids"][: 3 * n] == proc.processor.image_token_id).all()
    tok = proc.processor.tokenizer
    assert tok.decode(x["input_ids"][3 * n :][x["attention_mask"][3 * n :].bool()]) == f"{tok.bos_token}fold\n"
    # the image is the processor's: scaled to [-1, 1] (mean 0.5, std 0.5)
    expect = chw["images/cam_high"].astype(np.float32) / 255.0 * 2.0 - 1.0
    np.testing.assert_allclose(x["pixel_values"][0].numpy(), expect, atol=1e-5)
    assert np.allclose(x["state"][:14].numpy(), state) and not x["state"][14:].any()
    # droid: float HWC images of other sizes are resized to the model's resolution
    small = rng.uniform(0, 1, (120, 160, 3)).astype(np.float32)
    droid = {"observation/exterior_image_1_left": small, "observation/wrist_image_left": np.zeros((224, 224, 3), np.uint8),
             "observation/joint_position": np.zeros(7), "observation/gripper_position": np.array(0.5)}
    x = proc.prepare(proc.layout(None), _obs(droid))
    assert x["pixel_values"].shape == (2, 3, side, side) and x["input_ids"].shape == (2 * n + 48,)
    assert x["state"][7] == 0.5


@pytest.mark.integration
@pytest.mark.parametrize("shape", [(1, 1, 3), (1, 8, 3), (8, 1, 3), (3, 1, 1), (2, 2, 3)])
def test_cameras_of_a_pixel_or_two_are_resized_not_taken_for_channels_first(pi0_dir, shape):
    # the image processor guesses the channel axis, and took a 1-pixel-high HWC image for CHW
    proc = _processor(pi0_dir)
    side = proc.layout("aloha")  # any layout: its images are resized to the policy's side
    arrays: dict[str, np.ndarray] = {f"images/cam_{c}": np.zeros((3, 224, 224), np.uint8) for c in ("high", "left_wrist", "right_wrist")}
    arrays["images/cam_high"] = np.full(shape, 200, np.uint8)
    arrays["state"] = np.zeros(14)
    x = proc.prepare(side, _obs(arrays))
    assert x["pixel_values"].shape[:2] == (3, 3) and x["pixel_values"].shape[2] == x["pixel_values"].shape[3]
    np.testing.assert_allclose(x["pixel_values"][0].numpy(), 200 / 255 * 2 - 1, atol=1e-5)  # one colour, resized


@pytest.mark.parametrize(
    "change, message",
    [
        ({"state": np.zeros(13)}, "expected shape [14]"),
        ({"state": np.zeros(40)}, "the policy takes at most 32 state dims"),
        ({"images/cam_high": np.zeros((224, 224, 4), np.uint8)}, "expected an RGB image"),
        ({"images/cam_high": np.zeros((1, 224, 224), np.uint8)}, "expected an RGB image"),
        ({"images/cam_high": np.zeros((3, 224, 224), np.int16)}, "uint8"),
        ({"images/cam_high": np.full((3, 8, 8), np.inf, np.float32)}, "NaN or infinite"),
        ({"images/cam_high": np.zeros((3, 5000, 8), np.uint8)}, "1..4096"),
    ],
)
@pytest.mark.integration
def test_prepare_refuses_bad_observations(pi0_dir, change, message):
    proc = _processor(pi0_dir)
    arrays: dict[str, np.ndarray] = {f"images/cam_{c}": np.zeros((3, 224, 224), np.uint8) for c in ("high", "left_wrist", "right_wrist")}
    arrays["state"] = np.zeros(14)
    arrays.update(change)
    with pytest.raises(StageError, match=re.escape(message)):
        proc.prepare(proc.layout("aloha"), _obs(arrays))


@pytest.mark.integration
def test_layouts_prepared_at_once_in_threads_keep_their_own_prompt_length(pi0_dir):
    from concurrent.futures import ThreadPoolExecutor

    proc = _processor(pi0_dir)
    aloha: dict[str, np.ndarray] = {f"images/cam_{c}": np.zeros((3, 224, 224), np.uint8) for c in ("high", "left_wrist", "right_wrist")}
    aloha["state"] = np.zeros(14)
    droid = _droid(0).arrays

    def one(i):
        lay, arrays = ("aloha", aloha) if i % 2 else ("droid", droid)
        return lay, proc.prepare(proc.layout(lay), _obs(arrays, {"prompt": "pick up the red cup"}))["input_ids"].shape[0]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, range(64)))
    n = proc.image_tokens
    assert {k for lay, k in got if lay == "aloha"} == {3 * n + 48} and {k for lay, k in got if lay == "droid"} == {2 * n + 48}


@pytest.mark.integration
def test_a_prompt_over_the_token_limit_is_refused_naming_the_limit(pi0_dir):
    proc = _processor(pi0_dir, max_prompt_tokens=8)
    arrays: dict[str, np.ndarray] = {f"images/cam_{c}": np.zeros((3, 224, 224), np.uint8) for c in ("high", "left_wrist", "right_wrist")}
    arrays["state"] = np.zeros(14)
    proc.prepare(proc.layout("aloha"), _obs(arrays, {"prompt": "fold"}))  # 6 tokens fit
    with pytest.raises(StageError, match=r"the prompt is \d+ tokens .*at most 8 \(max_prompt_tokens\)"):
        proc.prepare(proc.layout("aloha"), _obs(arrays, {"prompt": "fold the towel on the table twice"}))


@pytest.mark.parametrize(
    "args, message",
    [
        ({"layouts": {"arm": {"images": ["c"], "action_dim": 40}}}, "action_dim must be in 1..32"),
        ({"layouts": {"arm": {"images": ["c"], "action_dim": 4, "action_horizon": 99}}}, "action_horizon must be in 1..16"),
        ({"layouts": {"arm": {"action_dim": 4}}}, "at least one camera"),
        ({"layouts": {"arm": {"images": ["c"]}}}, "layouts.arm.action_dim: Field required"),
        ({"layouts": {"arm": {"images": ["c"], "action_dim": 4, "cams": []}}}, "layouts.arm.cams: Extra inputs are not permitted"),
        ({"layouts": {"arm": {"images": ["c"], "action_dim": "four"}}}, "layouts.arm.action_dim: Input should be a valid integer"),
        ({"num_steps": 0}, "num_steps: Input should be greater than or equal to 1"),
        ({"layouts": {"arm": {"images": ["c"], "action_dim": 4, "state": ["s"], "state_dims": [40]}}}, "exceeds the policy's max_state_dim 32"),
        ({"default_layout": "hexapod"}, "default_layout"),
        ({"smoothing": 1.0}, "smoothing: Input should be less than 1"),
        ({"temperature": 1.0}, "policy processor_args: temperature: Extra inputs are not permitted"),
    ],
)
@pytest.mark.integration
def test_bad_policy_configuration_is_refused(pi0_dir, args, message):
    with pytest.raises(ValueError, match=message):
        _processor(pi0_dir, **args)


@pytest.mark.integration
def test_omni_rt_check_names_a_bad_layout(models_dir, tmp_path):
    deploy = tmp_path / "d.yaml"
    deploy.write_text(yaml.safe_dump({
        "pipelines": {"tts": {"enabled": False}, "voice": {"enabled": False},
                      "robot": {"stages": {"policy": {"processor_args": {"layouts": {"arm": {"images": ["c"], "action_dim": 0}}}}}}},
        "server": {"models_dir": str(models_dir)},
    }))
    proc = subprocess.run([sys.executable, "-m", "omni_server.cli", "check", "--deploy", str(deploy)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "pipelines.robot.stages.policy.processor_args: layouts.arm: action_dim must be in 1..32" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---- the denoising loop on the engine ------------------------------------------------------


def _droid(seed, prompt="pick up the cup"):
    rng = np.random.default_rng(seed)
    return _obs({"observation/exterior_image_1_left": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
                 "observation/wrist_image_left": rng.integers(0, 256, (160, 200, 3), dtype=np.uint8),
                 "observation/joint_position": rng.standard_normal(7), "observation/gripper_position": rng.uniform(0, 1, 1)},
                {"prompt": prompt})


class _Ctx:
    """The slice of StageContext the policy uses: one observation in, the payload out."""

    def __init__(self, obs, params):
        self.params, self.fence, self._obs, self.out = params, Fence("s"), obs, []

    async def input(self):
        yield self._obs

    def add_usage(self, **counts):
        pass

    async def emit(self, payload, last=False):
        self.out.append(payload)


async def _infer(proc, obs, seed=0, layout="droid"):
    ctx = _Ctx(obs, {"layout": layout, "episode": proc.new_episode(seed)})
    await proc.run(ctx)
    return ctx.out[0].arrays["actions"]


@pytest.fixture
async def pi0_engine(pi0_dir):
    from pipelines.robot import PolicyProcessor

    engine = TorchEngine(PolicyProcessor.torch_module(str(pi0_dir), "main"), name="policy", max_batch=32, max_wait_ms=0.0)
    await engine.start()
    yield engine
    await engine.stop()


@pytest.mark.integration
async def test_step_by_step_on_the_engine_equals_the_models_own_sample_actions(pi0_dir, pi0_engine):
    proc = _processor(pi0_dir, pi0_engine, smoothing=0.0)
    obs = _droid(3)
    got = await _infer(proc, obs, seed=5)
    lay = proc.layout("droid")
    x = proc.prepare(lay, obs)
    rng = np.random.default_rng([5, 0])  # the episode's seed and step, as the stage draws it
    noise = torch.from_numpy(rng.standard_normal((16, 32), dtype=np.float32))[None]
    model = pi0_engine.module.pi0
    ref = model.sample_actions(state=x["state"][None], noise=noise, input_ids=x["input_ids"][None], pixel_values=x["pixel_values"][None],
                               attention_mask=x["attention_mask"][None], pixel_attention_mask=x["pixel_attention_mask"][None], num_steps=10)
    assert got.shape == (16, 8)
    np.testing.assert_allclose(got, ref[0, :16, :8].numpy(), rtol=0, atol=1e-5)


@pytest.mark.integration
async def test_the_prefix_kv_state_and_noisy_actions_stay_tensors_on_the_engine_between_steps(pi0_dir, pi0_engine):
    seen: list[tuple[str | None, dict[str, str]]] = []
    run = pi0_engine.run

    async def recording(x, priority=1, op=None):
        seen.append((op, {k: type(v).__name__ for k, v in x.items()}))
        y = await run(x, priority, op)
        if op == "denoise":
            assert isinstance(y, torch.Tensor) and y.device == pi0_engine.device
        return y

    pi0_engine.run = recording
    try:
        await _infer(_processor(pi0_dir, pi0_engine), _droid(2))
    finally:
        del pi0_engine.run
    assert [op for op, _ in seen] == ["encode"] + ["denoise"] * 10
    for _op, types in seen[1:]:
        # only the step's own time goes up from the host each step
        assert {k: v for k, v in types.items() if k not in ("t", "dt")} == dict.fromkeys(("kv", "attention_mask", "state", "x"), "Tensor")


@pytest.mark.integration
async def test_robots_at_different_steps_share_batches_and_get_what_they_get_alone(pi0_dir, pi0_engine):
    proc = _processor(pi0_dir, pi0_engine)
    observations = [_droid(10 + i, prompt=f"task {i}") for i in range(6)]
    alone = [await _infer(proc, o, seed=i) for i, o in enumerate(observations)]
    steps0, items0 = pi0_engine.steps, pi0_engine.items

    async def late(i, o):
        await asyncio.sleep(0.004 * i)  # staggered: robots join while others are mid-loop
        return await _infer(proc, o, seed=i)

    together = await asyncio.gather(*(late(i, o) for i, o in enumerate(observations)))
    steps, items = pi0_engine.steps - steps0, pi0_engine.items - items0
    assert items == 6 * 11 and steps < items, f"{steps} engine calls for {items} items: nothing was batched"
    for a, b in zip(alone, together, strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)


# ---- normalisation from the checkpoint --------------------------------------------------


def _with_stats(pi0_dir, tmp_path, state_mode="MEAN_STD", action_mode="MEAN_STD", write_state_file=True):
    """The tiny π0 with lerobot's normalizer files for an 8-dim state, 8-dim actions."""
    from safetensors.numpy import save_file

    d = tmp_path / "pi0-droid"
    shutil.copytree(pi0_dir, d)
    rng = np.random.default_rng(1)
    stats = {
        "observation.state.mean": rng.standard_normal(8).astype(np.float32), "observation.state.std": rng.uniform(0.5, 2, 8).astype(np.float32),
        "observation.state.min": -np.ones(8, np.float32), "observation.state.max": 3 * np.ones(8, np.float32),
        "action.mean": rng.standard_normal(8).astype(np.float32), "action.std": rng.uniform(0.5, 2, 8).astype(np.float32),
        "action.q01": -2 * np.ones(8, np.float32), "action.q99": np.linspace(1, 4, 8).astype(np.float32),
    }
    features = {"observation.state": {"type": "STATE", "shape": [8]}, "observation.images.base_0_rgb": {"type": "VISUAL", "shape": [3, 224, 224]},
                "action": {"type": "ACTION", "shape": [8]}}
    norm = {"eps": 1e-8, "features": features, "norm_map": {"VISUAL": "IDENTITY", "STATE": state_mode, "ACTION": action_mode}}
    if write_state_file:
        save_file(stats, str(d / "policy_preprocessor_step_3_normalizer_processor.safetensors"))
        save_file({k: v for k, v in stats.items() if k.startswith("action.")}, str(d / "policy_postprocessor_step_0_unnormalizer_processor.safetensors"))
    (d / "policy_preprocessor.json").write_text(json.dumps({"name": "policy_preprocessor", "steps": [
        {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
        {"registry_name": "normalizer_processor", "config": norm, "state_file": "policy_preprocessor_step_3_normalizer_processor.safetensors"}]}))
    (d / "policy_postprocessor.json").write_text(json.dumps({"name": "policy_postprocessor", "steps": [
        {"registry_name": "unnormalizer_processor", "config": norm, "state_file": "policy_postprocessor_step_0_unnormalizer_processor.safetensors"}]}))
    return d, stats


@pytest.mark.parametrize("state_mode, action_mode", [("MEAN_STD", "MEAN_STD"), ("MIN_MAX", "QUANTILES")])
@pytest.mark.integration
async def test_normalisation_round_trip_with_the_checkpoints_stats(pi0_dir, pi0_engine, tmp_path, state_mode, action_mode):
    d, stats = _with_stats(pi0_dir, tmp_path, state_mode, action_mode)
    layouts = {"droid": _spec(pi0_dir).processor_args["layouts"]["droid"]}
    raw = _processor(pi0_dir, pi0_engine, smoothing=0.0, layouts=layouts)
    normed = _processor(d, pi0_engine, smoothing=0.0, layouts=layouts)  # same weights, with stats
    meta = normed.metadata(None)["normalization"]
    assert meta["state"]["mode"] == state_mode and meta["actions"]["mode"] == action_mode and meta["actions"]["dims"] == 8
    obs = _droid(4)
    s = np.concatenate([obs.arrays["observation/joint_position"], obs.arrays["observation/gripper_position"]]).astype(np.float32)
    if state_mode == "MEAN_STD":
        s_norm = (s - stats["observation.state.mean"]) / (stats["observation.state.std"] + 1e-8)
    else:
        s_norm = 2 * (s + 1) / (4 + 1e-8) - 1
    np.testing.assert_allclose(normed.prepare(normed.layout(None), obs)["state"][:8].numpy(), s_norm, rtol=1e-5, atol=1e-6)
    # the raw policy given the normalised state by hand gives the normalised actions ...
    by_hand = _droid(4)
    by_hand.arrays["observation/joint_position"], by_hand.arrays["observation/gripper_position"] = s_norm[:7], s_norm[7:]
    y = await _infer(raw, by_hand)
    # ... which the normalised policy maps back with the action stats
    got = await _infer(normed, obs)
    if action_mode == "MEAN_STD":
        expect = y * (stats["action.std"] + 1e-8) + stats["action.mean"]
    else:
        lo, hi = stats["action.q01"], stats["action.q99"]
        expect = (y + 1) / 2 * (hi - lo + 1e-8) + lo
    np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, y)


@pytest.mark.integration
def test_a_layout_of_another_embodiment_than_the_stats_is_refused(pi0_dir, tmp_path):
    d, _ = _with_stats(pi0_dir, tmp_path)
    with pytest.raises(ValueError, match=r"layouts.aloha: state of 14 dims, but the checkpoint normalises observation.state with 8"):
        _processor(d)


@pytest.mark.integration
def test_a_missing_stats_or_processor_file_refuses_the_policy_naming_the_file(pi0_dir, tmp_path):
    d, _ = _with_stats(pi0_dir, tmp_path, write_state_file=False)
    with pytest.raises(StageError, match="policy_preprocessor_step_3_normalizer_processor.safetensors, which is missing"):
        _processor(d)
    bare = tmp_path / "no-processor"
    shutil.copytree(pi0_dir, bare)
    (bare / "processor_config.json").unlink()
    with pytest.raises(StageError, match="no image processor settings"):
        _processor(bare)
    no_tok = tmp_path / "no-tokenizer"
    shutil.copytree(pi0_dir, no_tok)
    (no_tok / "tokenizer.json").unlink()
    with pytest.raises(StageError, match="no tokenizer files"):
        _processor(no_tok)
    # a processor of another resolution than the vision tower's
    other = tmp_path / "other-resolution"
    shutil.copytree(pi0_dir, other)
    conf = json.loads((other / "processor_config.json").read_text())
    conf["image_processor"].update(size={"height": 224, "width": 224}, image_seq_length=256)
    (other / "processor_config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match=f"its images are 224x224 of 256 tokens, the model's vision tower takes {IMAGE_SIZE}x{IMAGE_SIZE}"):
        _processor(other)
    # the processor files from another directory (PaliGemma's, for lerobot/pi0_base)
    assert _processor(bare, processor=str(pi0_dir)).metadata(None)["image_resolution"] == [IMAGE_SIZE, IMAGE_SIZE]


@pytest.mark.integration
def test_a_checkpoint_in_lerobots_format_loads_into_the_same_model(pi0_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from pipelines.robot import Pi0Steps

    d = tmp_path / "lerobot-format"
    shutil.copytree(pi0_dir, d)
    theirs = load_file(str(pi0_dir / "model.safetensors"))
    renamed = lerobot_keys(theirs)
    assert any(k.startswith("paligemma_with_expert.") for k in renamed) and not any(k.startswith("model.") for k in renamed)
    save_file(renamed, str(d / "model.safetensors"))
    loaded = Pi0Steps.load(str(d)).pi0.state_dict()
    ref = Pi0Steps.load(str(pi0_dir)).pi0.state_dict()
    assert set(loaded) == set(ref)
    for k, v in ref.items():
        assert torch.equal(loaded[k], v), k


@pytest.mark.integration
def test_omni_rt_check_refuses_a_directory_that_is_not_pi0(pi0_dir, tmp_path):
    from pipelines.robot import check_policy_dir

    d = tmp_path / "other"
    shutil.copytree(pi0_dir, d)
    conf = json.loads((d / "config.json").read_text())
    conf.update(model_type="paligemma", architectures=["PaliGemmaForConditionalGeneration"])
    (d / "config.json").write_text(json.dumps(conf))
    with pytest.raises(StageError, match="describes PaliGemmaForConditionalGeneration, not π0"):
        check_policy_dir(str(d))
    # lerobot's config.json (type: pi0, no architectures) is a π0
    (d / "config.json").write_text(json.dumps({"type": "pi0", "chunk_size": 50, "tokenizer_max_length": 48}))
    assert check_policy_dir(str(d), str(pi0_dir))["type"] == "pi0"
    assert Path(d).is_dir()


# ---- directories laid out as the public repos are ------------------------------------------


@pytest.fixture(scope="module")
def hub(models_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("hub")
    return {"processor": paligemma_processor(d / "paligemma-3b-pt-224"),
            "transformers": hub_pi0_dir(d / "pi0", models_dir / "tiny-pi0"),
            "lerobot": hub_pi0_dir(d / "pi0-droid", models_dir / "tiny-pi0", "lerobot")}


@pytest.mark.parametrize("layout", ["transformers", "lerobot"])
@pytest.mark.integration
def test_a_paligemma_processor_whose_only_extra_token_is_the_image_token_is_accepted(hub, layout):
    """PaliGemma's 257,153 tokens against π0's 257,152 embeddings: `<image>` (257152) is
    never looked up (its positions take the vision tower's features)."""
    droid = {"droid": {"images": ["observation/exterior_image_1_left", "observation/wrist_image_left"],
                       "state": ["observation/joint_position", "observation/gripper_position"], "state_dims": [7, 1], "action_dim": 8}}
    proc = _processor(hub[layout], processor=str(hub["processor"]), layouts=droid)
    assert len(proc.processor.tokenizer) == VOCAB + 1 and proc.processor.image_token_id == IMAGE_TOKEN
    assert proc.config.vlm_config.text_config.vocab_size == VOCAB
    rng = np.random.default_rng(0)
    side = proc.size[0]
    obs = _obs({"observation/exterior_image_1_left": rng.integers(0, 256, (side, side, 3), dtype=np.uint8),
                "observation/wrist_image_left": rng.integers(0, 256, (side, side, 3), dtype=np.uint8),
                "observation/joint_position": rng.standard_normal(7), "observation/gripper_position": rng.uniform(0, 1, 1)},
               {"prompt": "pick up the cup"})
    batch = proc.prepare(proc.layouts["droid"], obs)
    ids = batch["input_ids"]
    assert int((ids == IMAGE_TOKEN).sum()) == 2 * proc.image_tokens and int(ids[ids != IMAGE_TOKEN].max()) < VOCAB


@pytest.mark.integration
def test_a_tokenizer_that_can_emit_an_id_past_the_table_is_refused_naming_it(hub, tmp_path):
    extra = paligemma_processor(tmp_path / "paligemma-plus", extra_tokens=("<tool_call>", "<tool_result>"))
    with pytest.raises(ValueError) as err:
        _processor(hub["transformers"], processor=str(extra))
    msg = str(err.value)
    assert "257155 tokens, the model embeds 257152" in msg and "'<tool_call>' (id 257153), '<tool_result>' (id 257154)" in msg
    assert "<image>" not in msg
