"""msgpack-numpy as openpi encodes it (`openpi_client.msgpack_numpy`), strict.

Arrays are maps with **bytes** keys `{__ndarray__, data, dtype, shape}`, numpy scalars
`{__npgeneric__, data, dtype}`; object, void, complex and string dtypes are refused;
decoded arrays are read-only views. Containers are bounded (an observation is a few
maps of arrays, never millions of items), and every malformed frame is a
`ProtocolError` whose message goes to the client as is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from omni_rt.errors import ClientError

MAX_NDIM = 8
MAX_DEPTH = 8
MAX_LIST_ITEMS = 65536
MAX_MAP_ITEMS = 4096


class ProtocolError(ClientError):
    """Bad input from the client; the message goes to it verbatim."""

    code = "bad_request"


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind in ("V", "O", "c"):
        raise TypeError(f"unsupported dtype {obj.dtype}")
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": np.ascontiguousarray(obj).tobytes(), b"dtype": obj.dtype.str, b"shape": obj.shape}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot encode {type(obj).__name__}")


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_pack_default)


def _dtype(raw: Any) -> np.dtype:
    if not isinstance(raw, str):
        raise ProtocolError(f"array dtype must be a string like '<f4', got {type(raw).__name__}")
    try:
        dt = np.dtype(raw)
    except (TypeError, ValueError, SyntaxError):
        raise ProtocolError(f"unknown array dtype {raw!r}") from None
    if dt.kind in ("V", "O", "c") or dt.kind not in "biuf":
        raise ProtocolError(f"array dtype {raw!r} is not accepted (object, void, complex and string arrays are refused)")
    return dt


def _unpack_hook(obj: dict[Any, Any]) -> Any:
    if b"__ndarray__" in obj:
        dt = _dtype(obj.get(b"dtype"))
        shape, data = obj.get(b"shape"), obj.get(b"data")
        if not isinstance(data, bytes):
            raise ProtocolError("array data must be msgpack bin (bytes)")
        if not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ProtocolError(f"array shape must be a list of at most {MAX_NDIM} non-negative ints, got {shape!r}")
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if count * dt.itemsize != len(data):
            raise ProtocolError(f"array of shape {list(shape)} and dtype {dt.str} needs {count * dt.itemsize} bytes, got {len(data)}")
        arr = np.frombuffer(data, dtype=dt).reshape(shape)
        return arr if dt.isnative else arr.astype(dt.newbyteorder("="))
    if b"__npgeneric__" in obj:
        dt = _dtype(obj.get(b"dtype"))
        try:
            return dt.type(obj.get(b"data"))
        except (TypeError, ValueError, OverflowError):
            raise ProtocolError(f"numpy scalar {obj.get(b'data')!r} does not fit dtype {dt.str}") from None
    if "__ndarray__" in obj or "__npgeneric__" in obj:
        raise ProtocolError("array maps need bytes keys (b'__ndarray__', b'data', b'dtype', b'shape') as openpi encodes them; got str keys")
    return obj


def unpackb(data: bytes) -> Any:
    try:
        # bounded containers: an observation is a few maps of arrays, never millions of items
        return msgpack.unpackb(data, object_hook=_unpack_hook, raw=False, strict_map_key=True,
                               max_array_len=MAX_LIST_ITEMS, max_map_len=MAX_MAP_ITEMS)
    except ProtocolError:
        raise
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ProtocolError(f"frame is not one msgpack message: {exc}") from None
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"frame is not valid msgpack for this protocol: {exc}") from None


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
