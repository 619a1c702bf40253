"""The `world` pipeline: an autoregressive diffusion world model.

`ForcingWorldProcessor` (the default): a diffusion-forcing video backbone
(SkyReels-V2 DF's `SkyReelsV2DiffusionForcingPipeline` directory) plus an action
module in the same directory (`action.json` + `action_encoder.safetensors`: the
`ActionEncoder`, an action vector → `tokens` extra conditioning tokens in the text
encoder's space, beside the prompt's). Each `world.step` renders the next latent frame
of the rollout — 4 frames, the first step's 1 — conditioned on the clean latents of
the frames before it (the session's history, as diffusion forcing conditions a chunk
on its prefix), the prompt and the action. Steps of every world session of one frame
size share the engine's denoising steps.

`WorldProcessor` (a named legacy option, `tiny:world`): the home-made world model
described below.

Each step denoises the next frame's latents with the Flux transformer of a diffusers
pipeline directory, conditioned on the prompt, on the latents of the last
`history_frames` frames and on an action vector: a `WorldConditioner` (in the same
directory, `world.json` + `conditioner.safetensors`) turns history and action into
extra tokens beside the text tokens, and the action into a shift of the pooled text
embedding. Frames run on the diffusers step engine, so the steps of every world
session of the same frame size are batched together.

The latent history is session state: it comes in as `params["history"]` (a list of
packed latents, oldest first; missing frames are zeros) and the new frame's latents
go back on the output payload (`arrays["latents"]`) for the session to keep. Frame
`k` of a rollout uses noise seed `seed + k`, so a rollout is reproducible from its
seed and actions.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni_rt.engines.base import DiffusionEngine, Engine
from omni_rt.engines.diffusers_engine import DiffusionJob
from omni_rt.payloads import Payload, PayloadKind
from omni_rt.specs import StageSpec
from omni_rt.stage import StageContext, StageError, StageProcessor
from pipelines.forcing import ForcingProcessor


class WorldConditioner(torch.nn.Module):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.history_frames = int(config["history_frames"])
        d = int(config["joint_dim"])
        self.latent_in = torch.nn.Linear(int(config["latent_channels"]), d)
        self.frame_pos = torch.nn.Parameter(torch.randn(self.history_frames, 1, d) * 0.02)
        self.action_token = torch.nn.Linear(int(config["action_dim"]), d)
        self.action_pooled = torch.nn.Linear(int(config["action_dim"]), int(config["pooled_dim"]))

    def forward(self, history: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """history [frames, tokens, channels], action [action_dim] -> (tokens
        [frames * tokens + 1, joint_dim], pooled shift [pooled_dim])."""
        h = (self.latent_in(history) + self.frame_pos).flatten(0, 1)
        return torch.cat([h, self.action_token(action)[None]], dim=0), self.action_pooled(action)


class WorldProcessor(StageProcessor):
    ARGS = {"default_steps", "max_steps"}

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        self.dit = self.engine_as(DiffusionEngine)
        assert spec.model is not None
        args = dict(spec.processor_args)
        bad = set(args) - self.ARGS
        if bad:
            raise ValueError(f"unknown world processor_args {sorted(bad)}; known: {sorted(self.ARGS)}")
        self.default_steps = int(args.get("default_steps", 8))
        self.max_steps = int(args.get("max_steps", 50))
        path = Path(spec.model)
        if not (path / "world.json").is_file():
            raise ValueError(f"{path} has no world.json (a world model directory holds a diffusers pipeline plus world.json and conditioner.safetensors)")
        self.config = json.loads((path / "world.json").read_text())
        from safetensors.torch import load_file

        self.conditioner = WorldConditioner(self.config).eval()
        self.conditioner.load_state_dict(load_file(str(path / "conditioner.safetensors")))
        self.action_dim = int(self.config["action_dim"])
        self.history_frames = int(self.config["history_frames"])
        self.frame_size = int(self.config.get("frame_size", 128))

    def describe(self) -> dict[str, Any]:
        return {
            "action_dim": self.action_dim,
            "history_frames": self.history_frames,
            "default_size": self.frame_size,
            "default_steps": self.default_steps,
            "max_steps": self.max_steps,
            "size_multiple": self.dit.size_multiple,
        }

    def frame_job(self, p: Any, history: list[np.ndarray], action: np.ndarray, frame: int) -> DiffusionJob:
        """The diffusion job of frame `frame`, conditioned on `history` and `action`."""
        height, width = int(p["height"]), int(p["width"])
        m = self.dit.size_multiple
        tokens = (height // m) * (width // m)
        hist = np.zeros((self.history_frames, tokens, int(self.config["latent_channels"])), np.float32)
        past = history[-self.history_frames :]
        for i, lat in enumerate(past):  # right-aligned: the newest frame last
            hist[self.history_frames - len(past) + i] = lat
        with torch.inference_mode():
            context, pooled_bias = self.conditioner(torch.from_numpy(hist), torch.from_numpy(action))
        return DiffusionJob(
            prompt=str(p.get("prompt") or ""),
            height=height,
            width=width,
            steps=int(p.get("steps") or self.default_steps),
            seed=int(p.get("seed", 0)) + frame,
            context=context,
            pooled_bias=pooled_bias,
        )

    async def render(self, ctx: StageContext, job: DiffusionJob, frame: int, done_steps: int, total_steps: int, last: bool) -> np.ndarray:
        """Run one frame's job, emitting progress and then the frame; its latents back."""
        async for ev in self.dit.generate(job):
            if ev["type"] == "progress":
                await ctx.emit(Payload(PayloadKind.IMAGE, ctx.fence, meta={"progress": done_steps + ev["step"], "total": total_steps}))
            elif ev["type"] == "image":
                await ctx.emit(
                    Payload(PayloadKind.IMAGE, ctx.fence, arrays={"image": ev["image"], "latents": ev["latents"]}, meta={"frame_index": frame}),
                    last=last,
                )
                latents: np.ndarray = ev["latents"]
                return latents
        raise StageError("the engine returned no frame")

    async def run(self, ctx: StageContext) -> None:
        p = ctx.params
        action = np.asarray(p["action"], np.float32)
        if action.shape != (self.action_dim,) or not np.isfinite(action).all():
            raise StageError(f"action must be {self.action_dim} finite numbers")
        frame = int(p.get("frame_index", 0))
        job = self.frame_job(p, list(p.get("history") or []), action, frame)
        await self.render(ctx, job, frame, 0, job.steps, last=True)
        ctx.add_usage(frames=1, steps=job.steps)


