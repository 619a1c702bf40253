"""The `moshi` pipeline: a full-duplex speech model, Moshi + Mimi, every conversation
advanced by one batched step per 80 ms frame.

Moshi listens and speaks at once: each frame it reads the user's 80 ms of audio (Mimi's
8 codes) and writes its own (8 codes, decoded by Mimi) plus a token of its inner
monologue (the text stream). There are no turns: the model decides every frame whether
to speak, back-channel or stay silent. The networks are transformers'
`MoshiForConditionalGeneration` with its `MimiModel`, loaded with `from_pretrained`
from a directory (`kmhf/hf-moshiko` / `hf-moshika`, or the tiny random one); the step
over many conversations is `pipelines.moshi.steps.MoshiSteps`, run by the torch engine.

One request per conversation: its input is the user's audio (AUDIO payloads, float32
PCM at 24 kHz, any chunk size), its output one AUDIO payload a frame (1920 samples, the
model's voice; `meta`: `frame`, `text` the piece of text this frame added, `late`).

The frame clock (`FrameClock`, one per replica) ticks every 80 ms while any
conversation is live. At each tick every live conversation contributes one frame: the
next 1920 samples of what its user sent, or silence when the user's audio has not
arrived (a user that stops sending is heard as silence; audio arriving later is played
in after a `jitter_ms` lead again, nothing accepted is dropped); all of them go to the
engine at once and run as one batch. A conversation joins at the tick after it opens
and leaves when its input ends; the others do not notice. Audio that arrives faster
than real time waits in the conversation's buffer, up to `max_buffer_s`.

Admission (`admit`): the clock measures the step time of each batch size it runs (at
start-up every size in turn, while it fits the budget; then every step in service); one more conversation is admitted while the step
predicted for one more stays within `frame_budget_ms` × `budget_headroom`, and while
fewer than `max_sessions` are live. The prediction is the measured average at that
size plus three times its mean absolute deviation (`StepTimes`: the steps that
overrun are the ones that matter), else a least-squares line through the sizes
measured.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from omni_rt import metrics
from omni_rt.engines.base import Engine, StepEngine
from omni_rt.errors import CapacityExceeded
from omni_rt.payloads import Payload, PayloadKind
from omni_rt.specs import StageSpec
from omni_rt.stage import ProcessorArgs, StageContext, StageError, StageProcessor
from pipelines import checkpoint
from pipelines.moshi.steps import FRAME, MoshiSteps

log = logging.getLogger("pipelines.moshi")

ARCHITECTURE = "MoshiForConditionalGeneration"
SAMPLE_RATE = 24000
FRAME_S = FRAME / SAMPLE_RATE  # 0.08
WARM_STEPS = 5  # steps measured at each batch size at start-up

class MoshiArgs(ProcessorArgs):
    """The moshi stage's processor_args (see the module docstring)."""

    max_sessions: int = Field(default=16, ge=1, description="conversations one replica holds at most")
    jitter_ms: float = Field(default=40.0, ge=0.0, description="audio held before a conversation's first step")
    max_buffer_s: float = Field(default=4.0, gt=0.0, description="audio ahead of real time beyond this is refused")
    frame_budget_ms: float = Field(default=80.0, gt=0.0, description="one step's deadline: a frame's length")
    # admit while the predicted step stays under this share of the budget (above 1: steps predicted late are admitted)
    budget_headroom: float = Field(default=0.75, gt=0.0)
    text_temperature: float = Field(default=0.7, ge=0.0)
    audio_temperature: float = Field(default=0.8, ge=0.0)
    text_top_k: int = Field(default=25, ge=1)
    audio_top_k: int = Field(default=250, ge=1)
    seed: int = 0
    # the text stream's ids that write nothing: Moshi's padding between words and the
    # end of a padding run (Kyutai's models: 3 and 0; its servers skip both)
    text_pad_id: int = Field(default=3, ge=0)
    text_epad_id: int = Field(default=0, ge=0)


# SentencePiece's control pieces: the hub tokenizer (kmhf/hf-moshiko) declares only
# <unk> special, so the others are named here, as Kyutai's tokenizer has them
CONTROL_PIECES = ("<unk>", "<s>", "</s>", "<pad>")


def _least_squares(points: Mapping[int, float], x: int) -> float:
    xs, ys = list(points), list(points.values())
    if len(xs) == 1:  # one size measured: proportional to the batch (an upper bound while a step has fixed costs)
        return ys[0] * x / xs[0]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((a - mx) ** 2 for a in xs)
    slope = max(0.0, sum((a - mx) * (b - my) for a, b in zip(xs, ys, strict=True)) / sxx)
    return my + slope * (x - mx)


