"""What the video stages on the diffusers step engine share (`ClipProcessor` for jobs,
`ForcingProcessor` for live video and, through it, the world model): the engine, the
processor args every one of them takes, the prompt's length in text tokens, and the
part of `describe()` the video wires read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omni_rt.engines.base import DiffusionEngine, Engine
from omni_rt.specs import StageSpec
from omni_rt.stage import StageProcessor, check_processor_args


class VideoStage(StageProcessor):
    """A stage on a video family of the diffusers step engine. Subclasses name their
    own processor args in `EXTRA_ARGS`, and their defaults for the shared ones in
    `DEFAULTS`."""

    SHARED_ARGS = frozenset({"default_size", "default_steps", "max_steps", "guidance_scale", "negative_prompt"})
    EXTRA_ARGS: frozenset[str] = frozenset()
    DEFAULTS: Mapping[str, Any] = {"default_size": 64, "default_steps": 6, "max_steps": 50}
    WHAT = "video"  # how its processor_args are named in errors

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        self.dit = self.engine_as(DiffusionEngine)
        self.args = dict(spec.processor_args)
        check_processor_args(self.args, self.SHARED_ARGS | self.EXTRA_ARGS, self.WHAT)
        self.default_size = int(self.args.get("default_size", self.DEFAULTS["default_size"]))
        self.default_steps = int(self.args.get("default_steps", self.DEFAULTS["default_steps"]))
        self.max_steps = int(self.args.get("max_steps", self.DEFAULTS["max_steps"]))
        self.guidance_scale = float(self.args.get("guidance_scale", 1.0))
        self.negative_prompt = self.args.get("negative_prompt")
        if not (1 <= self.default_steps <= self.max_steps and self.default_size >= 16):
            raise ValueError(f"{self.WHAT} processor_args: 1 <= default_steps <= max_steps, default_size >= 16")

    @property
    def frame_multiple(self) -> int:
        return int(getattr(self.dit, "frame_multiple", 1))

    def prompt_tokens(self, prompt: str) -> int:
        """The prompt's length in the text encoder's tokens (the wires refuse prompts
        over `max_prompt_tokens`)."""
        return int(self.dit.prompt_tokens(prompt))

    def describe(self) -> dict[str, Any]:
        return {
            "default_size": self.default_size,
            "default_steps": self.default_steps,
            "max_steps": self.max_steps,
            "size_multiple": self.dit.size_multiple,
            "frame_multiple": self.frame_multiple,
            "max_prompt_tokens": getattr(self.dit, "max_sequence_length", None),
        }