class ActionEncoder(torch.nn.Module):
    """An action vector -> `tokens` conditioning tokens [tokens, text_dim] for a video
    backbone's cross-attention (they join the prompt's text tokens)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.tokens = int(config["tokens"])
        self.text_dim = int(config["text_dim"])
        self.proj = torch.nn.Sequential(
            torch.nn.Linear(int(config["action_dim"]), self.text_dim), torch.nn.SiLU(), torch.nn.Linear(self.text_dim, self.tokens * self.text_dim)
        )

    def forward(self, action: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(action).view(self.tokens, self.text_dim)
        return out


class ForcingWorldProcessor(ForcingProcessor):
    """World rollouts on a diffusion-forcing backbone with an action module (see the
    module docstring). `params`: prompt, width, height, steps, seed, frame_index,
    history (one latent frame per frame shown), action."""

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        assert spec.model is not None
        from safetensors.torch import load_file

        path = Path(spec.model)
        self.config = json.loads((path / "action.json").read_text())
        self.action_dim = int(self.config["action_dim"])
        self.encoder = ActionEncoder(self.config).eval()
        self.encoder.load_state_dict(load_file(str(path / "action_encoder.safetensors")))

    @classmethod
    def check_model(cls, model_dir: str) -> None:
        super().check_model(model_dir)
        for name in ("action.json", "action_encoder.safetensors"):
            if not (Path(model_dir) / name).is_file():
                raise StageError(f"{model_dir}: no {name} (a world model directory holds a diffusion-forcing pipeline plus action.json and action_encoder.safetensors)")

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "action_dim": self.action_dim, "frames_per_step": self.frame_multiple}

    async def run(self, ctx: StageContext) -> None:
        p = ctx.params
        action = np.asarray(p["action"], np.float32)
        if action.shape != (self.action_dim,) or not np.isfinite(action).all():
            raise StageError(f"action must be {self.action_dim} finite numbers")
        with torch.inference_mode():
            tokens = self.encoder(torch.from_numpy(action))
        frame = int(p.get("frame_index", 0))
        prefix = self.prefix(list(p.get("history") or [])) if frame > 0 else None
        await self.render(ctx, p, frame, 1 if prefix is None else self.frame_multiple, prefix, self.frame_multiple, context=tokens)
