"""The OpenPI wire's frames: msgpack-numpy as openpi encodes it (the codec itself is
`media.msgpack_numpy`, shared with the standalone client), every malformed frame a
`ProtocolError` whose message goes to the client as is, and observations flattened to
arrays and strings by key path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from media import msgpack_numpy
from media.msgpack_numpy import packb
from omni_rt.errors import ClientError

__all__ = ["ProtocolError", "flatten", "packb", "unpackb"]

MAX_DEPTH = 8


class ProtocolError(ClientError):
    """Bad input from the client; the message goes to it verbatim."""

    code = "bad_request"


def unpackb(data: bytes) -> Any:
    """One observation frame, or `ProtocolError` saying what was wrong with it."""
    try:
        return msgpack_numpy.unpackb(data)
    except msgpack_numpy.CodecError as exc:
        raise ProtocolError(str(exc)) from None


def flatten(obs: Mapping[Any, Any]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A (nested) observation -> arrays and strings by '/'-joined key path."""
    arrays: dict[str, np.ndarray] = {}
    texts: dict[str, str] = {}

    def walk(node: Mapping[Any, Any], prefix: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise ProtocolError(f"observation nests deeper than {MAX_DEPTH} maps")
        for key, value in node.items():
            if not isinstance(key, str):
                raise ProtocolError(f"observation keys are strings; got {type(key).__name__} key {key!r}")
            path = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, path + "/", depth + 1)
            elif isinstance(value, str):
                texts[path] = value
            elif isinstance(value, np.ndarray):
                arrays[path] = value
            elif isinstance(value, (bool, int, float, np.generic, list, tuple)):
                try:
                    arr = np.asarray(value)
                except (ValueError, OverflowError):
                    raise ProtocolError(f"observation {path!r}: not a numeric array") from None
                if arr.dtype.kind not in "biuf":
                    raise ProtocolError(f"observation {path!r}: not a numeric array (dtype {arr.dtype})")
                arrays[path] = arr
            elif value is None:
                continue
            else:
                raise ProtocolError(f"observation {path!r}: unsupported value of type {type(value).__name__}")

    walk(obs, "", 0)
    return arrays, texts
