"""Responses delegation for Live sessions (`delegation: {type: "responses", responses:
{model, instructions?, tools?, tool_choice?, max_output_tokens?}}`): when the talking
model hands a task off, this server runs it on its own chat LM — the voice pipeline's
thinker, in a one-shot session of its own (admitted like a chat completion) — with the
session's function tools, and streams what the Responses API streams, each wrapped in
`response.event {event, delegation_id}`: `response.created`, `response.output_item.added`,
`response.output_text.delta` / `.done`, `response.function_call_arguments.delta` /
`.done`, `response.output_item.done`, `response.completed` (or `response.failed`).

A run that calls functions waits for the app: `response.item.create {item:
{type: function_call_output, call_id, output}}` (or a user message) adds to the
delegation's input, `response.create` runs it again. A run that ends in text is the
task's outcome: the talking model gets it (its `delegate` call's output) and speaks it.
`responses.model` is echoed; the task always runs on this pipeline's thinker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omni_rt.errors import ClientError, OmniError
from protocols.chat import Answer
from protocols.realtime.items import new_id
from protocols.tools import parse_tool_choice, parse_tools

if TYPE_CHECKING:
    from protocols.live import LiveSession

log = logging.getLogger("protocols.live")

DEFAULT_MAX_OUTPUT_TOKENS = 512


def parse_config(raw: Any, param: str) -> dict[str, Any]:
    """`delegation.responses`, checked (tools in the Responses / Live function shape)."""
    if not isinstance(raw, Mapping):
        raise ClientError(f"Missing required parameter: '{param}'.", code="missing_required_parameter", param=param)
    known = {"model", "instructions", "tools", "tool_choice", "max_output_tokens", "parallel_tool_calls"}
    for key in raw:
        if key not in known:
            raise ClientError(f"'{param}.{key}' is not served here; a delegated task takes {', '.join(sorted(known))}.",
                              code="unsupported_value", param=f"{param}.{key}")
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        raise ClientError(f"Missing required parameter: '{param}.model'.", code="missing_required_parameter", param=f"{param}.model")
    instructions = raw.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ClientError(f"'{param}.instructions' must be a string.", code="invalid_type", param=f"{param}.instructions")
    if raw.get("tools") is not None and not isinstance(raw.get("tools"), list):
        raise ClientError(f"'{param}.tools' must be an array.", code="invalid_type", param=f"{param}.tools")
    for i, t in enumerate(raw.get("tools") or []):
        if not isinstance(t, Mapping) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, Mapping) else t
            raise ClientError(f"Tool type {kind!r} is not run here; delegated tasks take function tools.", code="unsupported_value",
                              param=f"{param}.tools[{i}].type")
    tools = parse_tools(raw.get("tools"), f"{param}.tools", nested=False)
    choice = parse_tool_choice(raw.get("tool_choice"), tools, f"{param}.tool_choice", nested=False)
    limit = raw.get("max_output_tokens", DEFAULT_MAX_OUTPUT_TOKENS)
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 32768:
        raise ClientError(f"'{param}.max_output_tokens' must be an integer from 1 to 32768.", code="invalid_value",
                          param=f"{param}.max_output_tokens")
    return {"model": model, "instructions": instructions or "", "tools": [dict(t) for t in raw.get("tools") or []],
            "chat_tools": list(tools), "tool_choice": choice, "max_output_tokens": limit,
            "parallel_tool_calls": raw.get("parallel_tool_calls") is not False}


@dataclass
class Delegation:
    id: str
    messages: list[dict[str, Any]]
    pending: set[str] = field(default_factory=set)  # call ids the app has not answered yet
    runs: int = 0


class ResponsesBackend:
    """One Live session's delegated tasks on this server's chat LM."""

    def __init__(self, live: LiveSession, sessions: Any, pipeline: Any, principal: str, config: dict[str, Any]) -> None:
        self.live, self.sessions, self.pipeline, self.principal = live, sessions, pipeline, principal
        self.config = config
        self.waiting: dict[str, Delegation] = {}  # delegation id -> one whose run ended in calls (in order)
        self.tasks: set[asyncio.Task[None]] = set()

    def start(self, did: str, task: str) -> str:
        """The talking model delegated `task`: its first run starts (returns its response id)."""
        messages = ([{"role": "system", "content": self.config["instructions"]}] if self.config["instructions"] else []) + [
            {"role": "user", "content": task}]
        return self._run(Delegation(did, messages))

    def item_create(self, item: Any, cid: str | None) -> None:
        if not self.waiting:
            raise ClientError("No delegated response is waiting for input.", code="no_pending_response", param="item")
        if not isinstance(item, Mapping):
            raise ClientError("Missing required parameter: 'item'.", code="missing_required_parameter", param="item")
        if item.get("type") == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            d = next((x for x in self.waiting.values() if isinstance(call_id, str) and call_id in x.pending), None)
            if d is None:
                raise ClientError(f"No function call {str(call_id)[:64]!r} is waiting for its output.", code="invalid_value", param="item.call_id")
            if not isinstance(output, str):
                output = json.dumps(output)
            d.pending.discard(str(call_id))
            d.messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif item.get("type", "message") == "message" and item.get("role") in ("user", "developer", "system"):
            content = item.get("content")
            if isinstance(content, str):
                text = content
            elif isinstance(content, list):
                text = " ".join(str(c.get("text", "")) for c in content if isinstance(c, Mapping))
            else:
                raise ClientError("'item.content' must be a string or an array of parts.", code="invalid_type", param="item.content")
            d = list(self.waiting.values())[-1]  # the latest delegation that waits
            d.messages.append({"role": "user" if item["role"] == "user" else "system", "content": text})
        else:
            raise ClientError("'item' must be a function_call_output or a user / developer message.", code="invalid_value", param="item.type")

    def create(self) -> list[str]:
        """Run again every waiting delegation whose calls all have their outputs."""
        if not self.waiting:
            raise ClientError("No delegated response is waiting for tool results.", code="no_pending_response", param="type")
        ready = [d for d in self.waiting.values() if not d.pending]
        if not ready:
            missing = sorted(c for d in self.waiting.values() for c in d.pending)
            raise ClientError(f"Function call(s) {missing} have no output yet; send response.item.create first.",
                              code="missing_tool_output", param="type")
        for d in ready:
            del self.waiting[d.id]
        return [self._run(d) for d in ready]

    def _run(self, d: Delegation) -> str:
        rid = new_id("resp")
        task = asyncio.get_running_loop().create_task(self._stream(d, rid))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return rid

    async def close(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    # ---- one run, as the Responses API streams it ------------------------------------------
    async def _stream(self, d: Delegation, rid: str) -> None:
        d.runs += 1
        seq = 0
        created = int(time.time())

        def send(event: dict[str, Any]) -> None:
            nonlocal seq
            seq += 1
            self.live.emit("response.event", event={**event, "sequence_number": seq}, delegation_id=d.id)

        def snapshot(status: str, output: list[dict[str, Any]] | None = None, usage: Any = None, error: Any = None) -> dict[str, Any]:
            # lifecycle snapshots carry no input, instructions or tools (Live keeps them small)
            return {"id": rid, "object": "response", "created_at": created, "status": status, "model": self.config["model"],
                    "output": output or [], "usage": usage, "error": error}

        send({"type": "response.created", "response": snapshot("in_progress")})
        cfg = self.config
        # tool_choice holds for the delegation's first run; once tool results are in, the model may answer
        choice = cfg["tool_choice"] if d.runs == 1 else "auto"
        params: dict[str, Any] = {"messages": d.messages, "max_output_tokens": cfg["max_output_tokens"]}
        if cfg["chat_tools"]:
            params.update(tools=cfg["chat_tools"], tool_choice=choice, parallel_tool_calls=cfg["parallel_tool_calls"])
        answer = Answer()
        items: dict[int, dict[str, Any]] = {}  # call index -> its function_call item
        message: dict[str, Any] | None = None
        output: list[dict[str, Any]] = []
        usage: dict[str, Any] = {}
        try:
            await self.sessions.rate_limits.check(self.principal, "tokens")
            session = await self.sessions.open("oneshot", self.pipeline.name, principal=self.principal)
            try:
                stream = session.submit(params, outputs={"thinker"}, entry="thinker")
                stream.end_input()
                async for _, p, _ in stream.payloads():
                    piece = answer.add(p)
                    if piece is not None:
                        i = int(piece["index"])
                        if i not in items:
                            item = items[i] = {"type": "function_call", "id": new_id("fc"), "call_id": str(piece.get("id") or new_id("call")),
                                               "name": str(piece.get("name") or ""), "arguments": "", "status": "in_progress"}
                            output.append(item)
                            send({"type": "response.output_item.added", "output_index": len(output) - 1, "item": dict(item)})
                        item = items[i]
                        delta = str(piece.get("arguments") or "")
                        item["arguments"] += delta
                        if delta:
                            send({"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": output.index(item),
                                  "delta": delta})
                    elif p.text:
                        if message is None:
                            message = {"type": "message", "id": new_id("msg"), "role": "assistant", "status": "in_progress", "content": []}
                            output.append(message)
                            send({"type": "response.output_item.added", "output_index": len(output) - 1, "item": dict(message, content=[])})
                            send({"type": "response.content_part.added", "item_id": message["id"], "output_index": output.index(message),
                                  "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}})
                        send({"type": "response.output_text.delta", "item_id": message["id"], "output_index": output.index(message),
                              "content_index": 0, "delta": p.text, "logprobs": []})
                u = dict(stream.done.usage) if stream.done is not None else {}
                usage = {"input_tokens": int(u.get("input_tokens", 0)), "output_tokens": int(u.get("output_tokens", 0)),
                         "total_tokens": int(u.get("input_tokens", 0)) + int(u.get("output_tokens", 0))}
                self.sessions.charge_soon(self.principal, "tokens", usage["total_tokens"])
            finally:
                await self.sessions.end(session, "completed")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the task failed; the talking model is told, the session goes on
            oe = exc if isinstance(exc, OmniError) else None
            if oe is None:
                log.exception("live session %s: delegated task %s failed", self.live.session.id, d.id)
            else:
                log.warning("live session %s: delegated task %s failed: %s", self.live.session.id, d.id, exc)
            why = oe.public_message() if oe is not None else "internal error"
            send({"type": "response.failed", "response": snapshot("failed", error={"code": (oe.code if oe else None) or "server_error",
                                                                                    "message": why})})
            await self.live.delegated_outcome(d.id, f"The task could not be done ({why}).")
            return
        if message is not None:
            message["status"] = "completed"
            message["content"] = [{"type": "output_text", "text": answer.text, "annotations": []}]
            i = output.index(message)
            send({"type": "response.output_text.done", "item_id": message["id"], "output_index": i, "content_index": 0, "text": answer.text,
                  "logprobs": []})
            send({"type": "response.content_part.done", "item_id": message["id"], "output_index": i, "content_index": 0,
                  "part": message["content"][0]})
            send({"type": "response.output_item.done", "output_index": i, "item": message})
        for item in items.values():
            item["status"] = "completed"
            i = output.index(item)
            send({"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": i, "arguments": item["arguments"]})
            send({"type": "response.output_item.done", "output_index": i, "item": item})
        status = "incomplete" if answer.reason == "length" and not items else "completed"
        send({"type": f"response.{status}", "response": snapshot(status, None, usage)})
        if items:  # the app runs the functions: the delegation waits for their outputs
            d.messages.append({"role": "assistant", "content": answer.text, "tool_calls": [
                {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}} for it in items.values()]})
            d.pending = {it["call_id"] for it in items.values()}
            self.waiting[d.id] = d
            return
        await self.live.delegated_outcome(d.id, answer.text.strip() or "Done.")
