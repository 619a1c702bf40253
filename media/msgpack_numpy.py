"""msgpack-numpy as openpi encodes it (`openpi_client.msgpack_numpy`): the one codec
the OpenPI wire (server side, `protocols.openpi.codec`) and the standalone client
(`clients.openpi`) share.

Arrays are maps with **bytes** keys `{__ndarray__, data, dtype, shape}`, numpy scalars
`{__npgeneric__, data, dtype}`; object, void, complex and string dtypes are refused in
both directions; decoded arrays are read-only views (byte-swapped copies when the
sender's order is not native). Containers are bounded (an observation is a few maps of
arrays, never millions of items), and every malformed frame is a `CodecError` that
says what was wrong.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

__all__ = ["MAX_LIST_ITEMS", "MAX_MAP_ITEMS", "MAX_NDIM", "CodecError", "packb", "unpackb"]

MAX_NDIM = 8
MAX_LIST_ITEMS = 65536
MAX_MAP_ITEMS = 4096
_REFUSED_KINDS = ("V", "O", "c")


class CodecError(ValueError):
    """A frame that is not msgpack-numpy as openpi encodes it; the message says why."""


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind in _REFUSED_KINDS:
        raise TypeError(f"unsupported dtype {obj.dtype}")
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": np.ascontiguousarray(obj).tobytes(), b"dtype": obj.dtype.str, b"shape": obj.shape}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot encode {type(obj).__name__}")


def packb(obj: Any) -> bytes:
    """Encode `obj` (maps, lists, strings, numbers, numpy arrays and scalars)."""
    return msgpack.packb(obj, default=_pack_default)


def _dtype(raw: Any) -> np.dtype:
    if not isinstance(raw, str):
        raise CodecError(f"array dtype must be a string like '<f4', got {type(raw).__name__}")
    try:
        dt = np.dtype(raw)
    except (TypeError, ValueError, SyntaxError):
        raise CodecError(f"unknown array dtype {raw!r}") from None
    if dt.kind in _REFUSED_KINDS or dt.kind not in "biuf":
        raise CodecError(f"array dtype {raw!r} is not accepted (object, void, complex and string arrays are refused)")
    return dt


def _unpack_hook(obj: dict[Any, Any]) -> Any:
    if b"__ndarray__" in obj:
        dt = _dtype(obj.get(b"dtype"))
        shape, data = obj.get(b"shape"), obj.get(b"data")
        if not isinstance(data, bytes):
            raise CodecError("array data must be msgpack bin (bytes)")
        if not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CodecError(f"array shape must be a list of at most {MAX_NDIM} non-negative ints, got {shape!r}")
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if count * dt.itemsize != len(data):
            raise CodecError(f"array of shape {list(shape)} and dtype {dt.str} needs {count * dt.itemsize} bytes, got {len(data)}")
        arr = np.frombuffer(data, dtype=dt).reshape(shape)
        return arr if dt.isnative else arr.astype(dt.newbyteorder("="))
    if b"__npgeneric__" in obj:
        dt = _dtype(obj.get(b"dtype"))
        try:
            return dt.type(obj.get(b"data"))
        except (TypeError, ValueError, OverflowError):
            raise CodecError(f"numpy scalar {obj.get(b'data')!r} does not fit dtype {dt.str}") from None
    if "__ndarray__" in obj or "__npgeneric__" in obj:
        raise CodecError("array maps need bytes keys (b'__ndarray__', b'data', b'dtype', b'shape') as openpi encodes them; got str keys")
    return obj


def unpackb(data: bytes) -> Any:
    """Decode one msgpack-numpy message, or raise `CodecError`."""
    try:
        return msgpack.unpackb(data, object_hook=_unpack_hook, raw=False, strict_map_key=True,
                               max_array_len=MAX_LIST_ITEMS, max_map_len=MAX_MAP_ITEMS)
    except CodecError:
        raise
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise CodecError(f"frame is not one msgpack message: {exc}") from None
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise CodecError(f"frame is not valid msgpack for this protocol: {exc}") from None