@dataclass
class StepTimes:
    """Step seconds by batch size: a moving average and a moving mean absolute
    deviation of each, and the prediction admission reads: the average plus `spread`
    deviations (a step that is fast on average but overruns now and then still
    overruns), at the size when it was measured within `stale_s`, else from a
    least-squares line through the sizes that were (a figure from long ago, say a size
    measured at start-up on a busier machine, gives way to what the steps show now).
    `now`: the clock's seconds (the frame clock's)."""

    alpha: float = 0.1
    spread: float = 3.0
    stale_s: float = 30.0
    by_size: dict[int, float] = field(default_factory=dict)
    dev: dict[int, float] = field(default_factory=dict)
    seen: dict[int, float] = field(default_factory=dict)

    def add(self, size: int, seconds: float, now: float = 0.0) -> None:
        self.seen[size] = now
        old = self.by_size.get(size)
        if old is None:
            self.by_size[size], self.dev[size] = seconds, 0.0
            return
        self.by_size[size] = old + self.alpha * (seconds - old)
        self.dev[size] = self.dev.get(size, 0.0) + self.alpha * (abs(seconds - old) - self.dev.get(size, 0.0))

    def seed(self, size: int, samples: list[float], now: float = 0.0) -> None:
        """A size's first figure from a few steps: their median and median deviation
        (one slow step among them does not decide the size)."""
        mid = float(np.median(samples))
        self.by_size[size], self.dev[size], self.seen[size] = mid, float(np.median(np.abs(np.asarray(samples) - mid))), now

    def upper(self, size: int) -> float:
        return self.by_size[size] + self.spread * self.dev.get(size, 0.0)

    def predict(self, size: int, now: float = 0.0) -> float | None:
        fresh = [n for n in self.by_size if now - self.seen.get(n, now) <= self.stale_s] or list(self.by_size)
        if size in fresh:
            return self.upper(size)
        return _least_squares({n: self.upper(n) for n in fresh}, size) if fresh else None


class Conversation:
    """One live conversation on the clock: its slot, its input buffer, its outputs."""

    def __init__(self, slot: int, seed: int, lead: int, max_samples: int) -> None:
        self.slot = slot
        self.seed = seed
        self.lead = lead
        self.max_samples = max_samples
        self.chunks: deque[np.ndarray] = deque()
        self.buffered = 0
        self.ready = False  # the user's audio has `lead` samples to spare: frames are taken from it
        self.fresh = True
        self.frames = 0
        self.late = 0
        self.silent_frames = 0  # frames fed silence because the user's audio was not there
        self.closing = False  # the user's audio ended: what is left is taken however short
        self.inflight = 0  # steps that took this conversation's audio and have not answered yet
        self.out: asyncio.Queue[dict[str, Any] | BaseException] = asyncio.Queue()

    def feed(self, pcm: np.ndarray) -> None:
        if self.buffered + len(pcm) > self.max_samples:
            raise StageError(
                f"the user's audio is {self.buffered / SAMPLE_RATE:.1f} s ahead of real time; at most "
                f"{self.max_samples / SAMPLE_RATE:.1f} s may wait (send audio in real time)"
            )
        if len(pcm):
            self.chunks.append(pcm)
            self.buffered += len(pcm)

    def take(self) -> np.ndarray:
        """The next frame of the user's audio, or silence (see the module docstring)."""
        if not self.ready and (self.buffered >= FRAME + self.lead or (self.closing and self.buffered > 0)):
            self.ready = True  # (the input ended: its tail goes out padded with silence)
        out = np.zeros(FRAME, np.float32)
        if not self.ready:
            self.silent_frames += 1
            return out
        got = 0
        while got < FRAME and self.chunks:
            c = self.chunks[0]
            n = min(FRAME - got, len(c))
            out[got : got + n] = c[:n]
            got += n
            if n == len(c):
                self.chunks.popleft()
            else:
                self.chunks[0] = c[n:]
        self.buffered -= got
        if got < FRAME:  # ran dry: wait for the lead again
            self.ready = False
        return out


