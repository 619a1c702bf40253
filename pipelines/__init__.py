"""Pipeline definitions: stage graphs (YAML next to this file) and their processors."""

from __future__ import annotations

from pathlib import Path

from omni_rt.specs import PipelineSpec, load_pipeline

PIPELINE_DIR = Path(__file__).parent
PIPELINES = ("tts", "voice", "asr", "robot", "image", "world", "video", "video_edit", "moshi")


def load_builtin(name: str) -> PipelineSpec:
    if name not in PIPELINES:
        raise KeyError(f"unknown pipeline {name!r}; known: {', '.join(PIPELINES)}")
    return load_pipeline(PIPELINE_DIR / f"{name}.yaml")


def load_all() -> dict[str, PipelineSpec]:
    return {name: load_builtin(name) for name in PIPELINES}
