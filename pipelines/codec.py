"""SNAC codec helpers shared by the TTS/voice pipelines (talker -> code2wav).

Token layout follows Orpheus so real Orpheus + SNAC weights drop in unchanged:

* the talker emits 7 codec tokens per frame;
  ``token_id = audio_token_offset + slot * codebook_size + code`` (slot 0..6);
* one frame ``(c0..c6)`` maps onto SNAC's three codebooks (vq_strides [4, 2, 1]) as
  ``level0[f] = c0``, ``level1[2f] = c1``, ``level1[2f+1] = c4``,
  ``level2[4f] = c2``, ``level2[4f+1] = c3``, ``level2[4f+2] = c5``, ``level2[4f+3] = c6``;
* one frame decodes to ``SAMPLES_PER_FRAME`` = 2048 samples (24 kHz SNAC: hop 512 x stride 4).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

CODES_PER_FRAME = 7
SAMPLES_PER_FRAME = 2048  # prod(decoder_rates [8, 8, 4, 2]) * vq_strides[0] (4)
SAMPLE_RATE = 24000

# Frame slot -> (SNAC level, offset inside the frame's span on that level).
_SLOT_TO_LEVEL: tuple[tuple[int, int], ...] = (
    (0, 0),  # c0 -> level0[f]
    (1, 0),  # c1 -> level1[2f]
    (2, 0),  # c2 -> level2[4f]
    (2, 1),  # c3 -> level2[4f+1]
    (1, 1),  # c4 -> level1[2f+1]
    (2, 2),  # c5 -> level2[4f+2]
    (2, 3),  # c6 -> level2[4f+3]
)
_LEVEL_SPAN = (1, 2, 4)

# Receptive field of the SNAC 24 kHz decoder (vq_strides [4,2,1], rates [8,8,4,2],
# kernel-7 residual units with dilations 1/3/9), in frames (left, right).
# Measured, not derived: decode 40 random frames, change the codes of one frame
# (frame 10, 20 or 29; all 7 codes at once, and each slot alone), decode again and
# find the first/last output sample that differs at all (|diff| > 0). Changed
# samples reach 4739-4757 samples (2.3 frames of 2048) on each side of the frame, so
# 3 whole frames on each side are affected. Identical for decoder_dim 128 (tiny),
# 256 and 1024 (the real release's width): it depends on the architecture only.
# For chunked decoding to equal a full decode, decode each chunk with >= 3 frames of
# left context and >= 3 frames of lookahead, and keep only the chunk's own samples.
SNAC_RECEPTIVE_FIELD_FRAMES: tuple[int, int] = (3, 3)
SNAC_RECEPTIVE_FIELD_SAMPLES: tuple[int, int] = (4757, 4757)  # max seen, both sides


@dataclass(frozen=True, slots=True)
class CodecLayout:
    """Where codec and control tokens sit in the talker vocabulary (Orpheus defaults)."""

    audio_token_offset: int = 128266
    codebook_size: int = 4096
    codes_per_frame: int = CODES_PER_FRAME
    start_of_human: int = 128259
    end_of_text: int = 128009
    end_of_human: int = 128260
    start_of_ai: int = 128261
    start_of_speech: int = 128257
    end_of_speech: int = 128258

    FILENAME = "codec_layout.json"

    @property
    def audio_token_end(self) -> int:
        """One past the last audio token id."""
        return self.audio_token_offset + self.codes_per_frame * self.codebook_size

    def audio_token_ids(self) -> list[int]:
        """Every audio token id (for SamplingParams.allowed_token_ids)."""
        return list(range(self.audio_token_offset, self.audio_token_end))

    def is_audio(self, token_id: int) -> bool:
        return self.audio_token_offset <= token_id < self.audio_token_end

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    def save(self, model_dir: str | Path) -> Path:
        path = Path(model_dir) / self.FILENAME
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, model_dir: str | Path) -> CodecLayout:
        """Read `codec_layout.json` from the talker dir; Orpheus defaults when absent."""
        path = Path(model_dir) / cls.FILENAME
        if not path.is_file():
            return cls()
        raw: dict[str, Any] = json.loads(path.read_text())
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"{path}: unknown codec layout keys {sorted(unknown)}")
        return cls(**{k: int(v) for k, v in raw.items()})


def orpheus_prompt_ids(
    tokenizer: Any, text: str, layout: CodecLayout, voice: str | None = None
) -> list[int]:
    """Orpheus prompt: [SOH] + tok(f"{voice}: {text}") + [EOT, EOH, SOA, SOS].

    `tokenizer` is any HF-style tokenizer (``encode(str) -> list[int]``); it adds BOS
    itself where the checkpoint's tokenizer does (Llama 3 / the tiny one both do).
    """
    body = f"{voice}: {text}" if voice else text
    ids = list(tokenizer.encode(body))
    return [
        layout.start_of_human,
        *ids,
        layout.end_of_text,
        layout.end_of_human,
        layout.start_of_ai,
        layout.start_of_speech,
    ]


# --------------------------------------------------------------------------- tokens


def tokens_to_codes(token_ids: Iterable[int], layout: CodecLayout) -> list[int]:
    """Audio token ids -> codes, dropping every non-audio id.

    ``code = (tok - offset) % codebook_size`` equals Orpheus's
    ``tok - offset - slot * codebook_size`` for a token in its expected slot, and maps
    any audio token (even one sampled in the "wrong" slot) to a valid code.
    """
    lo, hi, cb = layout.audio_token_offset, layout.audio_token_end, layout.codebook_size
    return [(t - lo) % cb for t in token_ids if lo <= t < hi]


def tokens_to_frames(token_ids: Sequence[int], layout: CodecLayout) -> tuple[np.ndarray, int]:
    """Generated ids -> (frames int64 [F, 7], number of leftover trailing codes)."""
    codes = tokens_to_codes(token_ids, layout)
    n = layout.codes_per_frame
    full = len(codes) // n
    frames = np.asarray(codes[: full * n], dtype=np.int64).reshape(full, n)
    return frames, len(codes) - full * n


class FrameAssembler:
    """Streams generated token ids into complete frames, keeping the partial one.

    ``push(ids)`` returns int64 ``[k, 7]`` (k may be 0). Non-audio ids are ignored, so
    control tokens in the stream never shift the frame phase.
    """

    def __init__(self, layout: CodecLayout) -> None:
        self.layout = layout
        self._pending: list[int] = []
        self.frames_emitted = 0

    @property
    def pending(self) -> int:
        """Codes held back waiting for their frame to complete."""
        return len(self._pending)

    def push(self, token_ids: Iterable[int]) -> np.ndarray:
        self._pending.extend(tokens_to_codes(token_ids, self.layout))
        n = self.layout.codes_per_frame
        full = len(self._pending) // n
        frames = np.asarray(self._pending[: full * n], dtype=np.int64).reshape(full, n)
        del self._pending[: full * n]
        self.frames_emitted += full
        return frames

    def reset(self) -> None:
        self._pending.clear()
        self.frames_emitted = 0


def frames_to_codes(frames: np.ndarray) -> list[torch.Tensor]:
    """Frames ``[F, 7]`` (or ``[B, F, 7]``) -> SNAC codes ``[B,F]``, ``[B,2F]``, ``[B,4F]`` (int64)."""
    arr = np.asarray(frames)
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3 or arr.shape[-1] != CODES_PER_FRAME:
        raise ValueError(f"frames must be [F, 7] or [B, F, 7], got shape {np.shape(frames)}")
    b, f, _ = arr.shape
    arr = arr.astype(np.int64, copy=False)
    levels = [np.empty((b, f * span), dtype=np.int64) for span in _LEVEL_SPAN]
    for slot, (level, off) in enumerate(_SLOT_TO_LEVEL):
        span = _LEVEL_SPAN[level]
        levels[level][:, off::span] = arr[:, :, slot]
    return [torch.from_numpy(level) for level in levels]


def codes_to_frames(codes: Sequence[torch.Tensor]) -> np.ndarray:
    """Inverse of `frames_to_codes` (``[B, F, 7]``); handy for tests and encoders."""
    levels = [c.detach().cpu().numpy().astype(np.int64) for c in codes]
    b, f = levels[0].shape
    out = np.empty((b, f, CODES_PER_FRAME), dtype=np.int64)
    for slot, (level, off) in enumerate(_SLOT_TO_LEVEL):
        out[:, :, slot] = levels[level][:, off :: _LEVEL_SPAN[level]]
    return out


# --------------------------------------------------------------------------- model


def _disable_noise(model: torch.nn.Module) -> int:
    """Replace SNAC NoiseBlocks by identities; returns how many were replaced.

    SNAC's decoder adds ``randn * linear(x)`` after each upsampling (the 24 kHz release
    ships with noise=True). That makes decoding non-deterministic, which would break
    "chunked output == batch output" (docs/design.md, invariant 6), so by default we drop it
    after loading the weights (the noise weights still load; they just go unused).
    """
    from snac.layers import NoiseBlock  # local: snac is only needed by code2wav

    replaced = 0
    for module in list(model.modules()):
        if isinstance(module, torch.nn.Sequential):
            for i, child in enumerate(module):
                if isinstance(child, NoiseBlock):
                    module[i] = torch.nn.Identity()
                    replaced += 1
    return replaced


def load_snac(model_dir: str | Path, *, deterministic: bool = True) -> Any:
    """Load a SNAC model from a LOCAL HF-layout dir (config.json + weights); never the hub.

    Weights: ``pytorch_model.bin`` (the layout of the hubertsiuzdak/snac_* repos) or
    ``model.safetensors``. Returns the model in eval mode with requires_grad False.
    ``deterministic`` removes the decoder noise blocks (see `_disable_noise`).
    """
    from snac import SNAC

    root = Path(model_dir)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found (SNAC needs a local model dir)")
    config = json.loads(config_path.read_text())
    model = SNAC(**config)
    st_path, bin_path = root / "model.safetensors", root / "pytorch_model.bin"
    if st_path.is_file():
        from safetensors.torch import load_file

        state = load_file(str(st_path), device="cpu")
    elif bin_path.is_file():
        # weights_only: never unpickle arbitrary objects from a model dir.
        state = torch.load(str(bin_path), map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin in {root}")
    # Older checkpoints store weight_norm as weight_g/weight_v; torch's parametrized
    # weight_norm registers a load hook that converts them, so strict loading works.
    model.load_state_dict(state, strict=True)
    if deterministic:
        _disable_noise(model)
    _fold_weight_norm(model)
    model.eval()
    model.requires_grad_(False)
    return model


def _fold_weight_norm(model: torch.nn.Module) -> None:
    """Bake each weight-normed layer's weight into a plain tensor: the parametrization
    recomputes `g * v / |v|` on every forward (~6 % of a decode on CPU), for a weight
    that never changes at inference."""
    from torch.nn.utils import parametrize

    for m in model.modules():
        if parametrize.is_parametrized(m, "weight"):
            parametrize.remove_parametrizations(m, "weight", leave_parametrized=True)


def decode_window(model: Any, frames: np.ndarray) -> np.ndarray:
    """Decode frames ``[F, 7]`` or ``[B, F, 7]`` -> float32 PCM ``[B, F * 2048]``."""
    codes = frames_to_codes(frames)
    device = next(model.parameters()).device
    with torch.inference_mode():
        audio = model.decode([c.to(device) for c in codes])
    # decoder output is [B, 1, T]
    return audio[:, 0, :].float().cpu().numpy()