class FrameClock:
    """Ticks every 80 ms while conversations are live; one batched step a tick."""

    def __init__(self, engine: StepEngine, sampling: Mapping[str, float], name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.sampling = {k: np.asarray(v, np.float32 if "temperature" in k else np.int64) for k, v in sampling.items()}
        self.name = name
        self.clock = clock
        self.live: dict[int, Conversation] = {}
        self.times = StepTimes()
        self.steps = 0
        self.late_steps = 0
        self._task: asyncio.Task[None] | None = None

    def add(self, conv: Conversation) -> None:
        self.live[conv.slot] = conv
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"moshi-clock-{self.name}")

    def remove(self, conv: Conversation) -> None:
        if self.live.get(conv.slot) is conv:
            del self.live[conv.slot]

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def item(self, conv: Conversation, pcm: np.ndarray) -> dict[str, np.ndarray]:
        return {"slot": np.asarray(conv.slot, np.int64), "pcm": pcm, "fresh": np.asarray(conv.fresh), "seed": np.asarray(conv.seed, np.int64), **self.sampling}

    async def step(self, convs: list[Conversation], record: bool = True) -> float:
        """One batched step of `convs`; their results go to their queues. The step's
        seconds (`record`: counted in the step times and the metrics)."""
        items = [self.item(c, c.take()) for c in convs]
        for c in convs:
            c.fresh = False
            c.inflight += 1
        started = self.clock()
        results = await asyncio.gather(*(self.engine.run(it, op="step", deadline=started + FRAME_S) for it in items), return_exceptions=True)
        took = self.clock() - started
        late = took > FRAME_S
        if record:
            self.steps += 1
            self.late_steps += late
            self.times.add(len(convs), took, self.clock())
            metrics.DUPLEX_STEP_SECONDS.labels(stage=self.name).observe(took)
        for c, r in zip(convs, results, strict=True):
            c.inflight -= 1
            c.frames += 1
            c.late += late
            if late:
                metrics.DUPLEX_FRAMES_LATE.labels(stage=self.name).inc()
            c.out.put_nowait(r if isinstance(r, BaseException) else {**r, "late": late})
        return took

    async def _run(self) -> None:
        due = self.clock()
        while self.live:
            await self.step(list(self.live.values()))
            due += FRAME_S
            now = self.clock()
            if now > due:  # the step overran its frame: the clock starts again from now
                due = now
            else:
                await asyncio.sleep(due - now)


def _tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # noqa: BLE001 - a broken tokenizer file raises anything from KeyError to a Rust panic
        raise StageError(f"{model_dir}: the text stream's tokenizer does not load ({type(exc).__name__}: {exc})") from None


