"""Mutations: JSON values json.dumps cannot write (5000-digit integers, deep nesting, lone
surrogates, duplicate keys) and the mutators over seed messages and raw bytes."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

SCHEMA = "omni-rt.latency_bench.fuzz/1"
EXAMPLES_PER_KIND = 3
PAYLOAD_REPR = 240

# ---- JSON text with values json.dumps cannot write ------------------------------------------


class Raw:
    """A JSON fragment written as is (a 5000-digit integer, NaN, a lone-surrogate escape,
    1000-level nesting, an object with duplicate keys)."""

    def __init__(self, text: str, what: str) -> None:
        self.text = text
        self.what = what

    def __repr__(self) -> str:
        return f"<{self.what}>"


class Dup(list):
    """An object written from (key, value) pairs, so keys may repeat."""


def dumps(obj: Any) -> str:
    if isinstance(obj, Raw):
        return obj.text
    if isinstance(obj, Dup):
        return "{" + ",".join(f"{json.dumps(str(k))}:{dumps(v)}" for k, v in obj) + "}"
    if isinstance(obj, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{dumps(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(dumps(v) for v in obj) + "]"
    if isinstance(obj, float) and obj != obj:
        return "NaN"
    return json.dumps(obj)


HUGE_INT = Raw("1" + "0" * 5000, "int of 5001 digits")
DEEP_ARRAY = Raw("[" * 1000 + "]" * 1000, "1000-level array")
DEEP_OBJECT = Raw('{"a":' * 1000 + "1" + "}" * 1000, "1000-level object")
SURROGATE = Raw('"\\ud800"', "lone surrogate \\ud800")
SURROGATE_LOW = Raw('"ab\\udfffcd"', "lone surrogate \\udfff")


def weird_values(rng: random.Random) -> Any:
    choices: list[Any] = [
        None, True, False, 0, -1, -(2**63), 2**64, 1.5, -0.0, "",
        HUGE_INT, Raw("-" + "9" * 5000, "negative int of 5000 digits"), Raw("4" * 4000, "int of 4000 digits"),
        Raw("1e999", "1e999 (inf)"), Raw("-1e999", "-1e999"), Raw("NaN", "NaN literal"),
        Raw("Infinity", "Infinity literal"), Raw("-Infinity", "-Infinity literal"), Raw("1e-400", "1e-400"),
        SURROGATE, SURROGATE_LOW, "x" * rng.choice((300, 5000, 70000)), "\u0000", "\U0001f4a5" * 50, "\u202e\ufeff",
        {}, [], {"a": {"b": [1, {"c": None}]}}, [None, 1, "a"], [[[[]]]], {"type": "x"},
        "not base64 !!", "AAA", "../../etc/passwd", "%s%n", "1", "null", "true",
        DEEP_ARRAY, DEEP_OBJECT,
    ]
    return rng.choice(choices)


# ---- mutators -------------------------------------------------------------------------------


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


def _get(obj: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def _set(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    _get(obj, path[:-1])[path[-1]] = value
    return obj


@dataclass
class Mutant:
    data: str | bytes  # what goes on the wire
    how: str  # the mutators applied
    frame: str = "text"  # websockets: "text", "binary" or "text_bytes" (a text frame of raw, maybe invalid, bytes)

    def short(self) -> str:
        r = repr(self.data)
        return r if len(r) <= PAYLOAD_REPR else r[: PAYLOAD_REPR - 20] + f"…(+{len(r) - PAYLOAD_REPR + 20} chars)"


def _structural(rng: random.Random, seed: Any, unknown_types: Iterable[str]) -> tuple[Any, str]:
    obj = copy.deepcopy(seed)
    hows: list[str] = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        paths = _paths(obj)
        path = rng.choice(paths)
        where = ".".join(map(str, path)) or "<root>"
        r = rng.random()
        parent = _get(obj, path[:-1]) if path else None
        if r < 0.18 and path and isinstance(parent, dict):
            del parent[path[-1]]
            hows.append(f"drop {where}")
        elif r < 0.70:
            v = weird_values(rng)
            obj = _set(obj, path, v)
            hows.append(f"{where}={v!r:.40}")
        elif r < 0.78 and isinstance(_get(obj, path), dict):
            v = weird_values(rng)
            _get(obj, path)[rng.choice(("zz_unknown", "type", "id", "__proto__", ""))] = v
            hows.append(f"add key in {where}={v!r:.40}")
        elif r < 0.84:
            v = _get(obj, path)
            obj = _set(obj, path, rng.choice(([v], {"value": v}, [v, v])))
            hows.append(f"wrap {where}")
        elif r < 0.92 and isinstance(obj, dict) and "type" in obj:
            obj["type"] = rng.choice([*unknown_types, "", "x" * 2000, "Session.Update", "response.create ", "error"])
            hows.append(f"type={obj['type']!r:.40}")
        elif r < 0.97 and isinstance(obj, dict):
            d = Dup(obj.items())
            k = rng.choice(list(obj) or ["type"])
            d.append((k, weird_values(rng)))
            if rng.random() < 0.5:
                d.insert(0, (k, weird_values(rng)))
            hows.append(f"duplicate key {k!r}")
            return d, "; ".join(hows)
        else:
            obj = rng.choice((DEEP_ARRAY, DEEP_OBJECT, [obj], "a string", 12, None, []))
            hows.append(f"root={obj!r:.40}")
            return obj, "; ".join(hows)
        if not isinstance(obj, (dict, list)):
            break
    return obj, "; ".join(hows) or "none"


def _bytes_mutation(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    r = rng.random()
    if r < 0.3 and len(data) > 1:
        cut = rng.randrange(1, len(data))
        return data[:cut], f"truncate at {cut}/{len(data)}"
    if r < 0.6:
        b = bytearray(data)
        n = rng.choice((1, 2, 4, 8))
        for _ in range(n):
            if b:
                b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b), f"flip {n} bytes"
    if r < 0.8:
        bad = rng.choice((b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80", b"\xfe\xfe"))
        i = rng.randrange(len(data) + 1)
        return data[:i] + bad + data[i:], f"invalid UTF-8 {bad!r} at {i}"
    if r < 0.9:
        return bytes(rng.randrange(256) for _ in range(rng.choice((0, 1, 7, 64, 1000)))), "random bytes"
    return data + rng.choice((b"}", b"]", b",", b"garbage", b"\x00", b" {}")), "trailing junk"


def mutate_json(rng: random.Random, seeds: list[Any], unknown_types: Iterable[str] = ("fuzz.nope",)) -> Mutant:
    seed = rng.choice(seeds)
    r = rng.random()
    if r < 0.72:
        obj, how = _structural(rng, seed, unknown_types)
        return Mutant(dumps(obj), how)
    text = dumps(seed).encode()
    if r < 0.78:
        return Mutant(text, "seed as a binary frame", "binary")
    data, how = _bytes_mutation(rng, text)
    try:
        return Mutant(data.decode("utf-8"), how)
    except UnicodeDecodeError:
        return Mutant(data, how, rng.choice(("binary", "text_bytes")))
