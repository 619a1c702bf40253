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
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni_rt.engines.base import Engine
from omni_rt.specs import StageSpec
from omni_rt.stage import StageContext, StageError
from pipelines.forcing import ForcingProcessor


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
