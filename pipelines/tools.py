"""Function calling in a chat stage (the voice pipeline's thinker, the cascade's chat LM),
on vLLM's own machinery, chosen per stage as vLLM's server chooses it:

* the tool-call parser (`processor_args.tool_parser`, vLLM's `--tool-call-parser`):
  `hermes` for the Qwen2 / Qwen2.5 / Qwen2.5-Omni / Qwen3 families, `llama3_json` for
  Llama 3.x, ... (`default_parser`); vLLM's `ParserManager` composes it and each
  request gets its own instance, which turns the streamed text into content and
  tool-call deltas;
* structured outputs: the parser's `adjust_request` gives the request its grammar
  (an xgrammar structural tag in the model's own call format). `tool_strict_level`
  (vLLM's `--tool-strict-level`) defaults to `parameter`: every call's arguments
  are held to its tool's JSON schema, with `tool_choice: auto` too, so even a random
  model makes calls whose arguments parse and validate; `required` and a named
  function force a call. Every call the grammar lets a model write parses back as
  itself (`json_grammar`): its strings are JSON strings (xgrammar compiles a string with
  `minLength` / `maxLength` to a rule that admits raw control characters, which JSON
  forbids and strict parsers refuse) and hold no call marker (the parser ends a call at
  `</tool_call>` even inside a string).

Requests carry `params["tools"]` (OpenAI chat shape: `{"type": "function", "function":
{name, description, parameters}}`), `params["tool_choice"]` (`auto`, `none`,
`required`, `{"type": "function", "function": {"name"}}`) and
`params["parallel_tool_calls"]`. A stage streams content as TEXT payloads and
each piece of a call as a TEXT payload without text whose `meta["tool_call"]` is
`{index, id?, name?, arguments}` (id and name on the call's first piece), the way
OpenAI streams `delta.tool_calls`; talkers see no text in them and say nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from omni_rt.stage import StageError

# config.json model_type -> vLLM's tool-call parser for the family
FAMILY_PARSERS = {
    "qwen2": "hermes",
    "qwen2_5_omni": "hermes",
    "qwen2_5_omni_thinker": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "qwen3_omni_moe": "hermes",
    "qwen2_audio": "hermes",
    "llama": "llama3_json",
    "mistral": "mistral",
    "voxtral": "mistral",
}
STRICT_LEVELS = ("auto", "function", "parameter")
# Families whose chat template takes one call per assistant turn (Llama 3.x raises on
# more, so a history with two would fail the next turn): parallel calls are off unless
# the request asks for them.
SINGLE_CALL_PARSERS = frozenset({"llama3_json"})
# Consecutive whitespace allowed inside a call's JSON (the grammar's max_whitespace_cnt):
# models write compact JSON; unbounded, a weak model can fill its token budget with it.
DEFAULT_MAX_WHITESPACE = 2


def default_parser(model_type: str | None) -> str:
    return FAMILY_PARSERS.get(model_type or "", "hermes")


def is_tool_request(params: Mapping[str, Any]) -> bool:
    return bool(params.get("tools")) and params.get("tool_choice", "auto") != "none"


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates take them: a call's arguments as an object (the
    templates `tojson` them), as vLLM's server hands them over."""
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args) if args.strip() else {}
                    except ValueError:
                        pass  # not JSON: the template gets the string
                calls.append({**c, "function": fn})
            m["tool_calls"] = calls
        out.append(m)
    return out


