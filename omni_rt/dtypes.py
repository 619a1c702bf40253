"""The dtype policy of torch stages.

- **Each sub-model computes in its configured dtype**: the stage's `engine_args.dtype`
  (the deploy overlay) for the whole stage, else the checkpoint's own: a sub-model's
  sub-config (`thinker_config.torch_dtype`), else the checkpoint's top-level dtype, as
  transformers' `from_pretrained(dtype="auto")` resolves it (`config_dtype`). Vocoders
  whose reference runs them in float32 (Qwen2.5-Omni's token2wav) keep float32 unless
  the overlay says otherwise.
- **Activations are cast at the seams**: a module that joins sub-models of different
  dtypes (Qwen3-Omni's bf16 thinker feeding its talker) casts what crosses between them
  to the receiving sub-model's dtype (`dtype_of`), and what the engine hands in (numpy
  float32) to the sub-model that reads it.
- **Tensors leave an engine as numpy and the connectors take them** (`to_host`):
  bfloat16, which numpy has no type for, and float16 leave as float32.
- **A real-time stage on a CPU computes in float32** (`realtime_dtype`): a stage whose
  output must keep up with playback or a frame clock (a talker, a vocoder, Moshi's
  80 ms step) in bfloat16 / float16 on a CPU runs far below real time (most CPU
  kernels for half types are emulated or unfused: the hub-shaped Moshi in bfloat16 took
  1.6 s for an 80 ms frame), so it is cast to float32 at start-up, with a warning that
  names the stage; `omni-rt check` reports the same (`planned_dtype_note`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger("omni_rt.dtypes")

HALF = (torch.bfloat16, torch.float16)
_NAMES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "half": torch.float16, "float64": torch.float64}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """A torch floating-point dtype from its name (None, "auto": no dtype)."""
    if name is None or isinstance(name, torch.dtype):
        return name
    text = str(name).removeprefix("torch.")
    if text == "auto":
        return None
    dt = _NAMES.get(text)
    if dt is None:
        raise ValueError(f"dtype {name!r} is not a torch floating-point dtype (float32, bfloat16, float16)")
    return dt


def config_dtype(config: Any, *parts: str) -> torch.dtype:
    """The dtype a sub-model of `config` (a transformers config) computes in: the
    sub-config named by `parts` (e.g. "thinker_config"), else the nearest enclosing
    config that names one, else float32."""
    chain = [config]
    for p in parts:
        chain.append(getattr(chain[-1], p))
    for c in reversed(chain):
        dt = parse_dtype(getattr(c, "dtype", None) or getattr(c, "torch_dtype", None))
        if dt is not None:
            return dt
    return torch.float32


def dtype_of(module: torch.nn.Module) -> torch.dtype:
    """The dtype a module's floating-point parameters are in (what its inputs are cast to)."""
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def to_host(t: torch.Tensor) -> np.ndarray:
    """A tensor as numpy in a dtype numpy and the connectors take (half types as float32)."""
    t = t.detach()
    if t.dtype in HALF:
        t = t.float()
    return t.cpu().numpy()


def module_dtypes(module: torch.nn.Module) -> set[torch.dtype]:
    return {p.dtype for p in module.parameters() if p.is_floating_point()} | {b.dtype for b in module.buffers() if b.is_floating_point()}


def cast_on_cpu(device: str, requested: torch.dtype | None, held: Iterable[torch.dtype]) -> list[torch.dtype]:
    """The half types a real-time stage on `device` would compute in and will not: the
    `requested` one (the overlay's), else those the module holds (`held`), on a CPU."""
    if not device.startswith("cpu"):
        return []
    return sorted({d for d in ([requested] if requested is not None else held) if d in HALF}, key=str)


def realtime_dtype(stage: str, device: torch.device, requested: torch.dtype | None, held: Iterable[torch.dtype]) -> torch.dtype | None:
    """The dtype a real-time stage on `device` computes in: `requested` (the overlay's),
    or the module's own (`held`, None: as loaded), except half types on a CPU, which
    are computed in float32 (logged, naming the stage)."""
    half = cast_on_cpu(device.type, requested, held)
    if not half:
        return requested
    log.warning("stage %s: %s on a CPU cannot keep a real-time stage's pace; it computes in float32 (give it a GPU "
                "for %s, or set engine_args.dtype: float32 to silence this)", stage, _name(half[0]), _name(half[0]))
    return torch.float32


def _name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def checkpoint_dtypes(model_dir: str | None) -> set[str]:
    """Every dtype a checkpoint's config.json names (top level and sub-configs), from the
    file alone ("bfloat16", ...); empty when it names none or has no config.json."""
    if model_dir is None:
        return set()
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return set()
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                if k in ("torch_dtype", "dtype") and isinstance(v, str) and v != "auto":
                    found.add(v.removeprefix("torch."))
                else:
                    walk(v)

    walk(cfg)
    return found


def planned_dtype_note(stage: str, device: str, requested: str | None, model_dir: str | None) -> str | None:
    """What `omni-rt check` says of a real-time torch stage whose dtype will not be the
    one asked for (None: nothing to say)."""
    held = {_NAMES[n] for n in checkpoint_dtypes(model_dir) if n in _NAMES}  # a name it does not know is no half type
    half = cast_on_cpu(str(device), parse_dtype(requested), held)
    if not half:
        return None
    source = "engine_args.dtype" if requested else f"the checkpoint's config.json ({model_dir})"
    return (f"stage {stage}: {', '.join(map(_name, half))} from {source} on a CPU cannot keep a real-time stage's pace; "
            "it will compute in float32")
