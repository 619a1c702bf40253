"""What a stage can tell about a checkpoint directory from its config and processor
files alone (no weights read): the checks behind `StageProcessor.check_model`, which
`omni-rt check` and serve run before any engine starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omni_rt.errors import StageError

TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")


def config(model_dir: str, name: str = "config.json") -> dict[str, Any]:
    path = Path(model_dir) / name
    if not path.is_file():
        return {}
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise StageError(f"{path}: not readable JSON ({exc})") from None
    return out if isinstance(out, dict) else {}


def architectures(model_dir: str) -> list[str]:
    """The `architectures` a checkpoint's config.json declares (empty when none)."""
    return [str(a) for a in config(model_dir).get("architectures") or []]


def has_chat_template(model_dir: str) -> bool:
    d = Path(model_dir)
    if (d / "chat_template.json").is_file() or (d / "chat_template.jinja").is_file():
        return True
    return bool(config(model_dir, "tokenizer_config.json").get("chat_template"))


def check_tokenizer_files(model_dir: str, what: str, chat: bool = False) -> None:
    d = Path(model_dir)
    if not any((d / f).is_file() for f in TOKENIZER_FILES):
        raise StageError(f"{what} {model_dir}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    if chat and not has_chat_template(model_dir):
        raise StageError(f"{what} {model_dir}: no chat template (chat_template.json/.jinja or tokenizer_config.json)")


def check_architecture(model_dir: str, what: str, accepted: str, ok: Any) -> list[str]:
    """The declared architectures, refused unless `ok(arch)` holds for one of them."""
    arch = architectures(model_dir)
    if not arch:
        raise StageError(f"{what} {model_dir}: config.json missing or without architectures")
    if not any(ok(a) for a in arch):
        raise StageError(f"{what} {model_dir}: architecture {arch[0]} is not {accepted}")
    return arch


def check_mimi(model_dir: str, mimi: dict[str, Any], what: str) -> None:
    """Mimi (the codec inside Moshi and Kyutai STT) as these stages step it: 24 kHz, 12.5 frames a second."""
    if mimi.get("sampling_rate", 24000) != 24000 or mimi.get("frame_rate", 12.5) != 12.5:
        raise StageError(f"{model_dir}: Mimi at {mimi.get('sampling_rate')} Hz / {mimi.get('frame_rate')} Hz; the {what} stage runs 24 kHz at 12.5 frames a second")


def diffusers_class(model_dir: str) -> str:
    """`_class_name` of a diffusers pipeline directory's model_index.json."""
    index = config(model_dir, "model_index.json")
    if not index:
        raise StageError(f"{model_dir}: no model_index.json (a diffusers pipeline directory)")
    return str(index.get("_class_name"))


def check_diffusers_family(model_dir: str, video: bool) -> str:
    """The class a diffusers directory's model_index.json names, refused unless the
    step engine runs it as a video (or, `video` False, an image) family."""
    from omni_rt.engines.diffusion_families import FAMILIES

    name = diffusers_class(model_dir)
    family = FAMILIES.get(name)
    if family is None or family.video != video:
        fits = sorted(k for k, f in FAMILIES.items() if f.video == video)
        raise StageError(f"{model_dir}: model_index.json names {name}, not {'a video' if video else 'an image'} pipeline this server runs ({', '.join(fits)})")
    return name
