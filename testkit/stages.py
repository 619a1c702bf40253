"""Stage processors that stand in for the model-backed ones in the harness.

Each one consumes and produces the same payloads as the real processor it replaces,
through the same engine contract, so protocol adapters, sessions and the orchestrator
run exactly as they do over real models. Outputs are deterministic:

- `FakeThinker` (thinker): one word `"w<token> "` per engine token; `seen` records
  what each request was given (messages, rows of speech: one per 40 ms of audio where
  the thinker takes audio itself, as the default profile's does).
  With tools and `tool_choice` `required` or a named function it calls that tool (the
  first for `required`) with arguments that satisfy its schema (`sample_arguments`),
  four characters per engine token, as the real thinker streams a call; `auto` never
  calls (as a random model would not). Its last payload says why it ended.
- `FakeTalker` (talker): `frames_per_word` codec frames per word of its text.
- the real `Code2WavProcessor` runs over `vocode` (`code2wav_fn`): a short tone per
  frame, 2048 samples, a pure function of the frame (stream = batch).
- `FakeFusedTalker` (talker_fused): text to PCM in one stage.
- `FakeAsr` (asr): per 30 s window of audio, one word `"w<token> "` per engine token
  (as many tokens as whole seconds in the window, at least one), as TEXT with the
  window's `segment`, `start`, `end`.
- `FakePolicy` (policy), `FakeWorld` (world_dit); the real
  `ImageProcessor` runs over `FakeDiffusionEngine`.
- `FakeMoshi` (moshi): the real frame clock, buffering and admission of
  `pipelines.moshi.MoshiProcessor` over `moshi_fn`: each frame's voice is the user's
  frame at half amplitude, and every fourth frame's text token writes `"w<frame> "`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import numpy as np

from omni_rt.engines.base import ArEngine, DiffusionEngine, Engine, StepEngine
from omni_rt.errors import StageError
from omni_rt.payloads import FINISH_REASON, TOOL_CALL, Payload, PayloadKind
from omni_rt.specs import StageSpec
from omni_rt.stage import StageContext, StageProcessor
from pipelines.moshi import MoshiProcessor
from pipelines.stt import SttProcessor

RATE = 24000
SAMPLES_PER_FRAME = 2048  # as SNAC 24 kHz: the real code2wav's framing
BLOCK_S = 0.04


def code2wav_fn(op: str | None, frames: np.ndarray) -> np.ndarray:
    """frames [F, 7] -> audio [F * 2048]: each frame a tone set by its first code."""
    t = np.arange(SAMPLES_PER_FRAME, dtype=np.float32) / RATE
    freq = 200.0 + (frames[:, 0].astype(np.float32) % 400)[:, None]
    return (0.2 * np.sin(2 * np.pi * freq * t[None, :])).astype(np.float32).reshape(-1)


class FakeThinker(StageProcessor):
    DEFAULT_MAX_TOKENS = 16

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        self.ar = self.engine_as(ArEngine)
        self.max_tokens = int(spec.processor_args.get("max_tokens", self.DEFAULT_MAX_TOKENS))
        self.seen: list[dict[str, Any]] = []

    async def run(self, ctx: StageContext) -> None:
        rows = 0
        said: list[str] = []
        if ctx.inputs:
            for p in await ctx.input().read_all():
                if p.kind == PayloadKind.TEXT and p.text:  # a cascade's transcript
                    said.append(p.text)
                if p.kind == PayloadKind.AUDIO:  # a thinker that takes audio: one row per 40 ms
                    block = int(int(p.meta.get("sample_rate", RATE)) * BLOCK_S)
                    rows += -(-p.arrays["pcm"].size // block)
        messages = list(ctx.params.get("messages") or [])  # empty: answered too, like the real thinker
        if said:
            from pipelines.voice import AUDIO_PLACEHOLDER, put_transcript

            if not any(AUDIO_PLACEHOLDER in str(m.get("content", "")) for m in messages):
                messages.append({"role": "user", "content": AUDIO_PLACEHOLDER})
            messages = put_transcript(messages, "".join(said).strip())
        self.seen.append({"request_id": ctx.request_id, "messages": messages, "audio_rows": rows, "params": dict(ctx.params)})
        words = sum(len(str(m.get("content", "")).split()) for m in messages)
        ctx.add_usage(input_tokens=words + rows, **({"input_audio_tokens": rows} if rows else {}))
        # one token per word (and the generation prompt's), so context limits count like a tokenizer's
        prompt = [len(w) % 1000 for m in messages for w in str(m.get("content", "")).split()] + [0]
        sampling: dict[str, Any] = {"max_tokens": int(ctx.params.get("max_output_tokens") or self.max_tokens)}
        if ctx.params.get("seed") is not None:
            sampling["seed"] = int(ctx.params["seed"])
        call = forced_call(ctx.params)
        sent = 0  # characters of the call's arguments out
        async for toks in self.ar.generate(f"{ctx.request_id}-thinker", prompt_token_ids=prompt, sampling=sampling):
            ctx.add_usage(output_tokens=len(toks))
            if call is None:
                await ctx.emit(Payload(PayloadKind.TEXT, ctx.fence, text="".join(f"w{t} " for t in toks)))
                continue
            name, args = call
            for _ in toks:  # a call: four characters of its JSON per token
                piece: dict[str, Any] = {"index": 0, "arguments": args[sent : sent + 4]}
                if sent == 0:
                    piece.update(id=f"call_{ctx.request_id[-12:]}", name=name)
                sent += 4
                await ctx.emit(Payload(PayloadKind.TEXT, ctx.fence, meta={TOOL_CALL: piece}))
                if sent >= len(args):
                    break
            if sent >= len(args):
                break
        # the fake runs to its token limit unless a call completes
        reason = "tool_calls" if call is not None and sent >= len(call[1]) else "length"
        await ctx.emit(Payload(PayloadKind.TEXT, ctx.fence, meta={FINISH_REASON: reason}))


def sample_arguments(schema: Mapping[str, Any] | None) -> Any:
    """A value that satisfies a (simple) JSON schema: what a grammar would let through."""
    schema = schema or {}
    if "enum" in schema:
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return sample_arguments(schema[key][0])
    t = schema.get("type", "object")
    t = t[0] if isinstance(t, list) else t
    if t == "object":
        props = schema.get("properties") or {}
        return {k: sample_arguments(v) for k, v in props.items() if k in (schema.get("required") or props)}
    if t == "array":
        return [sample_arguments(schema.get("items"))] * int(schema.get("minItems", 0))
    if t == "integer":
        return int(schema.get("minimum", 1))
    if t == "number":
        return float(schema.get("minimum", 1.5))
    if t == "boolean":
        return True
    if t == "null":
        return None
    return "w" * max(1, int(schema.get("minLength", 1)))


def forced_call(params: Mapping[str, Any]) -> tuple[str, str] | None:
    """The (name, arguments JSON) a forced tool_choice makes the fake call."""
    import json

    tools, choice = params.get("tools") or [], params.get("tool_choice", "auto")
    if tools and choice == "auto":
        # under auto the fake calls the first tool when a user or system message asks it
        # to ("<call>") and no tool result has come since: a test's stand-in for a model
        # deciding to call
        messages = list(params.get("messages") or [])
        asks = [i for i, m in enumerate(messages) if m.get("role") in ("user", "system") and "<call>" in str(m.get("content", ""))]
        if asks and not any(m.get("role") == "tool" for m in messages[asks[-1] + 1 :]):
            choice = {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
    if not tools or choice in ("auto", "none"):
        return None
    name = choice["function"]["name"] if isinstance(choice, Mapping) else tools[0]["function"]["name"]
    fn = next(t["function"] for t in tools if t["function"]["name"] == name)
    return name, json.dumps(sample_arguments(fn.get("parameters")))


class FakeTalker(StageProcessor):
    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        self.ar = self.engine_as(ArEngine)
        self.frames_per_word = int(spec.processor_args.get("frames_per_word", 1))

    async def frames(self, ctx: StageContext, text: str, n: int) -> Any:
        words = text.split()
        if not words:
            return
        ctx.add_usage(input_tokens=len(words))
        sampling: dict[str, Any] = {"max_tokens": len(words) * self.frames_per_word}
        if ctx.params.get("seed") is not None:
            sampling["seed"] = int(ctx.params["seed"]) + n
        async for toks in self.ar.generate(f"{ctx.request_id}-s{n}", prompt_token_ids=[len(text) % 1000], sampling=sampling):
            ctx.add_usage(output_tokens=len(toks))
            yield np.repeat(np.asarray(toks, np.int32)[:, None], 7, axis=1)

    async def run(self, ctx: StageContext) -> None:
        inp = ctx.input()
        start = n = 0

        async def speak(text: str) -> None:
            nonlocal start, n
            async for frames in self.frames(ctx, text, n):
                await ctx.emit(Payload(PayloadKind.CODES, ctx.fence, arrays={"frames": frames}, meta={"frame_start": start}))
                start += len(frames)
            n += 1

        if inp.mode == "client":  # the whole text at once (speech API)
            text = " ".join(p.text or "" for p in await inp.read_all())
            if not text.strip():
                raise StageError("empty input text")
            await speak(text)
        else:  # streamed by the thinker: spoken as it arrives
            async for p in inp:
                await speak(p.text or "")


class FakeFusedTalker(FakeTalker):
    """talker_fused: text in, PCM out (the codec frames decoded by the aux engine)."""

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        self.decoder = self.engine_as(StepEngine, "decoder")

    async def run(self, ctx: StageContext) -> None:
        text = " ".join(p.text or "" for p in await ctx.input().read_all())
        if not text.strip():
            raise StageError("empty input text")
        start = 0
        async for frames in self.frames(ctx, text, 0):
            pcm = await self.decoder.run(frames)
            await ctx.emit(Payload(PayloadKind.AUDIO, ctx.fence, arrays={"pcm": pcm}, meta={"sample_rate": RATE, "start_sample": start}))
            start += len(pcm)


LAYOUTS: dict[str, dict[str, Any]] = {
    "droid": {"images": ["observation/exterior_image_1_left", "observation/wrist_image_left"],
              "state": ["observation/joint_position", "observation/gripper_position"], "action_dim": 8, "action_horizon": 10},
    "aloha": {"images": ["images/cam_high"], "state": ["state"], "action_dim": 14, "action_horizon": 16},
}


class FakePolicy(StageProcessor):
    """policy: OBSERVATION in, ACTIONS [horizon, dim] out, `num_steps` engine steps per
    call; the episode (seed, step) in the session makes a rollout reproducible."""

    num_steps = 3

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        self.steps = self.engine_as(StepEngine)

    def metadata(self, layout: str | None) -> dict[str, Any]:
        name = layout or "droid"
        if name not in LAYOUTS:
            raise KeyError(f"unknown layout {name!r}; this policy serves: {', '.join(sorted(LAYOUTS))}")
        lay = LAYOUTS[name]
        return {"policy": "fake-policy", "layout": name, "layouts": sorted(LAYOUTS), "action_horizon": lay["action_horizon"],
                "action_dim": lay["action_dim"], "image_keys": lay["images"], "state_keys": lay["state"]}

    def new_episode(self, seed: int | None = None) -> dict[str, Any]:
        return {"seed": 0 if seed is None else int(seed), "step": 0, "prev": None}

    async def run(self, ctx: StageContext) -> None:
        lay = LAYOUTS[ctx.params.get("layout") or "droid"]
        episode = dict(ctx.params.get("episode") or self.new_episode())
        async for obs in ctx.input():
            missing = [k for k in (*lay["images"], *lay["state"]) if k not in obs.arrays]
            if missing:
                raise StageError(f"observation is missing {', '.join(repr(k) for k in missing)}")
            t0 = time.perf_counter()
            x = np.random.default_rng([int(episode["seed"]), int(episode["step"])]).standard_normal(
                (lay["action_horizon"], lay["action_dim"]), dtype=np.float32)
            for _ in range(self.num_steps):
                x = await self.steps.run(x, op="velocity")
            episode = {"seed": episode["seed"], "step": int(episode["step"]) + 1, "prev": None}
            await ctx.emit(Payload(PayloadKind.ACTIONS, ctx.fence, arrays={"actions": x.astype(np.float32)},
                                   meta={"episode": episode, "infer_ms": (time.perf_counter() - t0) * 1000}), last=True)


class FakeWorld(StageProcessor):
    """world_dit: one frame per request (progress per step, then the frame and its
    latents); `describe()` as the real world stage answers it."""

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        self.dit = self.engine_as(DiffusionEngine)

    def describe(self) -> dict[str, Any]:
        return {"action_dim": 4, "history_frames": 2, "default_size": 32, "default_steps": 2, "max_steps": 50,
                "size_multiple": self.dit.size_multiple}

    async def render(self, ctx: StageContext, frame: int, done: int, total: int, last: bool) -> np.ndarray:
        p = ctx.params
        job = SimpleNamespace(prompt=str(p.get("prompt") or ""), height=int(p["height"]), width=int(p["width"]),
                              steps=int(p.get("steps") or 2), seed=int(p.get("seed", 0)) + frame)
        async for ev in self.dit.generate(job):
            if ev["type"] == "progress":
                await ctx.emit(Payload(PayloadKind.IMAGE, ctx.fence, meta={"progress": done + ev["step"], "total": total}))
            elif ev["type"] == "image":
                await ctx.emit(Payload(PayloadKind.IMAGE, ctx.fence, arrays={"image": ev["image"], "latents": ev["latents"]},
                                       meta={"frame_index": frame}), last=last)
                latents: np.ndarray = ev["latents"]
                return latents
        raise StageError("the engine returned no frame")

    async def run(self, ctx: StageContext) -> None:
        action = np.asarray(ctx.params["action"], np.float32)
        if action.shape != (4,) or not np.isfinite(action).all():
            raise StageError("action must be 4 finite numbers")
        steps = int(ctx.params.get("steps") or 2)
        await self.render(ctx, int(ctx.params.get("frame_index", 0)), 0, steps, last=True)
        ctx.add_usage(frames=1, steps=steps)


class FakeAsr(StageProcessor):
    WINDOW_S = 30.0

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        self.ar = self.engine_as(ArEngine)
        self.seen: list[dict[str, Any]] = []

    def languages(self) -> list[str]:
        return ["de", "en", "es", "fr"]

    async def run(self, ctx: StageContext) -> None:
        chunks = [p for p in await ctx.input().read_all() if p.kind == PayloadKind.AUDIO]
        rate = int(chunks[0].meta.get("sample_rate", 16000)) if chunks else 16000
        pcm = np.concatenate([p.arrays["pcm"] for p in chunks]) if chunks else np.zeros(0, np.float32)
        self.seen.append({"params": dict(ctx.params), "seconds": len(pcm) / rate})
        win = int(self.WINDOW_S * rate)
        for i, lo in enumerate(range(0, max(len(pcm), 1), win)):
            part = pcm[lo : lo + win]
            n = max(1, int(len(part) / rate))
            async for toks in self.ar.generate(f"{ctx.request_id}-w{i}", prompt_token_ids=[n], sampling={"max_tokens": n, "seed": i}):
                ctx.add_usage(output_tokens=len(toks))
                meta = {"segment": i, "start": lo / rate, "end": (lo + len(part)) / rate}
                await ctx.emit(Payload(PayloadKind.TEXT, ctx.fence, text="".join(f"w{t} " for t in toks), meta=meta))


def stt_fn(op: str | None, x: Any) -> Any:
    """The fake streaming transcriber's step (`FakeStt`): per frame, the word token
    `100 + n` after every 5th loud frame (RMS over 0.02) of the slot's stream, else the
    pad token (3); `release` forgets the slot."""
    slot = int(x["slot"])
    if op == "release":
        _STT_LOUD.pop(slot, None)
        return {"released": np.asarray(True)}
    n = 0 if bool(x["fresh"]) else _STT_LOUD.get(slot, 0)
    pcm = np.asarray(x["pcm"], np.float32)
    if float(np.sqrt(np.mean(pcm * pcm))) > 0.02:
        n += 1
    _STT_LOUD[slot] = n
    word = 100 + n if n and n % 5 == 0 and float(np.sqrt(np.mean(pcm * pcm))) > 0.02 else 3
    return {"tokens": np.asarray([-1 if not bool(x["fresh"]) else 3, word], np.int64)}


_STT_LOUD: dict[int, int] = {}


class FakeStt(SttProcessor):
    """The real stt stage over `stt_fn`: its words are `w<token> `."""

    def load_text(self, model_dir: str) -> None:
        self.tokenizer = None

    def text(self, ids: list[int]) -> str:
        return "".join(f"w{t} " for t in ids if t >= 4)


def moshi_fn(op: str | None, x: Any) -> Any:
    """The fake full-duplex step (`FakeMoshi`): per item, the user's frame back at half
    amplitude; the text token is the slot's step count, kept here per slot."""
    slot = int(x["slot"])
    n = 0 if bool(x["fresh"]) else _MOSHI_FRAMES.get(slot, 0)
    _MOSHI_FRAMES[slot] = n + 1
    return {"pcm": np.asarray(x["pcm"], np.float32) * 0.5, "text": np.asarray(n, np.int64),
            "codes": np.zeros(8, np.int64), "user_codes": np.zeros(8, np.int64)}


_MOSHI_FRAMES: dict[int, int] = {}


class FakeMoshi(MoshiProcessor):
    def load_text(self, model_dir: str) -> None:
        pass

    def text_stream(self) -> Callable[[int], str]:
        return lambda token: f"w{token} " if token % 4 == 0 else ""