class MoshiProcessor(StageProcessor):
    """The `moshi` stage (see the module docstring)."""

    REALTIME = True

    @staticmethod
    def torch_module(model_dir: str, role: str) -> Callable[[], Any]:
        return lambda: MoshiSteps.load(model_dir)

    @classmethod
    def check_model(cls, model_dir: str) -> None:
        path = Path(model_dir)
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise StageError(f"{model_dir}: no readable config.json ({exc})") from None
        archs = config.get("architectures") or []
        if ARCHITECTURE not in archs:
            raise StageError(f"{model_dir}: config.json names {archs or 'no architecture'}; the moshi stage loads {ARCHITECTURE} (transformers' format, e.g. kmhf/hf-moshiko)")
        checkpoint.check_mimi(model_dir, config.get("audio_encoder_config") or {}, "moshi")
        if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
            raise StageError(f"{model_dir}: no tokenizer for the text stream (tokenizer.json or tokenizer.model)")
        _tokenizer(model_dir)

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        self.args = MoshiArgs.parse(spec.processor_args, "moshi")
        self.steps = self.engine_as(StepEngine)
        assert spec.model is not None
        self.load_text(spec.model)
        self.max_sessions = self.args.max_sessions
        self.budget_s = self.args.frame_budget_ms / 1000.0 * self.args.budget_headroom
        sampling = self.args.model_dump(include={"text_temperature", "audio_temperature", "text_top_k", "audio_top_k"})
        self.clock = FrameClock(self.steps, sampling, spec.name)
        self._free = list(range(self.max_sessions))
        self._reserved: set[str] = set()  # admitted conversations whose request has not started yet
        self._seeds = self.args.seed

    def describe(self) -> dict[str, Any]:
        t = self.clock.times
        return {
            "sample_rate": SAMPLE_RATE, "frame_ms": FRAME_S * 1000, "max_sessions": self.max_sessions, "live": len(self.clock.live),
            "frame_budget_ms": self.args.frame_budget_ms, "admit_below_ms": round(self.budget_s * 1000, 2),
            "step_ms_by_batch": {str(k): round(v * 1000, 2) for k, v in sorted(t.by_size.items())},
            "steps": self.clock.steps, "late_steps": self.clock.late_steps,
        }

    async def start(self) -> None:
        """Before the first conversation: hold every slot's state (the slots' rings are
        allocated now, at `max_sessions`, not while conversations are live), then
        measure the step at each batch size in turn while it fits the admission budget,
        so that admission reads measured figures for every size it admits (each size's
        first step, which builds its kernels, is run and not counted). The scratch slots
        are reset by the first conversation that takes each."""
        n = self.max_sessions
        warm = [Conversation(slot, 0, 0, FRAME * 4) for slot in [n - 1, *range(n - 1)]]
        for size in range(1, n + 1):
            await self.clock.step(warm[:size], record=False)
            took = [await self.clock.step(warm[:size], record=False) for _ in range(WARM_STEPS)]
            self.clock.times.seed(size, took, self.clock.clock())
            for c in warm:
                c.fresh = True
                while not c.out.empty():
                    c.out.get_nowait()
            if self.clock.times.upper(size) > self.budget_s:
                break
        log.info("%s: step by batch size (ms) %s, admitting while under %.1f ms", self.spec.name, self.describe()["step_ms_by_batch"], self.budget_s * 1000)

    async def stop(self) -> None:
        await self.clock.stop()

    # ---- admission -----------------------------------------------------------------------
    def admit(self, key: str) -> None:
        """Reserve room for one more conversation under `key` or raise
        FrameBudgetExceeded. The request started with `params["reservation"] = key`
        takes the reservation over; `cancel(key)` gives it back when none starts."""
        live = len(self.clock.live) + len(self._reserved)
        if live >= self.max_sessions:
            raise FrameBudgetExceeded(live, None, self.budget_s, f"at its limit of {self.max_sessions} conversations (processor_args.max_sessions)")
        predicted = self.clock.times.predict(live + 1, self.clock.clock())
        if predicted is not None and predicted > self.budget_s and live > 0:
            raise FrameBudgetExceeded(live, predicted, self.budget_s)
        # the first conversation is admitted under the headroom's margin, but not when a
        # step of one conversation alone overruns the whole frame: it would hear nothing
        frame_s = self.args.frame_budget_ms / 1000.0
        if predicted is not None and predicted > frame_s and live == 0:
            raise FrameBudgetExceeded(0, predicted, frame_s, f"one conversation's step takes {predicted * 1000:.1f} ms, longer than the "
                                      f"{frame_s * 1000:.0f} ms frame: this model cannot run in real time on this device")
        self._reserved.add(key)

    def cancel(self, key: str) -> None:
        self._reserved.discard(key)

    def load_text(self, model_dir: str) -> None:
        self.text = TextStreams.load(model_dir, self.args.text_pad_id, self.args.text_epad_id)

    def text_stream(self) -> Callable[[int], str]:
        return self.text.stream()

    # ---- a conversation --------------------------------------------------------------------
    async def run(self, ctx: StageContext) -> None:
        key = ctx.params.get("reservation")
        if key is not None and str(key) not in self._reserved:
            self.admit(str(key))  # reserved on a replica that is gone: weighed here (CapacityExceeded)
        if not self._free:
            self._reserved.discard(str(key))
            raise StageError(f"no free conversation slot (max_sessions {self.max_sessions})")
        slot = self._free.pop(0)
        seed = int(ctx.params.get("seed", self._seeds))
        self._seeds += 1
        lead = int(self.args.jitter_ms / 1000 * SAMPLE_RATE)
        conv = Conversation(slot, seed, lead, int(self.args.max_buffer_s * SAMPLE_RATE))
        text_piece = self.text_stream()

        async def read() -> None:
            async for p in ctx.input():
                if p.kind == PayloadKind.AUDIO:
                    if int(p.meta.get("sample_rate", SAMPLE_RATE)) != SAMPLE_RATE:
                        raise StageError(f"the moshi stage takes {SAMPLE_RATE} Hz audio, got {p.meta.get('sample_rate')}")
                    conv.feed(np.asarray(p.arrays["pcm"], np.float32).reshape(-1))
            conv.closing = True

        reader = asyncio.get_running_loop().create_task(read())
        self.clock.add(conv)
        self._reserved.discard(str(ctx.params.get("reservation")))
        try:
            while True:
                if reader.done():
                    reader.result()  # an input error fails the request
                    # the input ended: its tail is stepped (padded), the steps in flight
                    # answered, then the conversation is over
                    if conv.buffered == 0 and not conv.inflight and conv.out.empty():
                        break
                    r = await conv.out.get()
                else:
                    getter = asyncio.ensure_future(conv.out.get())
                    done, _ = await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
                    if getter not in done:
                        getter.cancel()
                        continue
                    r = getter.result()
                if isinstance(r, BaseException):
                    raise StageError(f"moshi step failed: {r}")
                text = text_piece(int(r["text"]))
                await ctx.emit(Payload(
                    PayloadKind.AUDIO, ctx.fence, arrays={"pcm": np.ascontiguousarray(r["pcm"], np.float32)},
                    meta={"sample_rate": SAMPLE_RATE, "frame": conv.frames - 1, "text": text, "text_token": int(r["text"]), "late": bool(r["late"])},
                ))
            ctx.add_usage(frames=conv.frames, late_frames=conv.late, silent_frames=conv.silent_frames)
        finally:
            self.clock.remove(conv)
            self._free.append(slot)
            self._free.sort()
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)


