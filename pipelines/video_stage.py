"""What the video stages on the diffusers step engine share (`ClipProcessor` for jobs,
`ForcingProcessor` for live video and, through it, the world model): the engine, the
processor args every one of them takes, the prompt's length in text tokens, and the
part of `describe()` the video wires read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, model_validator

from omni_rt.engines.base import DiffusionEngine, Engine
from omni_rt.specs import StageSpec
from omni_rt.stage import ProcessorArgs, StageProcessor


class VideoArgs(ProcessorArgs):
    """What every video stage takes: its default frame side, denoising steps (default and
    most a request may ask), classifier-free guidance and negative prompt."""

    default_size: int = Field(default=64, ge=16)
    default_steps: int = Field(default=6, ge=1)
    max_steps: int = Field(default=50, ge=1)
    guidance_scale: float = Field(default=1.0, ge=0.0)
    negative_prompt: str | None = None

    @model_validator(mode="after")
    def _steps_fit(self) -> VideoArgs:
        if self.default_steps > self.max_steps:
            raise ValueError(f"default_steps {self.default_steps} is over max_steps {self.max_steps}")
        return self


class VideoStage(StageProcessor):
    """A stage on a video family of the diffusers step engine; a subclass's `ARGS` adds
    its own processor args and defaults to `VideoArgs`."""

    ARGS: type[VideoArgs] = VideoArgs
    WHAT = "video"  # how its processor_args are named in errors

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        self.dit = self.engine_as(DiffusionEngine)
        self.args: Any = self.ARGS.parse(spec.processor_args, self.WHAT)
        self.default_size = self.args.default_size
        self.default_steps = self.args.default_steps
        self.max_steps = self.args.max_steps
        self.guidance_scale = self.args.guidance_scale
        self.negative_prompt = self.args.negative_prompt

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
