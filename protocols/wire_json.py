"""The one JSON reader of every wire (HTTP bodies, WebSocket events, multipart fields).

Whatever a client sends, the answer is a value or `ClientError(code="invalid_json")`
(400 on HTTP, an `error` event on the event sockets), never an unexpected exception:
- not JSON, not UTF-8, numbers Python will not convert (over 4,300 digits), nesting
  deeper than the parser's recursion limit;
- `NaN` / `Infinity` (not JSON, though Python's parser takes them);
- nesting deeper than `MAX_DEPTH` (no wire needs it; code downstream would recurse);
- strings with a lone surrogate (`"\\ud800"`: valid JSON escapes, but not text: they
  cannot be encoded, tokenized or sent back), reported with the field they are in.

The last two are checked by a walk that runs only when the raw text could hold them
(many brackets, a `\\ud8`-`\\udf` escape), so ordinary events cost one C-speed scan.
"""

from __future__ import annotations

import json
import re
from typing import Any

from omni_rt.errors import ClientError

MAX_DEPTH = 64
_SURROGATE_ESCAPE = re.compile(r"\\[uU][dD][89a-fA-F]")


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def load_json(raw: str | bytes | bytearray, what: str = "The event") -> Any:
    """`raw` parsed, or the `invalid_json` error (`what` names the thing in it)."""
    try:
        # bytes are decoded strictly here: json.loads would let UTF-8-encoded surrogates through
        text = raw if isinstance(raw, str) else bytes(raw).decode("utf-8")
        value = json.loads(text, parse_constant=_constant)
    except RecursionError:
        raise ClientError(f"{what} is nested too deeply (at most {MAX_DEPTH} levels).", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError; so are numbers too long to convert
        raise ClientError(f"{what} is not valid JSON: {exc}", code="invalid_json") from None
    if text.count("[") + text.count("{") > MAX_DEPTH or _SURROGATE_ESCAPE.search(text):  # a str from a socket is valid text but for escapes
        _check(value, what)
    return value


def _check(value: Any, what: str) -> None:
    """Depth and lone surrogates, iteratively (a deep value must not recurse here)."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        v, path = stack.pop()
        if len(path) > MAX_DEPTH:
            raise ClientError(f"{what} is nested too deeply (at most {MAX_DEPTH} levels).", code="invalid_json")
        if isinstance(v, str):
            _text(v, path)
        elif isinstance(v, dict):
            for k, x in v.items():
                _text(k, (*path, k))
                stack.append((x, (*path, k)))
        elif isinstance(v, list):
            stack.extend((x, (*path, i)) for i, x in enumerate(v))


def _text(s: str, path: tuple[str | int, ...]) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        param = _param(path)
        raise ClientError(
            f"Invalid value{f' for {param!r}' if param else ''}: the string holds a lone UTF-16 surrogate (e.g. \\ud800), which is not text.",
            code="invalid_value",
            param=param,
        ) from None


def _param(path: tuple[str | int, ...]) -> str | None:
    out = ""
    for p in path:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            p = p.encode("utf-8", "backslashreplace").decode()
            out += f".{p}" if out else p
    return out or None
