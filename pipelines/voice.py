"""The `voice` pipeline: thinker (vLLM) -> talker -> code2wav (cascade: asr first).

- thinker: a model that hears audio itself (Qwen2.5-Omni, Qwen3-Omni: its own
  processor, chat template and audio tower), or a text chat LM after the asr (the
  cascade profile). Its prompt is the conversation (history, instructions, text turns
  from `params["messages"]`) with the current utterance at its `<|audio|>`
  placeholder. It streams TEXT deltas.
- talker, code2wav: the tts pipeline's stages (shared pools). The talker starts on
  the first phrase of the thinker's text; code2wav on the talker's first frames.

A text-only response names only `thinker` as its output; talker and code2wav never
start.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
from pydantic import Field

from omni_rt.engines.base import ArEngine, Engine
from omni_rt.payloads import AUDIO_PLACEHOLDER, FINISH_REASON, IMAGE_PLACEHOLDER, TALKER_PROMPT, TOOL_CALL, Payload, PayloadKind
from omni_rt.specs import StageSpec
from omni_rt.stage import SamplingArgs, StageContext, StageError, StageProcessor
from pipelines import checkpoint
from pipelines.checkpoint import architectures, check_tokenizer_files
from pipelines.tokenizing import SegmentEncoder, rust_tokenizer
from pipelines.tools import DEFAULT_MAX_WHITESPACE, ToolCalling, ToolStream, default_parser, is_tool_request, template_messages
from pipelines.tts import checkpoint_sampling

# ---- thinker ----------------------------------------------------------------------------


# Architectures (config.json) whose vLLM model takes audio itself, through the model's
# own processor: Qwen2.5-Omni and Qwen3-Omni (vLLM serves their thinkers and skips the
# talker, token2wav / code2wav).
NATIVE_AUDIO_ARCHITECTURES = frozenset({"Qwen2_5OmniForConditionalGeneration", "Qwen2_5OmniModel", "Qwen3OmniMoeForConditionalGeneration"})
NATIVE_RATE = 16000  # what their feature extractors take


_MEDIA = re.compile(f"({re.escape(AUDIO_PLACEHOLDER)}|{re.escape(IMAGE_PLACEHOLDER)})")


def native_messages(messages: Sequence[Mapping[str, Any]], with_audio: bool) -> list[dict[str, Any]]:
    """Conversation messages as a multimodal chat template takes them: the latest
    `<|audio|>` (the utterance whose audio is given) becomes an audio content part;
    older placeholders (audio not kept, no transcript) are left out. Every `<|image|>`
    becomes an image content part (the request's images, in order)."""
    spot = None
    if with_audio:
        for i in range(len(messages) - 1, -1, -1):
            if AUDIO_PLACEHOLDER in str(messages[i].get("content", "")):
                spot = i
                break
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        content = str(m.get("content") or "")
        if AUDIO_PLACEHOLDER not in content and IMAGE_PLACEHOLDER not in content:
            out.append({**m, "role": m.get("role", "user"), "content": content})  # tool_calls, tool_call_id kept
            continue
        pieces = _MEDIA.split(content)
        last_audio = max(j for j, p in enumerate(pieces) if p == AUDIO_PLACEHOLDER) if AUDIO_PLACEHOLDER in pieces else -1
        parts: list[dict[str, Any]] = []
        for j, piece in enumerate(pieces):
            if piece == IMAGE_PLACEHOLDER:
                parts.append({"type": "image"})
            elif piece == AUDIO_PLACEHOLDER:
                if i == spot and j == last_audio:
                    parts.append({"type": "audio"})
            elif piece.strip():
                parts.append({"type": "text", "text": piece.strip()})
        out.append({"role": m.get("role", "user"), "content": parts or [{"type": "text", "text": ""}]})
    return out


def feature_pad(samples: int, n_fft: int, hop: int) -> int:
    """Where a Whisper-style feature extractor may stop padding `samples` of audio: just
    past its last STFT window, a whole number of hops (the audio's frames are the same as
    with the checkpoint's full padding, since only zeros follow them)."""
    return -(-(samples + n_fft) // hop) * hop


class ThinkerArgs(SamplingArgs):
    """The thinker's processor_args: sampling (over the checkpoint's
    generation_config.json), the answer's budget, function calling, the omni talker's
    feed and the default system turn."""

    temperature: float = Field(default=0.7, ge=0.0)
    max_tokens: int = Field(default=64, ge=1)
    # the stop token is masked until this many tokens are out (a voice agent that
    # answers nothing is never what a caller wants)
    min_tokens: int = Field(default=1, ge=0)
    # vLLM's tool-call parser (None: the family's, `pipelines.tools`; "none": no function calling)
    tool_parser: str | None = None
    # vLLM's --tool-strict-level ("parameter": every call's arguments satisfy its schema)
    tool_strict_level: Literal["auto", "function", "parameter"] = "parameter"  # pipelines.tools.STRICT_LEVELS
    # consecutive whitespace inside a call's JSON (None: unbounded)
    tool_max_whitespace: int | None = Field(default=DEFAULT_MAX_WHITESPACE, ge=0)
    # the token budget of an answer that may call a tool, when the request sets none (a
    # call's JSON takes more tokens than a short spoken answer)
    tool_max_tokens: int = Field(default=256, ge=1)
    # the talker conditions on this thinker's own states (the omni profile,
    # `pipelines.omni`): the prompt's token ids and audio go out first, and every text
    # delta carries its token ids
    talker_states: bool = False
    # the system turn of a conversation that has none (None: the chat template's own
    # default; the omni profile sets the one Qwen2.5-Omni's model card requires for
    # speech output)
    system_prompt: str | None = None


class ThinkerProcessor(StageProcessor):
    """Chat text (+ the user's speech) -> streamed text (TEXT deltas).

    What the user said arrives in the form the profile gives it:

    * AUDIO (any rate): a model that takes audio itself (`NATIVE_AUDIO_ARCHITECTURES`,
      the default profile): the prompt is rendered by the checkpoint's own processor
      and chat template with the audio as a content part, and vLLM runs the model's
      audio tower on it (`multi_modal_data`);
    * TEXT: a transcript (the cascade profile: asr -> any text chat LM), put where the
      utterance's placeholder is.
    """

    @classmethod
    def check_model(cls, model_dir: str) -> None:
        arch = architectures(model_dir)
        if not arch:
            raise StageError(f"thinker {model_dir}: config.json missing or without architectures")
        check_tokenizer_files(model_dir, "thinker", chat=True)
        if NATIVE_AUDIO_ARCHITECTURES & set(arch):
            if not checkpoint.config(model_dir, "preprocessor_config.json").get("feature_extractor_type"):
                raise StageError(f"thinker {model_dir}: {arch[0]} needs its processor files (preprocessor_config.json with a feature extractor)")
        elif not any(a.endswith("ForCausalLM") for a in arch):
            raise StageError(
                f"thinker {model_dir}: architecture {arch[0]} is neither a chat LM (…ForCausalLM) nor one whose audio "
                f"input the thinker supports ({', '.join(sorted(NATIVE_AUDIO_ARCHITECTURES))})"
            )

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        self.ar = self.engine_as(ArEngine)
        assert spec.model is not None
        self.args = ThinkerArgs.parse(spec.processor_args, "thinker", under=checkpoint_sampling(spec.model))
        self.native = bool(NATIVE_AUDIO_ARCHITECTURES & set(architectures(spec.model)))
        self.omni3 = "Qwen3OmniMoeForConditionalGeneration" in architectures(spec.model)
        self.tokenizer: Any = None
        self.processor: Any = None
        self.n_fft = self.hop = 0
        self.max_samples = 0
        self.max_images = 0
        self.mm_kwargs: dict[str, Any] = {}
        self._fast: Any = None
        self._segments: SegmentEncoder | None = None
        self.tool_calling: ToolCalling | None = None

    def _load(self) -> None:
        from transformers import AutoTokenizer

        assert self.spec.model is not None
        if self.native:
            from transformers import AutoProcessor

            from omni_rt.vllm_plugin import register

            register()  # what vLLM's processes get from the plugin, here too
            self.processor = AutoProcessor.from_pretrained(self.spec.model)
            self.tokenizer = self.processor.tokenizer
            fe = self.processor.feature_extractor
            self.n_fft, self.hop, self.max_samples = int(fe.n_fft), int(fe.hop_length), int(fe.n_samples)
            self.max_images = int((self.spec.engine_args.get("limit_mm_per_prompt") or {}).get("image", 0) or 0)
            self.mm_kwargs = dict(self.spec.engine_args.get("mm_processor_kwargs") or {})
        else:
            self.tokenizer = AutoTokenizer.from_pretrained(self.spec.model)
        self.audio_id = self.tokenizer.convert_tokens_to_ids(AUDIO_PLACEHOLDER)
        self.stop_ids = [i for i in {self.tokenizer.eos_token_id, self.tokenizer.convert_tokens_to_ids("<|endoftext|>")} if i is not None]
        self.text_ranges = text_ranges(self.tokenizer)
        self.text_vocab = self.text_ranges[-1][1]  # past the last text id
        self._fast = rust_tokenizer(self.tokenizer)
        self._segments = SegmentEncoder.for_tokenizer(self._fast) if self._fast is not None else None
        parser = self.args.tool_parser or default_parser(checkpoint.config(self.spec.model).get("model_type"))
        if parser != "none":
            self.tool_calling = ToolCalling(self.tokenizer, parser, self.args.tool_strict_level, self.args.tool_max_whitespace)

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    def render(self, messages: Sequence[Mapping[str, Any]], with_audio: bool = False, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text, by the checkpoint's own chat template (with the tools
        offered to the model, and the calls and their results in the history)."""
        extra = {"tools": list(tools)} if tools else {}
        if self.native:
            msgs = native_messages(template_messages(messages), with_audio)
            return str(self.processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **extra))
        return str(self.tokenizer.apply_chat_template(template_messages(messages), add_generation_prompt=True, tokenize=False, **extra))

    def encode(self, text: str) -> list[int]:
        if self._segments is not None:
            return self._segments.encode(text)
        if self._fast is not None:  # the Rust tokenizer itself: same ids, less Python per call
            return list(self._fast.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]], with_audio: bool = False, tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        return self.encode(self.render(messages, with_audio, tools))

    def decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return str(self._fast.decode(ids, skip_special_tokens=True))
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def audio_prompt(self, pcm: np.ndarray) -> dict[str, Any]:
        """The engine inputs for the user's speech (16 kHz float32): vLLM's
        `multi_modal_data`, and the feature extractor padding to just past the audio
        (its checkpoint pads to `n_samples`, 300 s for Qwen2.5-Omni; the frames of the
        audio are bit-identical either way, since only zeros follow them, and the
        padded frames are masked, but the extractor's cost follows the padded length)."""
        if len(pcm) > self.max_samples:
            raise StageError(f"the user's audio is {len(pcm) / NATIVE_RATE:.1f} s; the model takes at most {self.max_samples / NATIVE_RATE:.0f} s")
        pad = min(self.max_samples, feature_pad(len(pcm), self.n_fft, self.hop))
        return {"multi_modal_data": {"audio": (pcm, NATIVE_RATE)}, "mm_processor_kwargs": {"audio_kwargs": {"max_length": pad}}}

    def audio_tokens(self, samples: int) -> int:
        """How many audio tokens the model's audio tower makes of `samples` (its
        processor's rule). Qwen2.5-Omni: feature frames, halved by the conv, pooled by 2;
        Qwen3-Omni: windows of 100 frames make 13 tokens each, the rest three stride-2 convs."""
        frames = -(-samples // self.hop)
        if self.omni3:
            rest = frames % 100
            return (((rest - 1) // 2 + 1 - 1) // 2 + 1 - 1) // 2 + 1 + (frames // 100) * 13
        return ((frames - 1) // 2 + 1 - 2) // 2 + 1

    def tool_stream(self, params: Mapping[str, Any]) -> ToolStream | None:
        """The request's tool parser and grammar (None: no tools, or tool_choice none)."""
        if not is_tool_request(params):
            return None
        if self.tool_calling is None:
            raise StageError(f"thinker {self.spec.model}: function calling is off for this stage (processor_args.tool_parser: none)")
        return self.tool_calling.stream(params)

    def sampling(self, params: Mapping[str, Any], tools: ToolStream | None = None) -> dict[str, Any]:
        """The engine sampling of one response (request params over the stage's)."""
        a = self.args
        max_tokens = int(params.get("max_output_tokens") or (a.tool_max_tokens if tools is not None else a.max_tokens))
        temperature, top_p = params.get("temperature"), params.get("top_p")
        sampling: dict[str, Any] = {
            "temperature": float(a.temperature if temperature is None else temperature),
            "top_p": float(a.top_p if top_p is None else top_p),
            "top_k": a.top_k,
            "repetition_penalty": a.repetition_penalty,
            "max_tokens": max_tokens,
            "min_tokens": min(a.min_tokens, max_tokens),
            "stop_token_ids": self.stop_ids,
            # text tokens and the stop tokens only: never a chat control token
            "allowed_token_ranges": [*self.text_ranges, *([s, s + 1] for s in self.stop_ids)],
        }
        if tools is not None:
            assert self.tool_calling is not None
            # the parser's call markers are control tokens in some vocabularies
            sampling["allowed_token_ranges"] += [[t, t + 1] for t in self.tool_calling.marker_ids if not any(lo <= t < hi for lo, hi in self.text_ranges)]
            if tools.structured_outputs is not None:
                sampling["structured_outputs"] = tools.structured_outputs
            if tools.forced:  # the grammar ends the answer after the call(s): the stop must not be masked
                sampling["min_tokens"] = 0
        if params.get("seed") is not None:
            sampling["seed"] = int(params["seed"])
        return sampling

    async def _speech(self, ctx: StageContext) -> tuple[np.ndarray | None, str | None]:
        """What the user said, as this request's inputs give it: (16 kHz audio,
        transcript)."""
        if not ctx.inputs:
            return None, None
        pcm: list[np.ndarray] = []
        rate: int | None = None
        text: list[str] = []
        for p in await ctx.input().read_all():
            if p.kind == PayloadKind.AUDIO:
                r = int(p.meta.get("sample_rate", 24000))
                if rate is not None and r != rate:
                    raise StageError(f"audio sample rate changed mid-utterance ({rate} -> {r})")
                rate = r
                pcm.append(np.asarray(p.arrays["pcm"], np.float32).reshape(-1))
            elif p.kind == PayloadKind.TEXT and p.text:
                text.append(p.text)
        audio = None
        if pcm:
            if not self.native:
                raise StageError(f"thinker {self.spec.model} takes no audio (a text chat LM: serve it in the cascade profile, after asr)")
            audio = np.concatenate(pcm)
            if rate != NATIVE_RATE:
                import soxr

                audio = await asyncio.to_thread(soxr.resample, audio, rate, NATIVE_RATE)
        return audio, ("".join(text).strip() if text else None)

    def images(self, urls: Sequence[str], states: bool) -> tuple[list[Any], int, dict[str, np.ndarray]]:
        """The request's images (data URLs) for the engine (RGB PIL images), how many
        tokens they make (the model's image processor's grid, merged), and, for a talker
        that recomputes the thinker's states, the processor's `pixel_values` and
        `image_grid_thw`."""
        from media.images import ImageError, open_data_url

        if not self.native:
            raise StageError(f"thinker {self.spec.model} takes no images (a text chat LM)")
        if len(urls) > self.max_images:
            raise StageError(f"the prompt has {len(urls)} images; this thinker takes at most {self.max_images} "
                             "(engine_args.limit_mm_per_prompt.image)")
        try:
            pil = [open_data_url(u) for u in urls]
        except ImageError as exc:
            raise StageError(f"an image of the prompt {exc}") from None
        ip = self.processor.image_processor
        # sized as vLLM's processor sizes them (the stage's engine_args.mm_processor_kwargs)
        out = ip(images=pil, return_tensors="np", **self.mm_kwargs)
        grid = np.asarray(out["image_grid_thw"], np.int64)
        n = int(grid.prod(-1).sum()) // int(ip.merge_size) ** 2
        arrays: dict[str, np.ndarray] = {"pixel_values": np.asarray(out["pixel_values"], np.float32), "image_grid_thw": grid} if states else {}
        return pil, n, arrays

    async def run(self, ctx: StageContext) -> None:
        audio, transcript = await self._speech(ctx)
        messages = self.conversation(ctx.params)
        urls = list(ctx.params.get("images") or ())
        pil: list[Any] = []
        n_image, image_arrays = 0, dict[str, np.ndarray]()
        if urls:
            pil, n_image, image_arrays = await asyncio.to_thread(self.images, urls, self.args.talker_states)
        heard = audio is not None or transcript is not None
        if heard and not any(AUDIO_PLACEHOLDER in str(m.get("content", "")) for m in messages):
            messages.append({"role": "user", "content": AUDIO_PLACEHOLDER})
        if transcript is not None:  # the cascade: the transcript goes where the utterance is
            messages = put_transcript(messages, transcript)
        tools = self.tool_stream(ctx.params)
        offered = ctx.params.get("tools") if tools is not None else None  # tool_choice none: not offered
        prompt: dict[str, Any]
        if audio is not None:
            # native audio: token ids with the model's audio placeholder, the audio
            # itself beside them (vLLM's processor expands the placeholder)
            # rendered in a thread: a chat template's first render compiles it (pure Python,
            # tens of ms), and the loop paces every session's audio
            ids = await asyncio.to_thread(self.prompt_ids, messages, True, offered)
            n_audio = self.audio_tokens(len(audio))
            prompt, n_in = {"prompt_token_ids": ids, **self.audio_prompt(audio)}, len(ids) - 1 + n_audio
            ctx.add_usage(input_audio_tokens=n_audio)
        else:
            # text only: token ids, the engine's fast path
            ids = await asyncio.to_thread(self.prompt_ids, messages, False, offered)
            prompt, n_in = {"prompt_token_ids": ids}, len(ids)
        if pil:
            # images the same way: one placeholder token each, expanded by vLLM's processor
            prompt["multi_modal_data"] = {**prompt.get("multi_modal_data", {}), "image": pil}
            n_in += n_image - len(pil)
            ctx.add_usage(input_image_tokens=n_image)
        sampling = self.sampling(ctx.params, tools)
        ctx.add_usage(input_tokens=n_in)
        states = self.args.talker_states
        if states:
            arrays = {"prompt_ids": np.asarray(prompt.get("prompt_token_ids", ()), np.int64)}
            if audio is not None:
                arrays["audio"] = audio
            arrays.update(image_arrays)
            await ctx.emit(Payload(PayloadKind.TEXT, ctx.fence, arrays=arrays, meta={TALKER_PROMPT: True}))
        detok = self.detokenizer()
        n_out, last = 0, None
        async for toks in self.ar.generate(f"{ctx.request_id}-thinker", sampling=sampling, **prompt):
            ctx.add_usage(output_tokens=len(toks))
            n_out, last = n_out + len(toks), toks[-1] if toks else last
            text_ids = [t for t in toks if t not in self.stop_ids]
            delta = detok(text_ids)
            await emit_answer(ctx, tools, delta, text_ids, with_ids=states)
        await emit_answer(ctx, tools, "", [], finished=True)
        length = n_out >= sampling["max_tokens"] and last not in self.stop_ids
        await emit_finish(ctx, tools, length)

    def conversation(self, params: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        """The request's messages, with the stage's `system_prompt` where they have no
        system turn (an empty conversation is one empty user turn: OpenAI greets, and
        chat templates refuse an empty list)."""
        messages: list[Mapping[str, Any]] = list(params.get("messages") or []) or [{"role": "user", "content": ""}]
        system = self.args.system_prompt
        if system and not any(m.get("role") in ("system", "developer") for m in messages):
            messages.insert(0, {"role": "system", "content": str(system)})
        return messages

    def detokenizer(self) -> Callable[[list[int]], str]:
        """Text deltas of a growing token sequence, decoded incrementally: each token is
        decoded once (tokenizers' DecodeStream), and text that ends inside an
        incomplete UTF-8 sequence waits for the next token. A tokenizer without a Rust
        backend re-decodes the whole output each time (quadratic; slow tokenizers only)."""
        if self._fast is not None:
            from tokenizers.decoders import DecodeStream

            stream, fast = DecodeStream(skip_special_tokens=True), self._fast

            def step(ids: list[int]) -> str:
                return "".join(p for p in (stream.step(fast, t) for t in ids) if p)

            return step
        out_ids: list[int] = []
        sent = ""

        def whole(ids: list[int]) -> str:
            nonlocal sent
            out_ids.extend(ids)
            text = self.decode(out_ids)
            if text.endswith("\ufffd"):
                return ""  # an incomplete UTF-8 sequence: wait for the next token
            delta, sent = text[len(sent) :], text
            return delta

        return whole


async def emit_answer(ctx: StageContext, tools: ToolStream | None, delta: str, ids: list[int], *, finished: bool = False,
                      with_ids: bool = False) -> None:
    """A text delta of the answer: as it is (with its token ids, `with_ids`), or
    through the request's tool parser (content as TEXT, each piece of a call as a TEXT
    payload with `meta["tool_call"]`; a talker re-encodes content pieces)."""
    if tools is None:
        if delta or (with_ids and ids):
            arrays = {"token_ids": np.asarray(ids, np.int64)} if with_ids else {}
            await ctx.emit(Payload(PayloadKind.TEXT, ctx.fence, text=delta, arrays=arrays))
        return
    for kind, piece in tools.feed(delta, ids, finished):
        if kind == "text":
            await ctx.emit(Payload(PayloadKind.TEXT, ctx.fence, text=piece))
        else:
            await ctx.emit(Payload(PayloadKind.TEXT, ctx.fence, meta={TOOL_CALL: piece}))


async def emit_finish(ctx: StageContext, tools: ToolStream | None, length: bool) -> None:
    """Why the answer ended (OpenAI's finish_reason), as the stage's last payload."""
    reason = "length" if length else "tool_calls" if tools is not None and tools.calls else "stop"
    await ctx.emit(Payload(PayloadKind.TEXT, ctx.fence, meta={FINISH_REASON: reason}))


def text_ranges(tokenizer: Any) -> list[list[int]]:
    """The ids a thinker may sample as text, as [lo, hi) ranges: the tokenizer's ids but
    its added tokens (chat control tokens, markers) and its special tokens, wherever
    they are (the Qwen and Llama 3 vocabularies put them after the text; SentencePiece
    ones put <unk>, <s>, </s> at 0..2, where "everything below the first special id" was
    nothing at all)."""
    n = len(tokenizer)
    excluded = {int(i) for i in tokenizer.all_special_ids} | {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
    ranges: list[list[int]] = []
    lo = 0
    for i in [*sorted(x for x in excluded if 0 <= x < n), n]:
        if i > lo:
            ranges.append([lo, i])
        lo = i + 1
    if not ranges:
        raise StageError("the tokenizer has no text tokens (every id is special or added)")
    return ranges


def put_transcript(messages: list[Mapping[str, Any]], transcript: str) -> list[Mapping[str, Any]]:
    """The latest `<|audio|>` replaced by what was heard (older ones, whose audio is
    not kept, are dropped)."""
    out: list[Mapping[str, Any]] = []
    spot = max(i for i, m in enumerate(messages) if AUDIO_PLACEHOLDER in str(m.get("content", "")))
    for i, m in enumerate(messages):
        content = str(m.get("content", ""))
        if AUDIO_PLACEHOLDER in content:
            head, _, tail = content.rpartition(AUDIO_PLACEHOLDER)
            said = transcript if i == spot else ""
            content = " ".join(p for p in (head.replace(AUDIO_PLACEHOLDER, "").strip(), said, tail.strip()) if p)
        out.append({**m, "content": content})
    return out
