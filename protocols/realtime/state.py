"""A conversation as state that moves with its session to another node (a drain):
its config and its items (text, transcripts, function calls and their outputs, what
was heard of each answer). The encoded speech of the latest utterance does not move:
the thinker hears each earlier turn by its transcript, as it does after the next
utterance anyway."""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import TYPE_CHECKING, Any

from media.wire_audio import WireFormat
from protocols.realtime.items import Item
from protocols.realtime.models import Config, Truncation, TurnDetection

if TYPE_CHECKING:
    from protocols.realtime.conversation import Conversation

_ITEM_FIELDS = tuple(f.name for f in fields(Item) if f.name != "speech")
_CONFIG_FIELDS = frozenset(f.name for f in fields(Config))
_TD_FIELDS = frozenset(f.name for f in fields(TurnDetection))


def conversation_state(conv: Conversation) -> dict[str, Any]:
    return {
        "config": asdict(conv.cfg),
        "items": [{k: getattr(it, k) for k in _ITEM_FIELDS} for it in conv.items.values()],
    }


def config_of(raw: Any) -> Config:
    """A Config from its moved form; ValueError on fields this release does not have."""
    if not isinstance(raw, dict) or set(raw) - _CONFIG_FIELDS:
        raise ValueError(f"conversation config fields {sorted(set(raw) - _CONFIG_FIELDS) if isinstance(raw, dict) else raw!r} are unknown here")
    td = raw.get("turn_detection")
    if td is not None and (not isinstance(td, dict) or set(td) - _TD_FIELDS):
        raise ValueError("turn_detection does not match this release")
    formats: dict[str, Any] = {}
    for key in ("input_format", "output_format"):
        f = raw.get(key)
        if f is not None:
            if not isinstance(f, dict) or f.get("encoding") not in ("pcm16", "pcmu", "pcma") or not isinstance(f.get("rate"), int):
                raise ValueError(f"{key} {f!r} does not match this release")
            formats[key] = WireFormat(f["encoding"], f["rate"])
    tr = raw.get("truncation")
    if tr is not None:
        if not isinstance(tr, dict) or set(tr) - {f.name for f in fields(Truncation)}:
            raise ValueError(f"truncation {tr!r} does not match this release")
        formats["truncation"] = Truncation(**tr)
    return Config(**{**raw, "turn_detection": TurnDetection(**td) if td is not None else None, "tools": tuple(raw.get("tools") or ()), **formats})


def items_of(raw: Any) -> dict[str, Item]:
    if not isinstance(raw, list):
        raise ValueError("conversation items must be a list")
    out: dict[str, Item] = {}
    for row in raw:
        if not isinstance(row, dict) or set(row) - set(_ITEM_FIELDS) or not isinstance(row.get("id"), str):
            raise ValueError("a conversation item does not match this release")
        out[row["id"]] = Item(**row)
    return out
