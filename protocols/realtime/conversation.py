"""One realtime conversation, independent of its transport.

The conversation (items, the encoded embeddings of the latest utterance, what the
user heard of each answer) lives in the session, so it survives a reconnect. Client
events come in through `handle`; everything the conversation says goes out as session
events (`emit`), which the transport's writer puts on its wire, and answer audio goes
to the transport's `AudioOutput`. A transport (`Transport`) plugs in its output, its
own client events and session keys; it never subclasses the conversation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, Literal, Protocol

import numpy as np
from pydantic import Field

from media.images import ImageError, check_data_url
from media.wire_audio import WireFormat
from omni_rt import metrics
from omni_rt.errors import ClientError, OmniError
from omni_rt.payloads import IMAGE_PLACEHOLDER, Payload
from omni_rt.specs import PipelineSpec
from protocols.errors import error_event
from protocols.realtime.inputs import InputAudio, decode_audio
from protocols.realtime.items import GA_NAMES, Item, new_id
from protocols.realtime.models import AUTO_RETAIN, DEFAULT_TRANSCRIPTION, Config, WireModel, apply_session_update, parse
from protocols.realtime.output import AudioOutput, EventOutput
from protocols.realtime.responses import Responses
from protocols.realtime.vad import VadFactory, silero_vad
from protocols.tools import MAX_OUTPUT_CHARS, MAX_SCHEMA_CHARS
from protocols.wire_json import load_json
from sessions import Session, SessionManager

log = logging.getLogger("protocols.realtime")


class Transport(Protocol):
    """What a wire plugs into a conversation."""

    tag_epochs: bool  # response.* events carry the epoch their response ran under

    @property
    def output(self) -> AudioOutput: ...

    def update_session(self, conv: Conversation, body: Any) -> Config:
        """A session.update body applied to `conv.cfg` (the wire's own keys included)."""
        ...

    def session_wire(self, conv: Conversation) -> dict[str, Any]: ...

    async def on_event(self, conv: Conversation, type: str, ev: dict[str, Any], event_id: str | None) -> bool:
        """The wire's own client events; True when `type` was one of them."""
        ...


class WebSocketTransport:
    """`/v1/realtime`: audio as events, the client truncates what it did not play."""

    tag_epochs = False

    def __init__(self, conv_emit: Any, fmt: Callable[[], WireFormat] | None = None) -> None:
        self.output: AudioOutput = EventOutput(conv_emit, fmt=fmt)

    def update_session(self, conv: Conversation, body: Any) -> Config:
        return apply_session_update(conv.cfg, body, conv.pipeline.voices)

    def session_wire(self, conv: Conversation) -> dict[str, Any]:
        return conv.cfg.wire(conv.ga, conv.session.id)

    async def on_event(self, conv: Conversation, type: str, ev: dict[str, Any], event_id: str | None) -> bool:
        return False


class ContentIn(WireModel):
    type: str
    text: str | None = None
    audio: str | None = None
    transcript: str | None = None
    image_url: str | None = None
    detail: Literal["auto", "low", "high"] | None = None


class ItemIn(WireModel):
    id: str | None = None
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system"]
    content: list[ContentIn] = Field(min_length=1)


class FunctionCallIn(WireModel):
    """A call the client puts in the history (e.g. replaying a conversation)."""

    id: str | None = None
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=128)
    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(max_length=MAX_SCHEMA_CHARS)


class FunctionCallOutputIn(WireModel):
    """The result of a call the model made, for the next response to answer."""

    id: str | None = None
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=128)
    output: str = Field(max_length=MAX_OUTPUT_CHARS)


