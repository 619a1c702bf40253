"""Responses of a realtime conversation: one orchestrator request each, fenced by the
session. Text (or the transcript) streams as deltas; the audio goes to the
transport's audio output. Cancel and barge-in advance the session's epoch before the
request is aborted, so nothing of the old answer goes out after its `response.done`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from media.audio_formats import pcm16_bytes
from omni_rt import metrics
from omni_rt.errors import ClientError, ContextLengthExceeded, EngineDead, RequestAborted
from omni_rt.payloads import FINISH_REASON, TOOL_CALL, Payload
from omni_rt.request import RequestStream
from protocols.errors import to_omni
from protocols.realtime.items import Item, Response, new_id
from protocols.realtime.models import RATE, ResponseOverrides, parse, voice_of
from protocols.tools import parse_tool_choice, parse_tools, realtime_choice_wire

if TYPE_CHECKING:
    from protocols.realtime.conversation import Conversation


class Responses:
    def __init__(self, conv: Conversation) -> None:
        self.conv = conv
        self.active: Response | None = None

    async def create(self, raw: Mapping[str, Any] | None) -> None:
        """`response.create` (its `response` object), or an answer server VAD starts."""
        conv = self.conv
        if conv.cfg.transcription_only:
            raise ClientError("This is a transcription session: it transcribes the audio it is sent and creates no responses.",
                              code="invalid_request", param="type")
        if self.active is not None:
            raise ClientError(
                f"Conversation already has an active response in progress: {self.active.id}. "
                "Wait until the response is finished before creating a new one.",
                code="conversation_already_has_active_response",
            )
        o = parse(ResponseOverrides, raw or {}, "response")
        cfg = conv.cfg
        audio_out = cfg.audio_out
        for key in ("modalities", "output_modalities"):
            if getattr(o, key) is not None:
                audio_out = getattr(o, key)
        voice = voice_of(o.voice, conv.pipeline.voices, "response.voice") if o.voice is not None else cfg.voice
        max_tokens = cfg.max_output_tokens
        for key in ("max_output_tokens", "max_response_output_tokens"):
            if key in o.model_fields_set:
                max_tokens = getattr(o, key)
        tools = parse_tools(o.tools, "response.tools", nested=False) if "tools" in o.model_fields_set else cfg.tools
        if "tool_choice" in o.model_fields_set:
            choice = parse_tool_choice(o.tool_choice, tools, "response.tool_choice", nested=False)
        elif "tools" in o.model_fields_set:
            # the session's choice over this response's tools (a named one must be among them)
            choice = parse_tool_choice(realtime_choice_wire(cfg.tool_choice), tools, "session.tool_choice", nested=False)
        else:
            choice = cfg.tool_choice
        part0: dict[str, Any] = {"type": "output_audio", "transcript": ""} if audio_out else {"type": "output_text", "text": ""}
        item = Item(new_id("item"), "assistant", [part0], status="in_progress")
        resp = Response(new_id("resp"), item, audio_out, epoch=conv.session.epoch, metadata=o.metadata)
        await conv.sessions.rate_limits.check(conv.session.principal, "tokens")  # (RateLimited: the client's error event)
        speech = await conv.latest_speech()
        instructions = o.instructions if o.instructions is not None else cfg.instructions
        conv.fit(instructions)  # the oldest turns go before a prompt estimated past the context
        params = {
            "voice": conv.pipeline.voices.get(voice, voice),
            "max_output_tokens": max_tokens,
            "temperature": o.temperature if o.temperature is not None else cfg.temperature,
        }
        if tools:
            # A forced choice makes one call per response (the agent answers it, then
            # asks again); under auto the model may make several.
            params.update(tools=list(tools), tool_choice=choice, parallel_tool_calls=choice == "auto")
            resp.forced = choice not in ("auto", "none")
        resp.instructions = instructions

        def submit() -> RequestStream:
            # The user's speech (its audio, or what the profile's front stage made of it
            # while it was appended) goes straight to the thinker, this request's entry.
            session = conv.session
            resp.prompt_chars = conv.prompt_chars(instructions)
            stream = session.submit({**params, **conv.prompt(instructions)},
                                    outputs={"thinker", *session.speech_outputs()} if audio_out else {"thinker"}, entry="thinker")
            try:
                for p in speech:
                    session.send_input(stream, Payload(p.kind, session.fence, text=p.text, arrays=p.arrays, meta=p.meta))
                stream.end_input()
            except BaseException:
                asyncio.get_running_loop().create_task(stream.close())
                raise
            return stream

        resp.submit = submit
        resp.stream = submit()
        self.active = resp
        conv.emit("response.created", response=self.wire(resp, "in_progress"))
        resp.task = asyncio.get_running_loop().create_task(self._run(resp))

    def wire(self, resp: Response, status: str, details: Any = None, usage: Any = None) -> dict[str, Any]:
        ga = self.conv.ga
        out = {
            "id": resp.id,
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "output": [o.wire(ga) for o in resp.outputs] if status != "in_progress" else [],
            "usage": usage,
            "conversation_id": self.conv.session.id,
            "metadata": resp.metadata,
        }
        key = "output_modalities" if ga else "modalities"
        out[key] = (["audio"] if ga else ["text", "audio"]) if resp.audio_out else ["text"]
        return out

    def _part(self, resp: Response, part: Mapping[str, Any]) -> dict[str, Any]:
        """A content part as `response.content_part.added/.done` carry it: type `audio`
        or `text` in both dialects (the GA items say `output_audio`/`output_text`, but
        these two events keep the short names: the SDKs' own types allow only those)."""
        out = dict(part)
        out["type"] = "audio" if resp.audio_out else "text"
        return out

    def _add_output(self, resp: Response, item: Item) -> int:
        index = len(resp.outputs)
        resp.outputs.append(item)
        self.conv.emit("response.output_item.added", response_id=resp.id, output_index=index, item=item.wire(self.conv.ga))
        self.conv.add_item(item, done=False)
        return index

    def _message(self, resp: Response) -> None:
        """The answer's message item, once it has something to say (a pure call has none)."""
        if not resp.message_added:
            resp.message_added = True
            resp.message_index = self._add_output(resp, resp.item)
            self.conv.emit("response.content_part.added", part=self._part(resp, resp.item.content[0]), **resp.ids)

    def _call_piece(self, resp: Response, piece: dict[str, Any], fence: Any) -> None:
        """A piece of a function call: a new call's item, or more of its arguments."""
        conv = self.conv
        item = resp.calls.get(piece["index"])
        if item is None:
            self._close_call(resp, "completed")  # the model went on to the next call
            item = resp.calls[piece["index"]] = Item(new_id("item"), "", [], status="in_progress", type="function_call",
                                                     call_id=str(piece.get("id") or new_id("call")), name=str(piece.get("name") or ""))
            resp.open_call = item
            self._add_output(resp, item)
        delta = str(piece.get("arguments") or "")
        if delta:
            item.arguments += delta
            conv.emit("response.function_call_arguments.delta", fence, response_id=resp.id, item_id=item.id,
                      output_index=_index(resp, item), call_id=item.call_id, delta=delta)

    def _close_call(self, resp: Response, status: str) -> None:
        item, resp.open_call = resp.open_call, None
        if item is None:
            return
        conv, index = self.conv, _index(resp, item)
        item.status = status
        conv.emit("response.function_call_arguments.done", response_id=resp.id, item_id=item.id, output_index=index,
                  call_id=item.call_id, name=item.name, arguments=item.arguments)
        conv.emit("response.output_item.done", response_id=resp.id, output_index=index, item=item.wire(conv.ga))
        if conv.ga and item.id in conv.items:
            conv.emit("conversation.item.done", previous_item_id=None, item=item.wire(conv.ga))

    def _drop_call(self, resp: Response) -> bool:
        """A call cut by a cancel: nothing more of it is sent, and it leaves the
        conversation (a call without its arguments is no history). True if there was one."""
        item, resp.open_call = resp.open_call, None
        if item is None:
            return False
        resp.outputs = [o for o in resp.outputs if o is not item]
        if self.conv.items.pop(item.id, None) is not None:
            self.conv.emit("conversation.item.deleted", item_id=item.id)
        return True

    async def _run(self, resp: Response) -> None:
        conv = self.conv
        assert resp.stream is not None
        stream, item = resp.stream, resp.item
        fence = conv.session.fence
        output = conv.transport.output
        status: str = "completed"
        details: dict[str, Any] | None = None
        text_delta = "response.audio_transcript.delta" if resp.audio_out else "response.text.delta"
        samples = 0
        try:
            async for stage, payload, _ in self._payloads(resp):
                if stage == "thinker":
                    meta = payload.meta
                    if TOOL_CALL in meta:
                        self._call_piece(resp, meta[TOOL_CALL], fence)
                    elif FINISH_REASON in meta:
                        resp.finish = meta[FINISH_REASON]
                        self._close_call(resp, "incomplete" if resp.finish == "length" else "completed")
                    elif payload.text:
                        self._message(resp)
                        item.transcript += payload.text
                        conv.emit(text_delta, fence, delta=payload.text, **resp.ids)
                else:
                    self._message(resp)
                    pcm = payload.arrays["pcm"]
                    if not samples:
                        metrics.TTFP_SECONDS.labels(api="realtime").observe(time.monotonic() - resp.started)
                        resp.first_audio_at = conv.input.heard_ms
                    samples += len(pcm)
                    item.audio_ms = samples * 1000 // RATE
                    output.push(resp, fence, pcm16_bytes(pcm))
                conv.session.touch()
            if samples:
                output.end(resp, fence)
        except RequestAborted:
            status, details = "cancelled", {"type": "cancelled", "reason": resp.cancel_reason or "client_cancelled"}
        except Exception as exc:  # noqa: BLE001 - the client always hears how its response ended
            if resp.cancel_reason is not None:
                status, details = "cancelled", {"type": "cancelled", "reason": resp.cancel_reason}
            else:
                err = to_omni(exc, f"response {resp.id}")
                status = "failed"
                if isinstance(err, ClientError):  # the request's own fault (e.g. context_length_exceeded)
                    error = {"type": err.type, "code": err.code, "message": err.message}
                else:  # an engine or a remote stage replica that went away says so: the next turn may go on
                    code = err.code if isinstance(err, EngineDead) else "generation_failed"
                    error = {"type": "server_error", "code": code, "message": err.public_message()}
                details = {"type": "failed", "error": error}
        finally:
            stream = resp.stream
            await asyncio.shield(stream.close())
        if status == "completed" and resp.cancel_reason is not None:
            # cancelled while its last payloads were in flight: the stream may end
            # without raising (stale outputs are skipped), but the answer was cut
            status, details = "cancelled", {"type": "cancelled", "reason": resp.cancel_reason}
        if status == "completed" and resp.finish == "length" and (resp.forced or any(c.status == "incomplete" for c in resp.calls.values())):
            # a call cut short (or a forced one that never got going): the answer is not whole
            status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
        dropped = False
        if status == "cancelled" or status == "failed":
            dropped = self._drop_call(resp)
        else:
            self._close_call(resp, "completed")
        if not resp.outputs and not dropped:  # nothing said and no call: an empty answer is still an answer
            self._message(resp)
        self._finish(resp, status, details, dict(stream.done.usage or {}) if stream.done is not None else {})

    async def _payloads(self, resp: Response) -> AsyncIterator[tuple[str, Payload, Any]]:
        """The answer's payloads. A prompt the thinker's context refuses before anything
        was said is fitted (the conversation's oldest turns dropped, under the session's
        truncation) and submitted again, as long as a whole turn can go."""
        while True:
            assert resp.stream is not None
            try:
                async for out in resp.stream.payloads():
                    yield out
                return
            except ContextLengthExceeded as exc:
                if resp.outputs or resp.cancel_reason is not None or not self.conv.fit(resp.instructions, exc.tokens, exc.limit):
                    raise
            await asyncio.shield(resp.stream.close())
            assert resp.submit is not None
            resp.stream = resp.submit()

    def _finish(self, resp: Response, status: str, details: Any, usage: dict[str, int]) -> None:
        conv, item, ids = self.conv, resp.item, resp.ids
        n_in, n_audio, n_image = usage.get("input_tokens", 0), usage.get("input_audio_tokens", 0), usage.get("input_image_tokens", 0)
        if status == "completed" and n_in:
            conv.learn_tokens(n_in - n_audio - n_image, resp.prompt_chars)
        conv.sessions.charge_soon(conv.session.principal, "tokens", n_in + usage.get("output_tokens", 0))
        wire_usage = {
            "total_tokens": n_in + usage.get("output_tokens", 0),
            "input_tokens": n_in,
            "output_tokens": usage.get("output_tokens", 0),
            # audio tokens: the rows of the user's encoded speech in the prompt; image
            # tokens: the images' rows (the vision tower's, merged)
            "input_token_details": {"text_tokens": n_in - n_audio - n_image, "audio_tokens": n_audio, "image_tokens": n_image,
                                    "cached_tokens": 0},
        }
        if resp.message_added:
            c = item.content[0]
            c["transcript" if resp.audio_out else "text"] = item.transcript
            item.status = "completed" if status == "completed" else "incomplete"
            if status in ("completed", "incomplete"):
                if resp.audio_out:
                    conv.emit("response.audio.done", **ids)
                    conv.emit("response.audio_transcript.done", transcript=item.transcript, **ids)
                else:
                    conv.emit("response.text.done", text=item.transcript, **ids)
                conv.emit("response.content_part.done", part=self._part(resp, c), **ids)
            conv.emit("response.output_item.done", response_id=resp.id, output_index=resp.message_index, item=item.wire(conv.ga))
            if conv.ga and item.id in conv.items:
                conv.emit("conversation.item.done", previous_item_id=None, item=item.wire(conv.ga))
        conv.emit("response.done", response=self.wire(resp, status, details, wire_usage))
        conv.input.answered(resp.first_audio_at, item.audio_ms)
        metrics.E2E_SECONDS.labels(api="realtime").observe(time.monotonic() - resp.started)
        if self.active is resp:
            self.active = None

    async def cancel(self, reason: str) -> bool:
        """Stop the active response (False when there is none)."""
        resp = self.active
        if resp is None:
            return False
        resp.cancel_reason = reason
        # Advance the epoch first: from here on nothing of this response passes a
        # fence check, then abort its stages.
        self.conv.session.advance_epoch()
        if resp.stream is not None:
            await resp.stream.abort(reason)
        if resp.task is not None:
            await asyncio.shield(resp.task)
        return True


def _index(resp: Response, item: Item) -> int:
    """The item's output_index (items compare by identity: two may hold equal fields)."""
    return next(i for i, o in enumerate(resp.outputs) if o is item)