class TextStreams:
    """The text stream's tokenizer and how a conversation's text tokens become text,
    as Kyutai's servers render them."""

    def __init__(self, tokenizer: Any, vocab: int, silent: set[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab = vocab
        self.silent = silent
        self._fast = getattr(tokenizer, "backend_tokenizer", None)

    @classmethod
    def load(cls, model_dir: str, pad_id: int, epad_id: int) -> TextStreams:
        """The ids that write nothing: the padding and end-of-padding ids, the config's
        pad, the tokenizer's special and control pieces (whether or not it names them),
        and ids past the text vocabulary (the stream's start token)."""
        tok = _tokenizer(model_dir)
        config = json.loads((Path(model_dir) / "config.json").read_text())
        vocab = int(config.get("vocab_size", len(tok)))
        silent = {pad_id, epad_id} | {i for i in (tok.pad_token_id, config.get("pad_token_id")) if i is not None}
        silent |= set(tok.all_special_ids)
        pieces = tok.get_vocab()
        silent |= {pieces[p] for p in CONTROL_PIECES if p in pieces}
        fast = getattr(tok, "backend_tokenizer", None)
        if fast is not None:
            silent |= {i for i, t in fast.get_added_tokens_decoder().items() if t.special}
        return cls(tok, vocab, silent)

    def stream(self) -> Callable[[int], str]:
        """One conversation's text: the silent ids write nothing, every other token the
        text it adds to the words so far, word spaces included (Kyutai's Rust server
        decodes [previous, token] and keeps the difference; tokenizers' DecodeStream
        does the same, byte-fallback pieces included). A tokenizer without a Rust
        backend renders pieces as Kyutai's Python server does (`id_to_piece`, "\u2581"
        as a space)."""
        silent, vocab = self.silent, self.vocab
        if self._fast is None:
            convert = self.tokenizer.convert_ids_to_tokens
            return lambda token: "" if token >= vocab or token in silent else str(convert(token)).replace("\u2581", " ")
        from tokenizers.decoders import DecodeStream

        fast = self._fast
        stream = DecodeStream(skip_special_tokens=True)

        def piece(token: int) -> str:
            nonlocal stream
            if token >= vocab or token in silent:
                return ""
            try:
                return stream.step(fast, token) or ""
            except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception ("Invalid prefix") once the bytes so far stop being UTF-8
                # a model may write byte-fallback pieces that never make a character:
                # the words so far are forgotten and this token starts the stream again
                stream = DecodeStream(skip_special_tokens=True)
                try:
                    return stream.step(fast, token) or ""
                except Exception:  # noqa: BLE001 - as above
                    stream = DecodeStream(skip_special_tokens=True)
                    return ""

        return piece


class FrameBudgetExceeded(CapacityExceeded):
    """One more conversation would not fit the frame: the caller refuses the session
    (`capacity`, 1013 / 429 with retry-after)."""

    def __init__(self, live: int, predicted_s: float | None, budget_s: float, why: str | None = None) -> None:
        self.live = live
        self.predicted_s = predicted_s
        self.budget_s = budget_s
        self.why = why or (
            f"with {live} conversation(s) live, one more would make each 80 ms frame's step take "
            f"{(predicted_s or 0) * 1000:.1f} ms (admitted while it stays under {budget_s * 1000:.1f} ms)"
        )
        super().__init__(self.why, live)