class Conversation:
    def __init__(
        self,
        session: Session,
        sessions: SessionManager,
        pipeline: PipelineSpec,
        *,
        ga: bool,
        model: str,
        transport: Transport | None = None,
        vad: VadFactory = silero_vad,
    ) -> None:
        self.session = session
        self.sessions = sessions
        self.pipeline = pipeline
        self.ga = ga
        self.cfg = Config(model=model)
        self.vad = vad
        self.transport: Transport = transport if transport is not None else WebSocketTransport(self.emit, lambda: self.cfg.output_format)
        self.items: dict[str, Item] = {}  # the conversation's history, in order
        self.tokens_per_char = 0.3  # learned from the thinker's counts (a prompt's usage, a refusal)
        self.context_limit: int | None = None  # the thinker's context, once a refusal named it
        self.input = InputAudio(self)
        self.responses = Responses(self)
        session.keep(self)

    # ---- output --------------------------------------------------------------------------
    def emit(self, type: str, fence: Any = None, **data: Any) -> None:
        if self.transport.tag_epochs and type.startswith("response."):
            resp = self.responses.active
            rid = data.get("response_id") or (data.get("response") or {}).get("id")
            data["epoch"] = resp.epoch if resp is not None and resp.id == rid else self.session.epoch
        self.session.emit(GA_NAMES.get(type, type) if self.ga else type, data, fence=fence)

    def error(self, err: OmniError, event_id: str | None = None) -> None:
        """A bad (or refused) client event: an `error` event; the socket stays open."""
        self.session.emit("error", {"error": error_event(err, event_id)["error"]})

    # ---- the conversation ----------------------------------------------------------------
    def last_item_id(self) -> str | None:
        return next(reversed(self.items), None)

    def add_item(self, item: Item, done: bool = True, speech: Any = None) -> None:
        """Append to the conversation. GA clients also get `conversation.item.done`
        (right away for finished items; for a response's item when it finishes).
        `speech`: the item's speech as the thinker takes it (a future of payloads:
        its audio, embeddings or transcript), which becomes what prompts hear (only
        the latest utterance's is kept)."""
        if speech is not None:
            for it in self.items.values():
                it.speech = None
            item.speech = speech
        prev = self.last_item_id()
        self.items[item.id] = item
        self.emit("conversation.item.created", previous_item_id=prev, item=item.wire(self.ga))
        if self.ga and done:
            self.emit("conversation.item.done", previous_item_id=prev, item=item.wire(self.ga))

    def prompt(self, instructions: str) -> dict[str, Any]:
        """A response's prompt params: `messages`, and `images` (data URLs) for their
        image placeholders. A thinker takes at most `Session.image_limit` images a
        prompt: older ones are left out of it (as older turns' audio is), the latest kept."""
        msgs = self.messages(instructions)
        images = [u for it in self.items.values() if it.type == "message" for u in it.images()]
        extra = len(images) - self.session.image_limit()[0]
        if extra > 0:
            images = images[extra:]
            for m in msgs:
                while extra > 0 and IMAGE_PLACEHOLDER in m["content"]:
                    head, tail = m["content"].split(IMAGE_PLACEHOLDER, 1)
                    m["content"] = " ".join(p for p in (head.rstrip(), tail.lstrip()) if p)
                    extra -= 1
        return {"messages": msgs, "images": images} if images else {"messages": msgs}

    def messages(self, instructions: str) -> list[dict[str, Any]]:
        """The conversation as chat messages: function calls join the assistant turn
        they belong to (`tool_calls`), their results are `tool` messages."""
        msgs: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
        calls: dict[str, str] = {}  # call_id -> name
        for it in self.items.values():
            if it.type == "function_call":
                calls[it.call_id] = it.name
                call = {"id": it.call_id, "type": "function", "function": {"name": it.name, "arguments": it.arguments}}
                last = msgs[-1] if msgs else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif it.type == "function_call_output":
                msgs.append({"role": "tool", "content": it.output, "tool_call_id": it.call_id, "name": calls.get(it.call_id, "")})
            else:
                text = it.text_for_prompt()
                if text:
                    msgs.append({"role": it.role if it.role in ("user", "assistant", "system") else "user", "content": text})
        return msgs

    # ---- truncation: the conversation within the thinker's context --------------------------
    def _prompt_chars(self, it: Item) -> int:
        if it.type == "function_call":
            return len(it.name) + len(it.arguments) + 16
        if it.type == "function_call_output":
            return len(it.output) + 16
        return len(it.text_for_prompt()) + 8

    def prompt_chars(self, instructions: str) -> int:
        return len(instructions) + sum(self._prompt_chars(it) for it in self.items.values())

    def learn_tokens(self, input_tokens: int, chars: int) -> None:
        """A prompt's size as the thinker counted it (a response's usage) over its size
        in characters: the tokens a character of this conversation costs, for estimates
        before the next prompt."""
        if input_tokens > 0 and chars > 0:
            self.tokens_per_char = input_tokens / chars

    def fit(self, instructions: str, tokens: int | None = None, limit: int | None = None) -> list[str]:
        """Drop the oldest whole turns (a turn starts at a user message; function calls
        stay with their outputs; the latest user turn and the utterance whose speech the
        thinker hears are always kept) so the prompt fits the session's truncation:
        after a prompt of `tokens` was refused by a context of `limit`, or, before a
        prompt, when its estimate passes what the context (learned from an earlier
        refusal) or `post_instructions` allows. The dropped items leave the
        conversation (`conversation.item.deleted` each). Returns their ids (none: it
        fits, truncation is disabled, or no whole turn can go)."""
        t = self.cfg.truncation
        if t.type == "disabled":
            return []
        if limit is not None:
            self.context_limit = limit
        items = list(self.items.values())
        chars = [self._prompt_chars(it) for it in items]
        total = self.prompt_chars(instructions)
        per_char = tokens / total if tokens else self.tokens_per_char
        if tokens:
            self.tokens_per_char = per_char
        now = tokens if tokens else total * per_char
        fixed = len(instructions) * per_char  # instructions (and tools) are never dropped
        budgets = []
        if self.context_limit is not None:
            keep = AUTO_RETAIN if t.type == "auto" else t.ratio
            budgets.append((now > self.context_limit * 0.98 or tokens is not None, self.context_limit * keep))
        if t.type == "retention_ratio" and t.post_instructions is not None:
            budgets.append((now - fixed > t.post_instructions, fixed + t.post_instructions * t.ratio))
        due = [b for over, b in budgets if over]
        if not due:
            return []
        target = min(due)
        # the turns that may go: up to (not including) the latest user message, and not
        # past the item whose speech the thinker hears
        users = [i for i, it in enumerate(items) if it.type == "message" and it.role == "user"]
        speech = next((i for i, it in enumerate(items) if it.speech is not None), len(items))
        stop = min(users[-1] if users else 0, speech)
        cut, dropped_tokens = 0, 0.0
        for k in users:
            if k == 0 or k > stop:
                continue
            cut, dropped_tokens = k, sum(chars[:k]) * per_char
            if now - dropped_tokens <= target:
                break
        if cut == 0:
            return []
        gone = [it.id for it in items[:cut]]
        for item_id in gone:
            del self.items[item_id]
            self.emit("conversation.item.deleted", item_id=item_id)
        metrics.REALTIME_TRUNCATIONS.inc()
        return gone

    async def latest_speech(self) -> list[Payload]:
        """The speech of the latest utterance (the thinker puts it at its placeholder)."""
        for it in reversed(self.items.values()):
            if it.speech is not None:
                try:
                    return list(await it.speech)
                except Exception:  # noqa: BLE001 - answer without the audio rather than not at all
                    return []
        return []

    def truncate(self, item: Item, end_ms: int, content_index: int = 0) -> None:
        """History keeps what the user heard: the transcript up to `end_ms` of the
        answer's audio (clamped to what was sent)."""
        end = min(end_ms, item.audio_ms)
        full = item.transcript
        keep = full if item.audio_ms == 0 else full[: round(len(full) * end / item.audio_ms)]
        for c in item.content:
            if c.get("type") in ("output_audio", "audio"):
                c["transcript"] = keep
        self.emit("conversation.item.truncated", item_id=item.id, content_index=content_index, audio_end_ms=end)

    async def interrupt(self, reason: str) -> bool:
        """Barge-in or cancel: stop the audio that plays and the answer being made, and
        keep in history only what was heard of every answer that was cut. True when an
        answer was being made."""
        cut = self.transport.output.clear()  # before the epoch advance: no await in between
        cancelled = await self.responses.cancel(reason)
        for item_id, heard in cut.items():
            item = self.items.get(item_id)
            if item is not None:
                self.truncate(item, heard)
        return cancelled

    async def shutdown(self, reason: str) -> None:
        """Stop this conversation's work (the session is ending or the client left)."""
        try:
            await self.responses.cancel(reason)
        except Exception:  # noqa: BLE001 - the rest is stopped regardless
            log.exception("session %s: cancelling the response failed", self.session.id)
        await self.input.close()

    # ---- client events -------------------------------------------------------------------
    async def handle(self, raw: str | bytes) -> None:
        event_id = None
        try:
            ev = load_json(raw)
            if not isinstance(ev, dict):
                raise ClientError("An event must be a JSON object.", code="invalid_json")
            event_id = ev.get("event_id") if isinstance(ev.get("event_id"), str) else None
            t = ev.get("type")
            if not isinstance(t, str):
                raise ClientError("Missing required parameter: 'type'.", code="missing_required_parameter", param="type")
            self.session.touch()
            if not await self.transport.on_event(self, t, ev, event_id):
                await self.dispatch(t, ev)
        except OmniError as err:
            if not err.expose:
                raise  # a fault of ours: the transport's fault path (error event, 1011)
            self.error(err, event_id)  # the client's error, or one it should hear (a dead engine)

    def _required(self, ev: Mapping[str, Any], key: str) -> Any:
        if key not in ev:
            raise ClientError(f"Missing required parameter: '{key}'.", code="missing_required_parameter", param=key)
        return ev[key]

    async def dispatch(self, t: str, ev: dict[str, Any]) -> None:
        if t == "session.update":
            self.cfg = self.transport.update_session(self, self._required(ev, "session"))
            self.emit("session.updated", session=self.transport.session_wire(self))
        elif t == "transcription_session.update" and not self.ga:
            # beta's transcription sessions (intent=transcription) have their own update event
            self.cfg = replace(self.transport.update_session(self, self._required(ev, "session")), transcription_only=True)
            if self.cfg.transcription is None:
                self.cfg = replace(self.cfg, transcription=DEFAULT_TRANSCRIPTION)
            self.emit("transcription_session.updated", session=self.transport.session_wire(self))
        elif t == "input_audio_buffer.append":
            await self.input.append(self._required(ev, "audio"))
        elif t == "input_audio_buffer.commit":
            await self.input.commit()
        elif t == "input_audio_buffer.clear":
            await self.input.clear()
        elif t == "conversation.item.create":
            await self.item_create(ev)
        elif t == "conversation.item.delete":
            self.item_delete(ev)
        elif t == "conversation.item.truncate":
            self.item_truncate(ev)
        elif t == "conversation.item.retrieve":
            self.item_retrieve(ev)
        elif t == "response.create":
            await self.responses.create(ev.get("response"))
        elif t == "response.cancel":
            if self.responses.active is None:
                raise ClientError("Cancellation failed: no active response found.", code="response_cancel_not_active")
            await self.interrupt("client_cancelled")
        else:
            raise ClientError(f"Invalid value: '{t}'. Supported event types are the Realtime client events.", param="type")

    def function_item(self, raw: Mapping[str, Any]) -> Item:
        """A function_call or function_call_output item from the client. An output
        must answer a call in this conversation."""
        if raw.get("type") == "function_call":
            fc = parse(FunctionCallIn, raw, "item")
            return Item(fc.id or new_id("item"), "", [], type="function_call", call_id=fc.call_id, name=fc.name, arguments=fc.arguments)
        out = parse(FunctionCallOutputIn, raw, "item")
        if not any(it.type == "function_call" and it.call_id == out.call_id for it in self.items.values()):
            raise ClientError(f"No function call with call_id '{out.call_id}' in this conversation.", code="invalid_value", param="item.call_id")
        return Item(out.id or new_id("item"), "", [], type="function_call_output", call_id=out.call_id, output=out.output)

    async def item_create(self, ev: Mapping[str, Any]) -> None:
        if not isinstance(ev.get("item"), Mapping):
            raise ClientError("Missing required parameter: 'item'.", code="missing_required_parameter", param="item")
        if ev["item"].get("type") in ("function_call", "function_call_output"):
            fn = self.function_item(ev["item"])
            if fn.id in self.items:
                raise ClientError(f"An item with id '{fn.id}' already exists.", param="item.id")
            self.add_item(fn)
            return
        item = parse(ItemIn, ev["item"], "item")
        parts: list[dict[str, Any]] = []
        audio: np.ndarray | None = None
        for i, c in enumerate(item.content):
            if c.type in ("input_text", "text", "output_text"):
                if c.text is None:
                    raise ClientError(f"'item.content[{i}].text' must be a string.", code="invalid_type", param=f"item.content[{i}].text")
                parts.append({"type": c.type, "text": c.text})
            elif c.type == "input_audio" and item.role == "user":
                audio = decode_audio(c.audio, f"item.content[{i}].audio", self.cfg.input_format)
                parts.append({"type": "input_audio", "transcript": c.transcript})
            elif c.type == "input_image" and item.role == "user":
                limit, profile = self.session.image_limit()
                if limit <= 0:
                    served = f"'{self.pipeline.name}' pipeline" + (f" ('{profile}' profile)" if profile else "")
                    raise ClientError(f"input_image is not supported by this server's {served}: its thinker takes text and audio only "
                                      "(images need a thinker that sees them: the voice pipeline's default, omni or omni3 profile); "
                                      "send what the image shows as text.", code="unsupported_content", param=f"item.content[{i}].type")
                try:
                    await asyncio.to_thread(check_data_url, c.image_url)
                except ImageError as exc:
                    raise ClientError(f"'item.content[{i}].image_url' {exc}.", code="invalid_value", param=f"item.content[{i}].image_url") from None
                parts.append({"type": "input_image", "image_url": c.image_url, "detail": c.detail or "auto"})
            else:
                raise ClientError(f"Content type {c.type!r} is not supported for a {item.role} item.", param=f"item.content[{i}].type")
        item_id = item.id or new_id("item")
        if item_id in self.items:
            raise ClientError(f"An item with id '{item_id}' already exists.", param="item.id")
        new = Item(item_id, item.role, parts)
        self.add_item(new, speech=await self.input.encode(audio, new) if audio is not None else None)

    def item_delete(self, ev: Mapping[str, Any]) -> None:
        item_id = ev.get("item_id")
        if not isinstance(item_id, str) or item_id not in self.items:
            raise ClientError(f"Item with item_id '{item_id}' not found.", code="item_not_found", param="item_id")
        active = self.responses.active
        if active is not None and (active.item.id == item_id or active.open_call is not None and active.open_call.id == item_id):
            raise ClientError("The item of the active response cannot be deleted; cancel it first.", param="item_id")
        del self.items[item_id]
        self.emit("conversation.item.deleted", item_id=item_id)

    def item_retrieve(self, ev: Mapping[str, Any]) -> None:
        """The server's copy of an item (what history keeps: a truncated answer's
        transcript is what the user heard)."""
        item_id = ev.get("item_id")
        item = self.items.get(item_id) if isinstance(item_id, str) else None
        if item is None:
            raise ClientError(f"Item with item_id '{item_id}' not found.", code="item_retrieve_invalid_item_id", param="item_id")
        self.emit("conversation.item.retrieved", item=item.wire(self.ga))

    def item_truncate(self, ev: Mapping[str, Any]) -> None:
        item_id = ev.get("item_id")
        item = self.items.get(item_id) if isinstance(item_id, str) else None
        if item is None:
            raise ClientError(f"Item with item_id '{item_id}' not found.", code="item_not_found", param="item_id")
        if item.role != "assistant" or not any(c.get("type") in ("output_audio", "audio") for c in item.content):
            raise ClientError("Only assistant audio items can be truncated.", param="item_id")
        end = ev.get("audio_end_ms")
        if not isinstance(end, int) or isinstance(end, bool) or end < 0:
            raise ClientError("'audio_end_ms' must be a non-negative integer.", param="audio_end_ms")
        self.truncate(item, end, ev.get("content_index", 0))
