"""The conversation's pieces: items (messages) and responses, and the event names of
the two dialects."""

from __future__ import annotations

import asyncio
import base64
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from omni_rt.payloads import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, Payload
from omni_rt.request import RequestStream

# beta name -> GA name, for the events whose names differ
GA_NAMES = {
    "response.audio.delta": "response.output_audio.delta",
    "response.audio.done": "response.output_audio.done",
    "response.audio_transcript.delta": "response.output_audio_transcript.delta",
    "response.audio_transcript.done": "response.output_audio_transcript.done",
    "response.text.delta": "response.output_text.delta",
    "response.text.done": "response.output_text.done",
    "conversation.item.created": "conversation.item.added",
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


def wire_data(data: Mapping[str, Any]) -> dict[str, Any]:
    """Event data for a JSON wire: audio bytes become base64."""
    return {k: base64.b64encode(v).decode() if isinstance(v, (bytes, bytearray)) else v for k, v in data.items()}


@dataclass
class Item:
    id: str
    role: str
    content: list[dict[str, Any]]
    status: str = "completed"
    speech: asyncio.Future[list[Payload]] | None = None  # user audio as the thinker takes it (the latest utterance only)
    audio_ms: int = 0  # assistant audio produced
    transcript: str = ""  # assistant text / transcript
    type: str = "message"  # | "function_call" | "function_call_output"
    call_id: str = ""  # function_call, function_call_output
    name: str = ""  # function_call
    arguments: str = ""  # function_call: JSON text
    output: str = ""  # function_call_output

    def wire(self, ga: bool) -> dict[str, Any]:
        base = {"id": self.id, "object": "realtime.item", "type": self.type, "status": self.status}
        if self.type == "function_call":
            return {**base, "call_id": self.call_id, "name": self.name, "arguments": self.arguments}
        if self.type == "function_call_output":
            return {**base, "call_id": self.call_id, "output": self.output}
        content = []
        for c in self.content:
            c = dict(c)
            if not ga and c.get("type") in ("output_audio", "output_text"):
                c["type"] = "audio" if c["type"] == "output_audio" else "text"
            content.append(c)
        return {"id": self.id, "object": "realtime.item", "type": "message", "role": self.role, "status": self.status, "content": content}

    def text_for_prompt(self) -> str:
        parts = []
        for c in self.content:
            t = c.get("type")
            if t in ("input_text", "text", "output_text"):
                parts.append(c.get("text") or "")
            elif t == "input_audio":
                # The item whose encoded speech goes to the thinker marks its place with
                # the placeholder (the embeddings are spliced in there), even when the
                # client also gave a transcript; older audio turns show their transcript.
                parts.append(AUDIO_PLACEHOLDER if self.speech is not None else c.get("transcript") or AUDIO_PLACEHOLDER)
            elif t in ("output_audio", "audio"):
                parts.append(c.get("transcript") or "")
            elif t == "input_image":  # the request's images fill these in order
                parts.append(IMAGE_PLACEHOLDER)
        return " ".join(p for p in parts if p)

    def images(self) -> list[str]:
        """The item's images (data URLs), in the order of their placeholders."""
        return [str(c["image_url"]) for c in self.content if c.get("type") == "input_image"]


@dataclass
class Response:
    id: str
    item: Item
    audio_out: bool
    stream: RequestStream | None = None
    task: asyncio.Task[None] | None = None
    cancel_reason: str | None = None
    started: float = field(default_factory=time.monotonic)
    epoch: int = 0
    metadata: dict[str, str] | None = None  # response.create's, echoed on response.created / .done
    outputs: list[Item] = field(default_factory=list)  # in output_index order: the message (once it says something), calls
    calls: dict[int, Item] = field(default_factory=dict)  # the thinker's call index -> its function_call item
    open_call: Item | None = None  # the call whose arguments are streaming
    finish: str | None = None  # the thinker's finish_reason
    message_index: int = 0  # the message's output_index (it comes first when it says anything)
    message_added: bool = False
    forced: bool = False  # tool_choice required or a named function
    instructions: str = ""  # what the prompt was rendered with
    submit: Callable[[], RequestStream] | None = None  # the request again (after the conversation was fitted to the context)
    first_audio_at: float | None = None  # the input audio timeline (ms) when its first audio went out
    prompt_chars: int = 0  # the rendered conversation's size when it was last submitted (tokens per character, from usage)

    @property
    def ids(self) -> dict[str, Any]:
        """The fields every content event of this response's message carries."""
        return {"response_id": self.id, "item_id": self.item.id, "output_index": self.message_index, "content_index": 0}