def json_strings(schema: Any, forbid: str = "") -> Any:
    r"""`schema` with every length-bounded string rewritten to a `pattern` of the same
    bounds over characters JSON admits unescaped (no control characters) and not in
    `forbid` (the first characters of the parser's call markers: `marker_starts`).

    Why: xgrammar (0.2.x, vLLM's default backend) compiles a string with `minLength` /
    `maxLength` to `[^"\\\r\n]{m,n}`, which admits the control characters U+0000..U+001F
    other than CR / LF (a tab, \x01, ...), so a call's arguments may not parse with a
    strict JSON parser (Python's `json.loads`). A `pattern` is compiled as a JSON
    string (controls excluded) and its `{m,n}` counts characters, so the bounds hold.
    Like the rule it replaces, it writes no escapes (no quote or backslash inside)."""
    if isinstance(schema, list):
        return [json_strings(v, forbid) for v in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: json_strings(v, forbid) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and not any(k in out for k in ("pattern", "enum", "const", "format")):
        lo = int(out.pop("minLength", 0) or 0)
        hi = out.pop("maxLength", None)
        bound = "" if hi is None else str(int(hi))
        out["pattern"] = f"^[^\\x00-\\x1f{re.escape(forbid)}]{{{lo},{bound}}}$"
    return out


def marker_starts(markers: Sequence[str]) -> str:
    """The characters a call marker starts with (what a `pattern` string may not hold)."""
    return "".join(sorted({m[0] for m in markers if m}))


def json_grammar(tag: Any, markers: Sequence[str]) -> Any:
    """A structural tag whose JSON can always be read back as the call it is: every
    length-bounded string as `json_strings` writes it, and no string holding one of the
    parser's call markers (`markers`, e.g. hermes' `</tool_call>`): the parser ends a
    call at its end marker's text wherever it stands, so a marker inside a string cut
    the arguments short. xgrammar keeps `excludes` out of a format's free strings;
    a `pattern` string ignores them, so it may not start a marker at all."""
    tag = json_strings(tag, marker_starts(markers))

    def exclude(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node and markers:
                node["excludes"] = sorted({*(node.get("excludes") or []), *markers})
            for v in node.values():
                exclude(v)
        elif isinstance(node, list):
            for v in node:
                exclude(v)

    exclude(tag)
    return tag


def _cap_whitespace(node: Any, limit: int) -> None:
    """Every JSON-schema format in a structural tag gets `max_whitespace_cnt`."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and "json_schema" in node and node.get("max_whitespace_cnt") is None:
            node["max_whitespace_cnt"] = limit
        for v in node.values():
            _cap_whitespace(v, limit)
    elif isinstance(node, list):
        for v in node:
            _cap_whitespace(v, limit)


@dataclass
class ToolStream:
    """One request's parser: text deltas in, content and call deltas out."""

    parser: Any
    request: Any  # vLLM's ChatCompletionRequest (tools, tool_choice), after adjust_request
    structured_outputs: dict[str, Any] | None
    forced: bool  # required or a named function: the grammar allows nothing but calls
    calls: dict[int, str] = field(default_factory=dict)  # the parser's call index -> the call's id

    def feed(self, text: str, token_ids: Sequence[int], finished: bool = False) -> list[tuple[str, Any]]:
        """("text", str) and ("call", {index, id?, name?, arguments}) pieces."""
        # prompt_token_ids: given, the parser checks it for an open reasoning block (none
        # here: without a reasoning parser the answer is content and calls from the start)
        delta = self.parser.parse_delta(text, list(token_ids), self.request, [], finished=finished)
        out: list[tuple[str, Any]] = []
        if delta is None:
            return out
        if delta.content:
            out.append(("text", delta.content))
        for tc in delta.tool_calls or []:
            fn = tc.function
            if fn is not None and not isinstance(fn, Mapping):  # vLLM's DeltaFunctionCall (some parsers hand over its dump)
                fn = fn.model_dump(exclude_none=True)
            fn = fn or {}
            piece: dict[str, Any] = {"index": int(tc.index), "arguments": fn.get("arguments") or ""}
            if tc.index not in self.calls:
                self.calls[tc.index] = piece["id"] = tc.id or f"call_{len(self.calls)}"
                piece["name"] = fn.get("name") or ""
            if piece["arguments"] or "id" in piece:
                out.append(("call", piece))
        return out


class ToolCalling:
    """A stage's tool calling: its parser class, strictness and grammar settings."""

    def __init__(self, tokenizer: Any, parser_name: str, strict_level: str = "parameter", max_whitespace: int | None = DEFAULT_MAX_WHITESPACE) -> None:
        from vllm.parser.parser_manager import ParserManager

        if strict_level not in STRICT_LEVELS:
            raise StageError(f"tool_strict_level {strict_level!r}: use one of {', '.join(STRICT_LEVELS)}")
        self.tokenizer = tokenizer
        self.parser_name = parser_name
        self.max_whitespace = max_whitespace
        try:
            self.parser_cls = ParserManager.get_parser(
                tool_parser_name=parser_name, enable_auto_tools=True, tool_strict_level=strict_level, tokenizer=tokenizer
            )
        except (TypeError, KeyError, ValueError) as exc:
            raise StageError(f"tool_parser {parser_name!r}: {exc}") from exc
        assert self.parser_cls is not None
        probe = self.parser_cls(tokenizer, None).tool_parser
        # the parser's marker tokens (e.g. <tool_call>, </tool_call>): a stage that
        # masks control tokens lets these through when tools are on
        self.marker_ids = sorted(
            {int(v) for k, v in vars(probe).items() if k.endswith("token_id") and isinstance(v, int) and v >= 0}
            | {int(i) for k, v in vars(probe).items() if k.endswith("token_ids") and isinstance(v, list) for i in v if isinstance(i, int)}
        )
        for attr in ("tool_call_start_token", "tool_call_end_token", "bot_token"):
            tok = getattr(probe, attr, None)
            if isinstance(tok, str) and tok in tokenizer.get_vocab():
                self.marker_ids = sorted({*self.marker_ids, int(tokenizer.convert_tokens_to_ids(tok))})
        # the text that ends a call for the parser: never inside a call's strings (json_grammar)
        end = getattr(probe, "tool_call_end_token", None)
        self.markers: list[str] = [end] if isinstance(end, str) and end else []

    def stream(self, params: Mapping[str, Any]) -> ToolStream:
        """The parser and grammar of one request with tools."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        choice = params.get("tool_choice", "auto")
        try:
            # the parser reads only tools and tool_choice; the prompt is rendered by the stage
            req = ChatCompletionRequest(
                model="-", messages=[{"role": "user", "content": ""}], tools=list(params["tools"]), tool_choice=choice,
                parallel_tool_calls=params.get("parallel_tool_calls", self.parser_name not in SINGLE_CALL_PARSERS),
            )
            parser = self.parser_cls(self.tokenizer, req.tools)
            req = parser.adjust_request(req)
        except (ValueError, TypeError) as exc:
            raise StageError(f"tools refused: {exc}") from exc
        so = req.structured_outputs
        structured: dict[str, Any] | None = None
        if so is not None:
            structured = {k: v for k, v in (("json", so.json), ("structural_tag", so.structural_tag)) if v is not None}
            if structured.get("structural_tag"):
                tag = json_grammar(json.loads(structured["structural_tag"]), self.markers)
                if self.max_whitespace is not None:
                    _cap_whitespace(tag, self.max_whitespace)
                structured["structural_tag"] = json.dumps(tag)
            if structured.get("json") is not None:
                schema = structured["json"]
                forbid = marker_starts(self.markers)
                structured["json"] = json.dumps(json_strings(json.loads(schema), forbid)) if isinstance(schema, str) else json_strings(schema, forbid)
        return ToolStream(parser, req, structured or None, forced=choice != "auto")
