"""The `robot` pipeline: one policy stage mapping observations to action chunks.

The policy is π0-shaped: a prefix encoder (camera patches, the prompt's bytes, the
proprioceptive state) and an action expert that predicts the flow-matching velocity
of a noisy action chunk, integrated from noise (t = 1) to actions (t = 0) in
`num_steps` Euler steps. Inputs are padded to fixed sizes (camera slots, state and
action widths), as π0 pads them, so robots of different embodiments share one batch.

- Layouts (`processor_args.layouts`) are the per-embodiment input/output transforms:
  which observation keys are the cameras, which are concatenated into the state, the
  prompt key, and how many action dims and steps the robot gets. A connection picks
  one (`?layout=aloha`), else `default_layout`.
- Continuous batching at step level: every encode and every denoising step is one
  item on the torch engine, so robots that arrive mid-inference join the next step's
  batch. Each request's noise comes from its own generator (episode seed, step), so a
  batched result equals the unbatched one.
- Episode state (the step counter that seeds the noise and the previous chunk's last
  action, which chunk-boundary smoothing blends toward) lives in the robot's session:
  it comes in as `params["episode"]` and the updated state goes back on the action
  payload's `meta["episode"]`. Nothing is shared between robots.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni_rt.engines.base import Engine, StepEngine
from omni_rt.payloads import Payload, PayloadKind
from omni_rt.specs import StageSpec
from omni_rt.stage import StageContext, StageError, StageProcessor

PROMPT_PAD = 256  # byte ids are 0..255


class PolicyNet(torch.nn.Module):
    """encode(images, state, prompt) -> prefix; velocity(x, t, prefix) -> dx/dt."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        w, heads = int(config["width"]), int(config["heads"])
        self.slots = int(config["image_slots"])
        self.grid = int(config["grid"])
        self.horizon = int(config["action_horizon"])
        self.p = int(config["patch"])
        self.side = int(config["image_size"]) // self.p
        if self.side * self.p != int(config["image_size"]) or self.side % self.grid:
            raise ValueError("image_size must be a multiple of patch, and image_size/patch of grid")
        self.patch = torch.nn.Linear(3 * self.p * self.p, w)
        self.slot_emb = torch.nn.Parameter(torch.randn(self.slots, 1, w) * 0.02)
        self.byte_emb = torch.nn.Embedding(PROMPT_PAD + 1, w)
        self.state_proj = torch.nn.Linear(int(config["max_state_dim"]), w)

        def layer(cls: Any) -> Any:
            return cls(w, heads, 4 * w, dropout=0.0, batch_first=True, norm_first=True)

        self.prefix_enc = torch.nn.TransformerEncoder(
            layer(torch.nn.TransformerEncoderLayer), int(config["prefix_layers"]), enable_nested_tensor=False
        )
        self.action_in = torch.nn.Linear(int(config["max_action_dim"]), w)
        self.pos = torch.nn.Parameter(torch.randn(self.horizon, w) * 0.02)
        self.time_mlp = torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.SiLU(), torch.nn.Linear(w, w))
        self.expert = torch.nn.TransformerDecoder(layer(torch.nn.TransformerDecoderLayer), int(config["expert_layers"]))
        self.action_out = torch.nn.Linear(w, int(config["max_action_dim"]))
        half = w // 2
        self.register_buffer("freqs", torch.exp(-math.log(10000.0) * torch.arange(half) / half), persistent=False)

    def encode(self, images: torch.Tensor, image_mask: torch.Tensor, state: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
        """images uint8 [B, slots, S, S, 3] (slots without a camera: image_mask False,
        not computed), state f32 [B, max_state_dim], prompt int64 [B, prompt_len] ->
        prefix [B, P, width]."""
        b, n, p = images.shape[0], self.side, self.p
        mask = image_mask.reshape(-1)
        present = images.reshape(b * self.slots, *images.shape[2:])[mask]
        patches = present.reshape(-1, n, p, n, p, 3).permute(0, 1, 3, 2, 4, 5).reshape(-1, n * n, p * p * 3)
        # pixels / 127.5 - 1 folded into the patch projection
        w = self.patch.weight / 127.5
        x = torch.nn.functional.gelu(torch.nn.functional.linear(patches.float(), w, self.patch.bias - self.patch.weight.sum(1)))
        x = torch.nn.functional.avg_pool2d(x.transpose(1, 2).reshape(x.shape[0], -1, n, n), n // self.grid)
        tok = x.new_zeros(b * self.slots, self.grid * self.grid, x.shape[1])
        tok[mask] = x.flatten(2).transpose(1, 2)  # [cameras, grid², w]
        tok = (tok.reshape(b, self.slots, -1, tok.shape[-1]) + self.slot_emb).flatten(1, 2)
        prefix = torch.cat([tok, self.byte_emb(prompt), self.state_proj(state)[:, None]], dim=1)
        return self.prefix_enc(prefix)

    def velocity(self, x: torch.Tensor, t: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """x f32 [B, horizon, max_action_dim] at time t f32 [B] -> velocity, same shape."""
        ang = t[:, None] * 1000.0 * self.freqs[None]
        temb = self.time_mlp(torch.cat([ang.sin(), ang.cos()], dim=-1))
        h = self.action_in(x) + self.pos[None] + temb[:, None]
        return self.action_out(self.expert(h, prefix))


def load_policy(model_dir: str) -> tuple[dict[str, Any], PolicyNet]:
    from safetensors.torch import load_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    net = PolicyNet(config)
    net.load_state_dict(load_file(str(Path(model_dir) / "model.safetensors")))
    return config, net.eval()


# ---- layouts (per-embodiment input/output transforms) ----------------------------------


@dataclass(frozen=True)
class Layout:
    name: str
    images: tuple[str, ...]
    state: tuple[str, ...]
    state_dims: tuple[int, ...]
    action_dim: int
    action_horizon: int
    prompt: str = "prompt"
    default_prompt: str = ""

    @classmethod
    def parse(cls, name: str, raw: Mapping[str, Any], config: Mapping[str, Any]) -> Layout:
        known = {"images", "state", "state_dims", "action_dim", "action_horizon", "prompt", "default_prompt"}
        if not isinstance(raw, Mapping):
            raise ValueError(f"layouts.{name}: a layout is a mapping of {sorted(known)}")
        bad = set(raw) - known
        if bad:
            raise ValueError(f"layouts.{name}: unknown keys {sorted(bad)}; known: {sorted(known)}")
        missing = {"action_dim", "action_horizon"} - set(raw)
        if missing:
            raise ValueError(f"layouts.{name}: {', '.join(sorted(missing))} missing")
        lay = cls(
            name=name,
            images=tuple(raw.get("images", ())),
            state=tuple(raw.get("state", ())),
            state_dims=tuple(int(d) for d in raw.get("state_dims", ())),
            action_dim=int(raw["action_dim"]),
            action_horizon=int(raw["action_horizon"]),
            prompt=str(raw.get("prompt", "prompt")),
            default_prompt=str(raw.get("default_prompt", "")),
        )
        if len(lay.images) > int(config["image_slots"]):
            raise ValueError(f"layouts.{name}: {len(lay.images)} cameras, the policy has {config['image_slots']} slots")
        if len(lay.state) != len(lay.state_dims) or any(d < 1 for d in lay.state_dims):
            raise ValueError(f"layouts.{name}: state and state_dims must pair up, each dim >= 1")
        if sum(lay.state_dims) > int(config["max_state_dim"]):
            raise ValueError(f"layouts.{name}: state of {sum(lay.state_dims)} dims exceeds max_state_dim {config['max_state_dim']}")
        if not 1 <= lay.action_dim <= int(config["max_action_dim"]):
            raise ValueError(f"layouts.{name}: action_dim must be in 1..{config['max_action_dim']}")
        if not 1 <= lay.action_horizon <= int(config["action_horizon"]):
            raise ValueError(f"layouts.{name}: action_horizon must be in 1..{config['action_horizon']}")
        return lay


def _image(name: str, arr: np.ndarray, size: int) -> np.ndarray:
    """An HWC or CHW camera image (uint8, or float in [0, 1]) -> uint8 [size, size, 3],
    resized with padding (aspect kept) when it is not already that size."""
    if arr.ndim != 3 or 3 not in (arr.shape[0], arr.shape[-1]):
        raise StageError(f"observation {name!r}: expected an image [H, W, 3] or [3, H, W], got shape {list(arr.shape)}")
    if arr.shape[-1] != 3:
        arr = arr.transpose(1, 2, 0)
    if arr.dtype != np.uint8:
        if arr.dtype.kind != "f":
            raise StageError(f"observation {name!r}: images are uint8 (or float in [0, 1]), got {arr.dtype}")
        if not np.isfinite(arr).all():
            raise StageError(f"observation {name!r}: image has NaN or infinite values")
        arr = (np.clip(arr, 0.0, 1.0) * 255.0).round().astype(np.uint8)
    h, w = arr.shape[:2]
    if h < 1 or w < 1 or max(h, w) > 4096:
        raise StageError(f"observation {name!r}: image side must be 1..4096 pixels, got {h}x{w}")
    if (h, w) == (size, size):
        return arr
    from PIL import Image

    scale = size / max(h, w)
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
    small = np.asarray(Image.fromarray(np.ascontiguousarray(arr)).resize((nw, nh), Image.Resampling.BILINEAR))
    out = np.zeros((size, size, 3), np.uint8)
    top, left = (size - nh) // 2, (size - nw) // 2
    out[top : top + nh, left : left + nw] = small
    return out


class PolicyProcessor(StageProcessor):
    """Entry stage: one OBSERVATION payload in, one ACTIONS payload out per request."""

    ARGS = {"layouts", "default_layout", "num_steps", "smoothing", "seed"}

    @staticmethod
    def torch_module(model_dir: str, role: str) -> Callable[[], torch.nn.Module]:
        return lambda: load_policy(model_dir)[1]

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        self.steps = self.engine_as(StepEngine)
        assert spec.model is not None
        self.config = json.loads((Path(spec.model) / "config.json").read_text())
        args = dict(spec.processor_args)
        bad = set(args) - self.ARGS
        if bad:
            raise ValueError(f"unknown policy processor_args {sorted(bad)}; known: {sorted(self.ARGS)}")
        self.layouts = {n: Layout.parse(n, raw, self.config) for n, raw in (args.get("layouts") or {}).items()}
        if not self.layouts:
            raise ValueError("policy processor_args.layouts: at least one layout is needed")
        self.default_layout = str(args.get("default_layout") or next(iter(self.layouts)))
        if self.default_layout not in self.layouts:
            raise ValueError(f"default_layout {self.default_layout!r} is not one of {sorted(self.layouts)}")
        self.num_steps = int(args.get("num_steps", self.config.get("num_steps", 10)))
        self.smoothing = float(args.get("smoothing", 0.5))
        self.seed = int(args.get("seed", 0))
        if self.num_steps < 1 or not 0.0 <= self.smoothing < 1.0:
            raise ValueError("policy processor_args: num_steps >= 1 and 0 <= smoothing < 1")
        self.size = int(self.config["image_size"])
        self.slots = int(self.config["image_slots"])
        self.prompt_len = int(self.config["prompt_len"])
        self.max_state = int(self.config["max_state_dim"])
        self.max_action = int(self.config["max_action_dim"])
        self.horizon = int(self.config["action_horizon"])

    # ---- what a client is told first ---------------------------------------------------
    def layout(self, name: str | None) -> Layout:
        lay = self.layouts.get(name or self.default_layout)
        if lay is None:
            raise KeyError(f"unknown layout {name!r}; this policy serves: {', '.join(sorted(self.layouts))}")
        return lay

    def metadata(self, name: str | None) -> dict[str, Any]:
        lay = self.layout(name)
        return {
            "policy": self.config.get("name", "omni-rt-policy"),
            "layout": lay.name,
            "layouts": sorted(self.layouts),
            "action_horizon": lay.action_horizon,
            "action_dim": lay.action_dim,
            "action_keys": ["actions"],
            "actions": {"shape": [lay.action_horizon, lay.action_dim], "dtype": "float32"},
            "image_keys": list(lay.images),
            "image_resolution": [self.size, self.size],
            "state_keys": list(lay.state),
            "state_dims": list(lay.state_dims),
            "prompt_key": lay.prompt,
            "num_steps": self.num_steps,
            "smoothing": self.smoothing,
        }

    def new_episode(self, seed: int | None = None) -> dict[str, Any]:
        return {"seed": self.seed if seed is None else int(seed), "step": 0, "prev": None}

    # ---- observation -> model inputs ---------------------------------------------------
    def prepare(self, lay: Layout, obs: Payload) -> dict[str, np.ndarray]:
        arrays, texts = obs.arrays, obs.meta.get("text", {})
        missing = [k for k in (*lay.images, *lay.state) if k not in arrays]
        if missing:
            raise StageError(
                f"observation is missing {', '.join(repr(k) for k in missing)} (layout {lay.name!r} needs "
                f"images {list(lay.images)} and state {list(lay.state)})"
            )
        images = np.zeros((self.slots, self.size, self.size, 3), np.uint8)
        image_mask = np.zeros(self.slots, np.bool_)
        for i, key in enumerate(lay.images):
            images[i] = _image(key, arrays[key], self.size)
            image_mask[i] = True
        state = np.zeros(self.max_state, np.float32)
        at = 0
        for key, dim in zip(lay.state, lay.state_dims, strict=True):
            v = arrays[key]  # numeric: payloads carry no other dtypes
            v = v.reshape(-1) if v.ndim <= 1 else v
            if v.shape != (dim,):
                raise StageError(f"observation {key!r}: expected shape [{dim}], got {list(arrays[key].shape)}")
            v = v.astype(np.float32)
            if not np.isfinite(v).all():
                raise StageError(f"observation {key!r}: state has NaN or infinite values")
            state[at : at + dim] = v
            at += dim
        if lay.prompt in arrays:
            raise StageError(f"observation {lay.prompt!r}: the prompt is a string")
        text = texts.get(lay.prompt, lay.default_prompt)
        raw = text.encode()[: self.prompt_len]
        prompt = np.full(self.prompt_len, PROMPT_PAD, np.int64)
        prompt[: len(raw)] = np.frombuffer(raw, np.uint8)
        return {"images": images, "image_mask": image_mask, "state": state, "prompt": prompt}

    # ---- inference -----------------------------------------------------------------------
    async def run(self, ctx: StageContext) -> None:
        try:
            lay = self.layout(ctx.params.get("layout"))
        except KeyError as exc:
            raise StageError(str(exc.args[0])) from None
        episode = dict(ctx.params.get("episode") or self.new_episode())
        async for obs in ctx.input():
            if obs.kind != PayloadKind.OBSERVATION:
                raise StageError(f"the policy takes observations, not {obs.kind.value}")
            t0 = time.perf_counter()
            resize = any(k in obs.arrays and obs.arrays[k].shape[:2] != (self.size, self.size) for k in lay.images)
            inputs = await asyncio.to_thread(self.prepare, lay, obs) if resize else self.prepare(lay, obs)
            rng = np.random.default_rng([int(episode["seed"]) & 0xFFFFFFFF, int(episode["step"])])
            x = rng.standard_normal((self.horizon, self.max_action), dtype=np.float32)
            prefix = await self.steps.run(inputs, op="encode")
            dt = 1.0 / self.num_steps
            for k in range(self.num_steps):
                t = np.asarray(1.0 - k * dt, np.float32)
                v = await self.steps.run({"x": x, "t": t, "prefix": prefix}, op="velocity")
                x = x - dt * v
            actions = np.ascontiguousarray(x[: lay.action_horizon, : lay.action_dim], dtype=np.float32)
            prev = episode.get("prev")
            if prev is not None and self.smoothing > 0:
                # Chunk-boundary smoothing: the first steps lean toward where the previous
                # chunk ended, with a weight that halves (for 0.5) step by step.
                w = (self.smoothing ** np.arange(1, lay.action_horizon + 1, dtype=np.float32))[:, None]
                actions = (1.0 - w) * actions + w * np.asarray(prev, np.float32)[None, :]
                actions = actions.astype(np.float32)
            episode = {"seed": episode["seed"], "step": int(episode["step"]) + 1, "prev": actions[-1].tolist()}
            infer_ms = (time.perf_counter() - t0) * 1000.0
            ctx.add_usage(action_chunks=1)
            await ctx.emit(
                Payload(PayloadKind.ACTIONS, ctx.fence, arrays={"actions": actions}, meta={"episode": episode, "infer_ms": infer_ms}),
                last=True,
            )
