"""The input audio buffer of a realtime conversation.

What happens to user audio while it is appended depends on the profile served. Where
the profile's entry is a stage before the thinker (`front`: the cascade's asr), the
first audio of an utterance opens a request to it alone and every chunk streams in, so
a commit only waits for what is left (the transcript); its outputs become the utterance's "speech", given to the
thinker with the response. Where the thinker itself takes audio (the default), the
buffer keeps the utterance's PCM (at most `MAX_KEPT_MS`), and that is its speech.
With server_vad a detector listens to everything appended: speech start opens the utterance (with `prefix_padding_ms` of the audio before it) and, during
an answer, is a barge-in; speech stop commits and, with `create_response`, answers.
The front stage's requests are not fenced: a barge-in cancels the answer, not the question.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from typing import TYPE_CHECKING, Any

import numpy as np

from media.wire_audio import InputDecoder, WireFormat, WireFormatError, decode_clip
from omni_rt import metrics
from omni_rt.errors import ClientError, RequestAborted
from omni_rt.payloads import Payload, PayloadKind
from omni_rt.request import RequestStream
from protocols.errors import to_omni
from protocols.realtime.items import Item, new_id
from protocols.realtime.models import RATE, TurnDetection
from protocols.realtime.vad import VoiceActivity
from sessions.errors import RateLimited

if TYPE_CHECKING:
    from protocols.realtime.conversation import Conversation

MAX_APPEND_BYTES = 15 * 1024 * 1024
# input transcription models transcribed while the user speaks, where the profile serves
# the stt stage (whisper-1 is transcribed on commit, by the asr stage)
STREAMING_TRANSCRIPTION = frozenset({"gpt-4o-transcribe", "gpt-4o-mini-transcribe", "gpt-4o-transcribe-latest", "omni-rt-stt"})
MIN_COMMIT_MS = 100
# The longest utterance kept for a thinker that takes audio itself (Qwen2.5-Omni's
# feature extractor takes 300 s); appends beyond it are refused, not dropped.
MAX_KEPT_MS = 300_000


def decode_base64(b64: Any, param: str, limit: int = MAX_APPEND_BYTES) -> bytes:
    """The bytes of a base64 audio field, or the Realtime error for what is wrong with it."""
    if not isinstance(b64, str):
        raise ClientError(f"'{param}' must be a base64 string.", code="invalid_type", param=param)
    if len(b64) > limit * 4 // 3 + 4:
        raise ClientError(f"An append may carry at most {limit} bytes of audio.", param=param)
    try:
        return base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise ClientError(f"'{param}' is not valid base64.", param=param) from None


def decode_audio(b64: Any, param: str, fmt: WireFormat) -> np.ndarray:
    """A whole base64 clip in `fmt` (an item's audio) as float32 at the model rate."""
    try:
        return decode_clip(fmt, decode_base64(b64, param), RATE)
    except WireFormatError as exc:
        raise ClientError(f"'{param}' is not {fmt.beta()} audio: {exc}", param=param) from None


class InputAudio:
    def __init__(self, conv: Conversation) -> None:
        self.conv = conv
        self._rate_told = False  # the caller heard its audio is refused (rate limit) this spell
        self.stream: RequestStream | None = None  # the utterance's request to the front stage
        entry = conv.session.entry_stage()
        self.front: str | None = entry if entry not in (None, "thinker") else None
        self.pcm: list[np.ndarray] = []  # the utterance's audio, where the thinker takes it
        self.item_id: str | None = None
        self.ms = 0  # audio appended since the buffer was last committed/cleared
        self.pending_prefix: list[np.ndarray] = []
        self.vad: VoiceActivity | None = None
        self.collecting: set[asyncio.Task[None]] = set()
        self.heard: list[np.ndarray] = []  # the utterance's audio, kept for its transcription
        self._decoder: InputDecoder | None = None  # the session's input format -> the model rate (a stream)
        self.heard_ms = 0.0  # audio appended since the session started (the VAD's timeline)
        self.live: RequestStream | None = None  # the utterance's streaming transcription (the stt stage)
        self.live_samples = 0
        self.live_seconds: dict[str, float] = {}  # committed utterances whose transcript is still streaming
        self.idle_from: float | None = None  # where the last answer finished playing (idle_timeout_ms counts from it)

    # ---- the utterance ----------------------------------------------------------------
    def _front_params(self) -> dict[str, Any]:
        """A cascade's front stage transcribes: greedily, in the language the session's
        input transcription names (else detected)."""
        t = self.conv.cfg.transcription or {}
        return {"task": "transcribe", "language": t.get("language"), "prompt": t.get("prompt"), "temperature": 0.0}

    def _streaming(self) -> bool:
        """Input transcription while the user speaks: a streaming model was asked for
        (gpt-4o-transcribe, …) and the profile serves the stt stage (else the asr
        stage transcribes each utterance on commit)."""
        t = self.conv.cfg.transcription
        return t is not None and self.front is None and t.get("model") in STREAMING_TRANSCRIPTION and self.conv.session.serves("stt")

    def _start(self) -> None:
        if self.front is not None:
            self.stream = self.conv.session.submit(self._front_params(), outputs={self.front}, fenced=False)
        self.item_id = new_id("item")
        if self._streaming():
            s = self.conv.session
            self.live = s.submit(self._front_params(), outputs={"stt"}, entry="stt", fenced=False)
            self.live_samples = 0
            task = asyncio.get_running_loop().create_task(self._live(self.live, self.item_id))
            self.collecting.add(task)
            task.add_done_callback(self.collecting.discard)

    def _send(self, pcm: np.ndarray) -> None:
        if self.front is None and self.ms + len(pcm) * 1000 // RATE > MAX_KEPT_MS:
            raise ClientError(
                f"The input audio buffer holds at most {MAX_KEPT_MS // 1000} s of speech; commit or clear it first.",
                code="input_audio_buffer_too_long",
            )
        if self.item_id is None:
            self._start()
        s = self.conv.session
        if self.stream is not None:
            s.send_input(self.stream, Payload(PayloadKind.AUDIO, s.fence, arrays={"pcm": pcm}, meta={"sample_rate": RATE}))
        else:
            self.pcm.append(pcm)
        self.ms += len(pcm) * 1000 // RATE
        if self.live is not None:
            s.send_input(self.live, Payload(PayloadKind.AUDIO, s.fence, arrays={"pcm": pcm}, meta={"sample_rate": RATE}))
            self.live_samples += len(pcm)
        elif self.conv.cfg.transcription is not None:
            self.heard.append(pcm)

    async def _live(self, stream: RequestStream, item_id: str) -> None:
        """The utterance's transcript as the stt stage writes it: `…delta` events while
        the user speaks, `…completed` once the committed utterance's stream ends (a
        cleared buffer's stream is closed: nothing more is said of it)."""
        conv = self.conv
        ids = {"item_id": item_id, "content_index": 0}
        text = ""
        try:
            async for _, p, _ in stream.payloads():
                if p.text:
                    text += p.text
                    conv.emit("conversation.item.input_audio_transcription.delta", delta=p.text, **ids)
        except RequestAborted:
            return
        except Exception as exc:  # noqa: BLE001 - the client hears that its transcript failed
            self._failed(ids, exc)
            return
        finally:
            await asyncio.shield(stream.close())
        if item_id not in self.live_seconds:  # cleared (or the session closed) before it was committed
            return
        text = text.strip()
        item = conv.items.get(item_id)
        if item is not None and item.content and not item.content[0].get("transcript"):
            item.content[0]["transcript"] = text
        self._completed(ids, text, self.live_seconds.pop(item_id, 0.0))

    async def _collect(self, stream: RequestStream, fut: asyncio.Future[list[Payload]], item: Item | None, seconds: float | None) -> None:
        """`seconds`: the front stage is the asr and the session asked for input
        transcription: its transcript is also the transcription (`…delta` events as it
        comes, then `…completed` or `…failed`), not a second pass over the audio."""
        out: list[Payload] = []
        conv = self.conv
        ids = {"item_id": item.id, "content_index": 0} if item is not None else {}
        try:
            async for _, p, _ in stream.payloads():
                out.append(p)
                if seconds is not None and p.text:
                    conv.emit("conversation.item.input_audio_transcription.delta", delta=p.text, **ids)
            fut.set_result(out)
            said = "".join(p.text or "" for p in out if p.kind == PayloadKind.TEXT).strip()
            if item is not None and said and item.content and not item.content[0].get("transcript"):
                item.content[0]["transcript"] = said  # a cascade's transcript: later turns read it
            if seconds is not None:
                self._completed(ids, said, seconds)
        except Exception as exc:  # noqa: BLE001 - whoever waits must not wait forever
            if not fut.done():
                fut.set_exception(exc)
            if seconds is not None:
                self._failed(ids, exc)
        finally:
            if not fut.done():
                fut.cancel()
            await asyncio.shield(stream.close())

    def _completed(self, ids: dict[str, Any], transcript: str, seconds: float) -> None:
        self.conv.emit("conversation.item.input_audio_transcription.completed", transcript=transcript,
                       usage={"type": "duration", "seconds": round(seconds, 3)}, **ids)

    def _failed(self, ids: dict[str, Any], exc: BaseException) -> None:
        """The client hears that its transcript failed, in the Realtime error's shape."""
        err = to_omni(exc, f"transcription of {ids.get('item_id')}")
        self.conv.emit("conversation.item.input_audio_transcription.failed",
                       error={"type": err.type, "code": err.code, "message": err.public_message(), "param": None}, **ids)

    def collect(self, stream: RequestStream, item: Item | None = None, seconds: float | None = None) -> asyncio.Future[list[Payload]]:
        """The speech of a closed utterance, once its front-stage request finishes."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[Payload]] = loop.create_future()
        task = loop.create_task(self._collect(stream, fut, item, seconds))
        self.collecting.add(task)
        task.add_done_callback(self.collecting.discard)
        return fut

    def _audio(self, pcm: np.ndarray) -> asyncio.Future[list[Payload]]:
        fut: asyncio.Future[list[Payload]] = asyncio.get_running_loop().create_future()
        fut.set_result([Payload(PayloadKind.AUDIO, self.conv.session.fence, arrays={"pcm": pcm}, meta={"sample_rate": RATE})])
        return fut

    async def encode(self, pcm: np.ndarray, item: Item | None = None) -> asyncio.Future[list[Payload]]:
        """The speech of a whole utterance (an input_audio item), once it is ready."""
        if self.front is None:
            return self._audio(pcm)
        s = self.conv.session
        stream = s.submit(self._front_params(), outputs={self.front}, fenced=False)
        s.send_input(stream, Payload(PayloadKind.AUDIO, s.fence, arrays={"pcm": pcm}, meta={"sample_rate": RATE}))
        stream.end_input()
        fut = self.collect(stream, item)
        await asyncio.wait([fut])
        return fut

    # ---- client events -----------------------------------------------------------------
    async def append(self, b64: Any) -> None:
        await self.append_bytes(decode_base64(b64, "audio"), "audio")

    async def append_bytes(self, data: bytes, param: str | None = None) -> None:
        """Append audio in the session's input format (`input_audio_format` /
        `audio.input.format`: PCM16 at its rate or G.711 at 8 kHz)."""
        fmt = self.conv.cfg.input_format
        if self._decoder is None or self._decoder.fmt != fmt:
            self._decoder = InputDecoder(fmt, RATE)
        try:
            pcm = self._decoder.decode(data)
        except WireFormatError as exc:
            raise ClientError(f"Audio is not {fmt.beta()}: {exc}", param=param, code="invalid_frame" if param is None else "invalid_value") from None
        if len(pcm):
            await self.append_pcm(pcm)

    async def append_pcm(self, pcm: np.ndarray) -> None:
        """Append float32 mono audio at the model rate (`RATE`)."""
        if not len(pcm):
            return
        limits, principal = self.conv.sessions.rate_limits, self.conv.session.principal
        if limits.limited(principal, "audio_seconds"):
            try:
                await limits.take(principal, "audio_seconds", len(pcm) / RATE)
                self._rate_told = False
            except RateLimited as exc:
                if self._rate_told:
                    return  # (said once per spell: the audio is not taken until the rate allows)
                self._rate_told = True
                raise ClientError(f"{exc.message} Audio is not taken until then.", code="rate_limit_exceeded") from None
        td = self.conv.cfg.turn_detection
        if td is None:
            self._send(pcm)
            return
        # server VAD: keep the last prefix_padding_ms while silent; stream while speaking
        if self.vad is None:
            self.vad = await self.conv.vad()
        events = await asyncio.to_thread(self.vad.push, pcm, td)
        self.heard_ms += len(pcm) * 1000 / RATE
        if self.item_id is not None:
            self._send(pcm)
        else:
            self.pending_prefix.append(pcm)
            keep = td.prefix_padding_ms * RATE // 1000
            joined = np.concatenate(self.pending_prefix)
            self.pending_prefix = [joined[-keep:]] if keep else []
        for kind, at_ms in events:
            if kind == "start":
                await self.speech_started(at_ms, td)
            else:
                await self.speech_stopped(at_ms, td)
        if td.idle_timeout_ms is not None and td.type == "server_vad" and self.idle_from is not None:
            await self._idle(td)

    def answered(self, played_from: float | None, audio_ms: int) -> None:
        """An answer finished: idle_timeout_ms counts from when its audio will have
        played (its first audio's place on the input timeline plus its length; on
        the timeline of what the client streams, as a caller on a phone line does)."""
        end = self.heard_ms if played_from is None else max(self.heard_ms, played_from + audio_ms)
        self.idle_from = end

    async def _idle(self, td: TurnDetection) -> None:
        """No speech for idle_timeout_ms after the answer played (server VAD): the
        silence is committed as the user's turn (`input_audio_buffer.timeout_triggered`,
        then `…committed`) and answered, the model prompting the user to go on."""
        assert self.idle_from is not None and td.idle_timeout_ms is not None
        if self.item_id is not None or self.conv.responses.active is not None or self.heard_ms - self.idle_from < td.idle_timeout_ms:
            return
        start, self.idle_from = self.idle_from, None
        prefix = np.concatenate(self.pending_prefix) if self.pending_prefix else np.zeros(0, np.float32)
        self.pending_prefix = []
        floor = MIN_COMMIT_MS * RATE // 1000
        if len(prefix) < floor:  # the silence itself, at least as much as a commit takes
            prefix = np.concatenate([np.zeros(floor - len(prefix), np.float32), prefix])
        self._start()
        self._send(prefix)
        self.conv.emit("input_audio_buffer.timeout_triggered", audio_start_ms=int(start), audio_end_ms=int(self.heard_ms), item_id=self.item_id)
        await self.commit()
        if not self.conv.cfg.transcription_only:
            await self.conv.responses.create(None)

    async def speech_started(self, at_ms: int, td: TurnDetection) -> None:
        self.idle_from = None  # the user speaks: no idle nudge until the next answer played
        if self.item_id is None:
            prefix = np.concatenate(self.pending_prefix) if self.pending_prefix else np.zeros(0, np.float32)
            self.pending_prefix = []
            self._start()
            if len(prefix):
                self._send(prefix)
        self.conv.emit("input_audio_buffer.speech_started", audio_start_ms=max(0, at_ms - td.prefix_padding_ms), item_id=self.item_id)
        if td.interrupt_response:
            # The user talks over the agent: the answer stops here (its queued audio
            # fails the fence check) and the conversation keeps what was heard.
            t0 = asyncio.get_running_loop().time()
            if await self.conv.interrupt("turn_detected"):
                metrics.BARGE_IN_SECONDS.observe(asyncio.get_running_loop().time() - t0)

    async def speech_stopped(self, at_ms: int, td: TurnDetection) -> None:
        self.conv.emit("input_audio_buffer.speech_stopped", audio_end_ms=at_ms, item_id=self.item_id)
        await self.commit()
        if td.create_response and not self.conv.cfg.transcription_only:
            await self.conv.responses.create(None)

    async def commit(self) -> None:
        if self.item_id is None or self.ms < MIN_COMMIT_MS:
            raise ClientError(
                "Error committing input audio buffer: buffer too small. Expected at least "
                f"{MIN_COMMIT_MS}ms of audio, but buffer only has {self.ms:.2f}ms of audio.",
                code="input_audio_buffer_commit_empty",
            )
        stream, item_id = self.stream, self.item_id
        heard, self.heard = self.heard, []
        if self.live is not None:  # streamed while it was spoken: its transcript completes as the stream ends
            self.live_seconds[item_id] = self.live_samples / RATE
            self.live.end_input()
            self.live = None
        pcm, self.pcm = self.pcm, []
        self.stream, self.item_id, self.ms = None, None, 0
        if stream is not None:
            stream.end_input()
        prev = self.conv.last_item_id()
        self.conv.emit("input_audio_buffer.committed", previous_item_id=prev, item_id=item_id)
        item = Item(item_id, "user", [{"type": "input_audio", "transcript": None}])
        settings = self.conv.cfg.transcription
        transcribing = settings is not None and bool(heard)
        shared = transcribing and self.front == "asr"  # the cascade's own transcript is the transcription
        if stream is not None:
            speech = self.collect(stream, item, sum(len(h) for h in heard) / RATE if shared else None)
        else:
            speech = self._audio(np.concatenate(pcm))
        self.conv.add_item(item, speech=speech)
        if settings is not None and heard and not shared:
            self.transcribe(item, np.concatenate(heard), settings)

    # ---- input transcription -------------------------------------------------------------
    def transcribe(self, item: Item, pcm: np.ndarray, settings: dict[str, Any]) -> None:
        """Transcribe a committed utterance (its own request to the asr stage, not
        fenced: a barge-in does not cancel the question's transcript): `…delta` events,
        then `…completed` (the item keeps the transcript) or `…failed`."""
        task = asyncio.get_running_loop().create_task(self._transcribe(item, pcm, settings))
        self.collecting.add(task)
        task.add_done_callback(self.collecting.discard)

    async def _transcribe(self, item: Item, pcm: np.ndarray, settings: dict[str, Any]) -> None:
        conv, s = self.conv, self.conv.session
        ids = {"item_id": item.id, "content_index": 0}
        text = ""
        try:
            stream = s.submit({"task": "transcribe", "language": settings.get("language"), "prompt": settings.get("prompt"), "temperature": 0.0},
                              outputs={"asr"}, entry="asr", fenced=False)
            try:
                s.send_input(stream, Payload(PayloadKind.AUDIO, s.fence, arrays={"pcm": pcm}, meta={"sample_rate": RATE}))
                stream.end_input()
                async for _, p, _ in stream.payloads():
                    if p.text:
                        text += p.text
                        conv.emit("conversation.item.input_audio_transcription.delta", delta=p.text, **ids)
            finally:
                await asyncio.shield(stream.close())
        except Exception as exc:  # noqa: BLE001 - the client hears that its transcript failed
            self._failed(ids, exc)
            return
        text = text.strip()
        item.content[0]["transcript"] = text
        self._completed(ids, text, len(pcm) / RATE)

    async def clear(self) -> None:
        if self.stream is not None:
            await self.stream.close()
        if self.live is not None:
            await self.live.close()
            self.live = None
        self.stream, self.item_id, self.ms, self.pending_prefix, self.heard, self.pcm = None, None, 0, [], [], []
        self.conv.emit("input_audio_buffer.cleared")

    async def close(self) -> None:
        for task in list(self.collecting):
            task.cancel()
        if self.live is not None:
            await self.live.close()
            self.live = None
        if self.stream is not None:
            await self.stream.close()
            self.stream = None
