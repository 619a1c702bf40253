"""Typed payloads, fences and the small handles that travel through control queues.

A `Payload` carries bytes (numpy arrays, text). A `Handle` names a payload stored in a
connector; only handles cross the orchestrator. Every payload and every handle carries
the `Fence` of the turn that produced it so stale work can be dropped at every hop.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omni_rt.errors import ClientError

# Arrays that may cross a connector. Object, void and complex dtypes are refused:
# they cannot be shared as flat memory and would let arbitrary Python objects through.
ALLOWED_DTYPES = frozenset(
    np.dtype(t).str
    for t in (
        np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32,
        np.int64, np.uint64, np.float16, np.float32, np.float64,
    )
)


class PayloadError(ClientError):
    """A payload that cannot be carried (bad dtype, wrong type)."""


class PayloadKind(str, enum.Enum):
    TEXT = "text"
    TOKENS = "tokens"
    HIDDEN = "hidden"  # hidden states / embeddings
    CODES = "codes"  # codec codes, [frames, codes_per_frame]
    AUDIO = "audio"  # PCM float32 mono, meta["sample_rate"]
    KV = "kv"  # paged KV blocks
    LATENTS = "latents"
    IMAGE = "image"
    ACTIONS = "actions"
    OBSERVATION = "observation"  # a robot's observation: named arrays, strings in meta["text"]


# Keys of a chat stage's TEXT payloads that carry no text (pipelines.tools): a piece of a
# function call {index, id?, name?, arguments} (OpenAI's delta.tool_calls), and why the
# answer ended ("stop", "length", "tool_calls"), the stage's last payload.
TOOL_CALL = "tool_call"
FINISH_REASON = "finish_reason"
# A thinker's first payload when its talker conditions on the thinker's own states
# (pipelines.omni): no text; arrays `prompt_ids` (and `audio`, 16 kHz, when the user spoke;
# `pixel_values` and `image_grid_thw`, the thinker's processor's, when the prompt has images).
TALKER_PROMPT = "talker_prompt"
# Stages whose outputs are an answer's speech (AUDIO payloads), by profile: the split
# talker's SNAC decoder, Qwen2.5-Omni's token2wav or Qwen3-Omni's code2wav.
# Where the user's utterance goes in a conversation message's text: the thinker puts
# the utterance's audio (or its embeddings, or its transcript) there.
AUDIO_PLACEHOLDER = "<|audio|>"
# Where an image goes in a message's text; the request's `images` (data URLs) fill these
# in order (media.images).
IMAGE_PLACEHOLDER = "<|image|>"
SPEECH_STAGES = frozenset({"code2wav", "token2wav", "omni_code2wav"})


@dataclass(frozen=True, slots=True)
class Fence:
    """Identifies the turn a piece of work belongs to.

    `epoch` advances on cancel / barge-in / clear; `turn` advances per request in a
    session. Work whose epoch is older than the session's current epoch is stale.
    """

    session_id: str
    epoch: int = 0
    turn: int = 0

    def is_stale_against(self, current: Fence) -> bool:
        return self.session_id == current.session_id and self.epoch < current.epoch


@dataclass(slots=True)
class Payload:
    """What a stage produces or consumes.

    `arrays` holds named numpy arrays (the bytes a connector moves); `text` is optional
    text; `meta` holds small JSON-like values (sample rate, frame offsets, flags).
    """

    kind: PayloadKind
    fence: Fence
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    text: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, arr in self.arrays.items():
            if not isinstance(arr, np.ndarray):
                raise PayloadError(f"payload array {name!r} is {type(arr).__name__}, not numpy.ndarray")
            if arr.dtype.str not in ALLOWED_DTYPES:
                raise PayloadError(f"payload array {name!r} has dtype {arr.dtype} which may not cross a connector")

    @property
    def nbytes(self) -> int:
        n = sum(int(a.nbytes) for a in self.arrays.values())
        if self.text is not None:
            n += len(self.text.encode())
        return n


@dataclass(frozen=True, slots=True)
class Handle:
    """A reference to a payload held by a connector. Small, immutable, cheap to route."""

    connector: str
    request_id: str
    key: str
    kind: PayloadKind
    fence: Fence
    nbytes: int
    readers: int = 1
    # Backend-specific locator (e.g. a Ray object reference). Opaque to
    # everyone but the connector that made the handle.
    locator: Mapping[str, Any] | None = field(default=None, hash=False, compare=False)
