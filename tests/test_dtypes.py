"""The dtype policy of torch stages (omni_rt.dtypes) on the torch engine: what leaves an
engine, what a real-time stage computes in on a CPU, what `omni-rt check` says."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omni_rt.dtypes import checkpoint_dtypes, config_dtype, parse_dtype, planned_dtype_note, to_host
from omni_rt.engines.torch_engine import TorchEngine


class Affine(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.to(self.lin.weight.dtype))


async def _one(engine: TorchEngine) -> np.ndarray:
    await engine.start()
    try:
        out: np.ndarray = await engine.run(np.ones(4, np.float32))
        return out
    finally:
        await engine.stop()


async def test_half_precision_results_leave_the_engine_as_float32() -> None:
    """A stage asked for bfloat16 (not a real-time one) computes in it, and its results
    reach the caller as float32 arrays (numpy has no bfloat16: `.numpy()` raised)."""
    engine = TorchEngine(lambda: Affine(torch.float32), name="policy", dtype="bfloat16")
    out = await _one(engine)
    assert engine.module is not None and engine.module.lin.weight.dtype == torch.bfloat16
    assert out.dtype == np.float32 and out.shape == (3,)


@pytest.mark.parametrize("asked", [None, "bfloat16", "float16"])
async def test_a_realtime_stage_on_a_cpu_computes_in_float32(asked: str | None, caplog: pytest.LogCaptureFixture) -> None:
    """A real-time stage whose checkpoint (or overlay) is in half precision is cast to
    float32 on a CPU at start-up, with a warning naming the stage."""
    engine = TorchEngine(lambda: Affine(torch.bfloat16), name="moshi", dtype=asked, realtime=True)
    with caplog.at_level(logging.WARNING, "omni_rt.dtypes"):
        out = await _one(engine)
    assert engine.module is not None and engine.module.lin.weight.dtype == torch.float32 and engine.dtype == torch.float32
    assert out.dtype == np.float32
    assert any("stage moshi" in r.getMessage() and "float32" in r.getMessage() for r in caplog.records), caplog.text


async def test_a_realtime_stage_in_float32_is_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    engine = TorchEngine(lambda: Affine(torch.float32), name="code2wav", realtime=True)
    with caplog.at_level(logging.WARNING, "omni_rt.dtypes"):
        await _one(engine)
    assert engine.dtype is None and not caplog.records


def test_sub_model_dtypes_resolve_as_from_pretrained_does() -> None:
    """A sub-config's own dtype, else the nearest enclosing one (Qwen3-Omni's talker
    config names none: the checkpoint's top-level bfloat16), else float32."""
    cfg = SimpleNamespace(dtype="bfloat16", thinker_config=SimpleNamespace(dtype="bfloat16"), talker_config=SimpleNamespace(dtype=None),
                          code2wav_config=SimpleNamespace(torch_dtype="float32"))
    assert config_dtype(cfg, "talker_config") == torch.bfloat16
    assert config_dtype(cfg, "code2wav_config") == torch.float32
    assert config_dtype(SimpleNamespace(dtype=None, sub=SimpleNamespace(dtype=None)), "sub") == torch.float32
    assert parse_dtype("torch.float16") == torch.float16 and parse_dtype("auto") is None
    with pytest.raises(ValueError, match="not a torch floating-point dtype"):
        parse_dtype("int8")
    assert to_host(torch.ones(2, dtype=torch.bfloat16)).dtype == np.float32


def test_check_says_which_realtime_stage_will_not_compute_in_its_dtype(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16", "audio_encoder_config": {"dtype": "float32"}}))
    assert checkpoint_dtypes(str(tmp_path)) == {"bfloat16", "float32"}
    note = planned_dtype_note("moshi", "cpu", None, str(tmp_path))
    assert note is not None and "stage moshi" in note and "bfloat16" in note and "float32" in note
    assert planned_dtype_note("moshi", "cuda", None, str(tmp_path)) is None
    assert planned_dtype_note("moshi", "cpu", "float32", str(tmp_path)) is None
    assert "engine_args.dtype" in (planned_dtype_note("moshi", "cpu", "bfloat16", str(tmp_path)) or "")
