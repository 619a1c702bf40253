"""Function tools as the wires take them, validated at the edge.

The Realtime API's tools are flat (`{type: "function", name, description, parameters}`),
the chat API's nested (`{type: "function", function: {name, description, parameters,
strict}}`); both become the chat shape the chat stages take (`pipelines.tools`).
`tool_choice` is `auto`, `none`, `required` or a named function (`{type: "function",
name}` on the Realtime API, `{type: "function", function: {name}}` on chat).

Limits (each refused with the param that broke it): at most `MAX_TOOLS` tools, names
of 1-64 characters `[A-Za-z0-9_-]` (OpenAI's rule), unique; `parameters` a JSON schema
(checked with `jsonschema` against its own metaschema) of type object, at most
`MAX_SCHEMA_CHARS` characters as JSON; descriptions up to `MAX_DESCRIPTION_CHARS`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from omni_rt.errors import ClientError

MAX_TOOLS = 64
MAX_SCHEMA_CHARS = 16384
MAX_DESCRIPTION_CHARS = 4096
MAX_OUTPUT_CHARS = 65536  # a function call's result given back
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CHOICES = ("auto", "none", "required")


def _schema(raw: Any, param: str) -> dict[str, Any]:
    import jsonschema

    if raw is None:
        return {"type": "object", "properties": {}}
    if not isinstance(raw, Mapping):
        raise ClientError(f"'{param}' must be a JSON schema object.", code="invalid_type", param=param)
    try:
        size = len(json.dumps(raw))
    except (TypeError, ValueError):
        raise ClientError(f"'{param}' is not JSON.", param=param) from None
    if size > MAX_SCHEMA_CHARS:
        raise ClientError(f"'{param}' is {size} characters as JSON; at most {MAX_SCHEMA_CHARS} are served.", param=param)
    try:
        jsonschema.validators.validator_for(raw, default=jsonschema.Draft202012Validator).check_schema(raw)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise ClientError(f"'{param}' is not a valid JSON schema: {exc.message}" + (f" (at {where})" if where else ""), param=param) from None
    if raw.get("type", "object") != "object":
        raise ClientError(f"'{param}' must describe an object (type 'object'); got type {raw.get('type')!r}.", param=param)
    return dict(raw)


def _tool(raw: Any, param: str, nested: bool) -> dict[str, Any]:
    if not isinstance(raw, Mapping):
        raise ClientError(f"'{param}' must be an object.", code="invalid_type", param=param)
    if raw.get("type", "function") != "function":
        raise ClientError(f"Tool type {raw.get('type')!r} is not served; use 'function'.", param=f"{param}.type")
    fn: Any = raw.get("function") if nested else raw
    fparam = f"{param}.function" if nested else param
    if not isinstance(fn, Mapping):
        raise ClientError(f"Missing required parameter: '{fparam}'.", code="missing_required_parameter", param=fparam)
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise ClientError(f"'{fparam}.name' must be 1-64 characters of a-z, A-Z, 0-9, '_' and '-'; got {name!r}.", param=f"{fparam}.name")
    desc = fn.get("description")
    if desc is not None and (not isinstance(desc, str) or len(desc) > MAX_DESCRIPTION_CHARS):
        raise ClientError(f"'{fparam}.description' must be a string of at most {MAX_DESCRIPTION_CHARS} characters.", param=f"{fparam}.description")
    out: dict[str, Any] = {"name": name, "parameters": _schema(fn.get("parameters"), f"{fparam}.parameters")}
    if desc is not None:
        out["description"] = desc
    if isinstance(fn.get("strict"), bool):
        out["strict"] = fn["strict"]
    return {"type": "function", "function": out}


def parse_tools(raw: Any, param: str, nested: bool) -> tuple[dict[str, Any], ...]:
    """A wire's tool list in the chat shape (`nested`: the chat API's own)."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ClientError(f"'{param}' must be an array.", code="invalid_type", param=param)
    if len(raw) > MAX_TOOLS:
        raise ClientError(f"'{param}': {len(raw)} tools; at most {MAX_TOOLS} are served.", param=param)
    tools = tuple(_tool(t, f"{param}[{i}]", nested) for i, t in enumerate(raw))
    seen: set[str] = set()
    for i, t in enumerate(tools):
        name = t["function"]["name"]
        if name in seen:
            raise ClientError(f"Duplicate tool name {name!r}; tool names must be unique.", param=f"{param}[{i}].name" if not nested else f"{param}[{i}].function.name")
        seen.add(name)
    return tools


def parse_tool_choice(raw: Any, tools: Sequence[Mapping[str, Any]], param: str, nested: bool) -> str | dict[str, Any]:
    """`tool_choice` as the chat stages take it; a named function must be among `tools`."""
    if raw is None:
        return "auto"
    if isinstance(raw, str):
        if raw not in CHOICES:
            raise ClientError(f"Invalid value for '{param}': {raw!r}; use auto, none, required or a function.", param=param)
        if raw == "required" and not tools and nested:
            # chat refuses it, as OpenAI's does; a Realtime session may set its choice
            # before its tools (pipecat does): there a response without tools answers
            raise ClientError(f"'{param}' is 'required' but no tools are given.", param=param)
        return raw
    if not isinstance(raw, Mapping) or raw.get("type") != "function":
        raise ClientError(f"'{param}' must be auto, none, required or {{\"type\": \"function\", ...}}.", param=param)
    fn = raw.get("function") if nested else raw
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        where = f"{param}.function.name" if nested else f"{param}.name"
        raise ClientError(f"Missing required parameter: '{where}'.", code="missing_required_parameter", param=where)
    if name not in {t["function"]["name"] for t in tools}:
        raise ClientError(f"'{param}' names the function {name!r}, which is not among the tools.", param=param)
    return {"type": "function", "function": {"name": name}}


def realtime_tools_wire(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Tools as the Realtime API shows them (flat)."""
    out = []
    for t in tools:
        fn = t["function"]
        out.append({"type": "function", "name": fn["name"], "description": fn.get("description", ""), "parameters": fn["parameters"]})
    return out


def realtime_choice_wire(choice: str | Mapping[str, Any]) -> Any:
    return choice if isinstance(choice, str) else {"type": "function", "name": choice["function"]["name"]}
