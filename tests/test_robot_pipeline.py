"""The robot pipeline without a server: step-level batching on the torch engine,
observation preparation (layouts, image forms), configuration errors."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from omni_rt.engines.base import Engine
from omni_rt.engines.torch_engine import TorchEngine
from omni_rt.payloads import Fence, Payload, PayloadKind
from omni_rt.stage import StageError
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


def _processor(models_dir, **args):
    from omni_rt.specs import load_pipeline
    from pipelines import PIPELINE_DIR
    from pipelines.robot import PolicyProcessor

    spec = load_pipeline(PIPELINE_DIR / "robot.yaml").profiles["default"].stages[0]
    spec = spec.model_copy(update={"model": str(models_dir / "tiny-flow-policy"), "processor_args": {**spec.processor_args, **args}})
    return PolicyProcessor(spec, _Steps(), {})


class _Steps(Engine):
    """A StepEngine that is never called (these tests exercise input preparation)."""

    name = "unused"

    def load(self) -> int:
        return 0

    async def run(self, x, priority=1, op=None):
        raise AssertionError("not used")


def _obs(arrays, text=None):
    return Payload(PayloadKind.OBSERVATION, Fence("s"), arrays=arrays, meta={"text": text or {}})


def test_prepare_maps_a_layout_onto_the_padded_model_inputs(models_dir):
    proc = _processor(models_dir)
    rng = np.random.default_rng(0)
    chw = {f"images/cam_{c}": rng.integers(0, 256, (3, 224, 224), dtype=np.uint8) for c in ("high", "left_wrist", "right_wrist")}
    state = rng.standard_normal(14)
    x = proc.prepare(proc.layout("aloha"), _obs({**chw, "state": state}, {"prompt": "fold"}))
    assert x["images"].shape == (3, 224, 224, 3) and x["images"].dtype == np.uint8
    assert np.array_equal(x["images"][0], chw["images/cam_high"].transpose(1, 2, 0))
    assert np.allclose(x["state"][:14], state) and not x["state"][14:].any()
    assert bytes(x["prompt"][:4].astype(np.uint8)) == b"fold" and (x["prompt"][4:] == 256).all()
    # droid: two cameras, the third slot stays empty; a smaller float image is scaled and padded
    small = rng.uniform(0, 1, (120, 160, 3)).astype(np.float32)
    droid = {"observation/exterior_image_1_left": small, "observation/wrist_image_left": np.zeros((224, 224, 3), np.uint8),
             "observation/joint_position": np.zeros(7), "observation/gripper_position": np.array(0.5)}
    x = proc.prepare(proc.layout(None), _obs(droid))
    assert not x["images"][2].any() and x["images"][0][:10].sum() == 0 and x["images"][0][112].any()
    assert x["state"][7] == 0.5


@pytest.mark.parametrize(
    "change, message",
    [
        ({"state": np.zeros(13)}, "expected shape [14]"),
        ({"images/cam_high": np.zeros((224, 224, 4), np.uint8)}, "expected an image"),
        ({"images/cam_high": np.zeros((3, 224, 224), np.int16)}, "uint8"),
        ({"images/cam_high": np.full((3, 8, 8), np.inf, np.float32)}, "NaN or infinite"),
        ({"images/cam_high": np.zeros((3, 5000, 8), np.uint8)}, "1..4096"),
    ],
)
def test_prepare_refuses_bad_observations(models_dir, change, message):
    proc = _processor(models_dir)
    arrays: dict[str, np.ndarray] = {f"images/cam_{c}": np.zeros((3, 224, 224), np.uint8) for c in ("high", "left_wrist", "right_wrist")}
    arrays["state"] = np.zeros(14)
    arrays.update(change)
    with pytest.raises(StageError, match=message.replace("[", r"\[").replace("]", r"\]")):
        proc.prepare(proc.layout("aloha"), _obs(arrays))


@pytest.mark.parametrize(
    "args, message",
    [
        ({"layouts": {"arm": {"action_dim": 40, "action_horizon": 4}}}, "action_dim must be in 1..32"),
        ({"layouts": {"arm": {"action_dim": 4, "action_horizon": 99}}}, "action_horizon must be in 1..16"),
        ({"layouts": {"arm": {"action_dim": 4}}}, "action_horizon missing"),
        ({"layouts": {"arm": {"action_dim": 4, "action_horizon": 4, "cams": []}}}, "unknown keys"),
        ({"layouts": {"arm": {"action_dim": 4, "action_horizon": 4, "state": ["s"], "state_dims": [40]}}}, "exceeds max_state_dim"),
        ({"default_layout": "hexapod"}, "default_layout"),
        ({"smoothing": 1.0}, "smoothing"),
        ({"temperature": 1.0}, "unknown policy processor_args"),
    ],
)
def test_bad_policy_configuration_is_refused(models_dir, args, message):
    with pytest.raises(ValueError, match=message):
        _processor(models_dir, **args)


def test_omni_rt_check_names_a_bad_layout(models_dir, tmp_path):
    deploy = tmp_path / "d.yaml"
    deploy.write_text(yaml.safe_dump({
        "pipelines": {"tts": {"enabled": False}, "voice": {"enabled": False},
                      "robot": {"stages": {"policy": {"processor_args": {"layouts": {"arm": {"action_dim": 0, "action_horizon": 4}}}}}}},
        "server": {"models_dir": str(models_dir)},
    }))
    proc = subprocess.run([sys.executable, "-m", "omni_rt.cli", "check", "--deploy", str(deploy)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "pipelines.robot.stages.policy.processor_args: layouts.arm: action_dim must be in 1..32" in proc.stderr
    assert "Traceback" not in proc.stderr
