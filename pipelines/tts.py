"""The `tts` pipeline: talker (codec LM on vLLM) -> code2wav (SNAC decoder on torch).

Split profile: two stages joined by a `codes` edge (chunk or batch). Fused profile: one
stage whose talker owns the decoder. Both use the same pieces below, so they produce
the same audio for the same seed.

Token layout is Orpheus's (7 codec tokens per SNAC frame), so real Orpheus + SNAC
weights drop in by pointing the stages' `model` at their directories.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import Field

from omni_rt.engines.base import ArEngine, Engine, StepEngine
from omni_rt.payloads import Payload, PayloadKind
from omni_rt.specs import ChunkingSpec, StageSpec
from omni_rt.stage import SamplingArgs, StageContext, StageError, StageProcessor
from pipelines import checkpoint
from pipelines.codec import (
    CodecLayout,
    FrameAssembler,
    frames_to_codes,
    load_snac,
    orpheus_prompt_ids,
)
from pipelines.streaming import AudioEmitter, DecodeTimes, StreamingDecoder

# ---- talker ---------------------------------------------------------------------------


def split_text(text: str, max_chars: int) -> list[str]:
    """Split long input at sentence (then word) boundaries into segments <= max_chars.

    A codec LM is trained on utterance-length prompts and its context is bounded, so
    long input is spoken segment by segment rather than cut off.
    """
    text = " ".join(text.split())
    if len(text) <= max_chars:
        return [text] if text else []
    sentences = re.split(r"(?<=[.!?;:])\s+", text)
    segments: list[str] = []
    cur = ""
    for sent in sentences:
        while len(sent) > max_chars:
            cut = sent.rfind(" ", 0, max_chars)
            cut = cut if cut > 0 else max_chars
            head, sent = sent[:cut].strip(), sent[cut:].strip()
            if cur:
                segments.append(cur)
                cur = ""
            segments.append(head)
        if cur and len(cur) + 1 + len(sent) > max_chars:
            segments.append(cur)
            cur = sent
        else:
            cur = f"{cur} {sent}".strip()
    if cur:
        segments.append(cur)
    return segments


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")


def checkpoint_sampling(model_dir: str) -> dict[str, Any]:
    """Sampling defaults a checkpoint ships in generation_config.json (HF convention)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    cfg = json.loads(path.read_text())
    out = {k: cfg[k] for k in SAMPLING_KEYS if cfg.get(k) is not None}
    if out.get("top_k") == 0:
        out["top_k"] = -1  # HF's "off" is 0, vLLM's is -1
    return out


class TalkerArgs(SamplingArgs):
    """The codec talker's processor_args. Sampling: Orpheus's recommended values, under
    the checkpoint's generation_config.json, under these args."""

    temperature: float = Field(default=0.6, ge=0.0)
    top_p: float = Field(default=0.8, gt=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.3, gt=0.0)
    # Upper bound on generated tokens: per input character plus a base, capped. A
    # trained model stops at end-of-speech long before; a random one never does.
    tokens_per_char: int = Field(default=7, ge=1)
    base_tokens: int = Field(default=28, ge=0)
    max_tokens: int = Field(default=2800, ge=1)
    max_chars_per_segment: int = Field(default=300, ge=1)
    publish_frames: int = Field(default=1, ge=1, description="frames gathered before they are published")
    chunking: ChunkingSpec | None = None  # the fused stage's own decoder chunking (a split profile's is its edge's)


class CodecTalker:
    """Prompt building and codec-frame generation over a vLLM engine.

    Sampling: processor_args override the checkpoint's generation_config.json, which
    overrides Orpheus's recommended values below.
    """

    def __init__(self, model_dir: str, args: Mapping[str, Any]) -> None:
        self.args = TalkerArgs.parse(args, "talker", under=checkpoint_sampling(model_dir))
        self.model_dir = model_dir
        self.layout = CodecLayout.load(model_dir)
        self.tokenizer: Any = None
        lay = self.layout
        # Only audio tokens and end-of-speech may be sampled. As ranges, not a 30k-id
        # list: the engine masks ranges without building a per-request id set.
        self._allowed = [[lay.audio_token_offset, lay.audio_token_end], [lay.end_of_speech, lay.end_of_speech + 1]]

    def load(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)

    def prompt_ids(self, text: str, voice: str) -> list[int]:
        return orpheus_prompt_ids(self.tokenizer, text, self.layout, voice)

    def sampling(self, text: str, params: Mapping[str, Any], segment: int) -> dict[str, Any]:
        a = self.args
        max_tokens = min(a.max_tokens, a.base_tokens + a.tokens_per_char * len(text))
        s: dict[str, Any] = {
            **a.sampling(),
            "max_tokens": max_tokens,
            "stop_token_ids": [self.layout.end_of_speech],
            "allowed_token_ranges": self._allowed,
        }
        if params.get("seed") is not None:
            s["seed"] = int(params["seed"]) + segment
        return s

    async def frames(self, ctx: StageContext, engine: ArEngine, text: str, phrase: int = 0) -> AsyncIterator[np.ndarray]:
        """Yield int32 code frames [k, 7] as the engine produces them. `phrase` numbers
        the pieces of a streamed text (request ids and seeds stay distinct)."""
        request_id, params = ctx.request_id, ctx.params
        voice = str(params.get("voice", "tara"))
        publish = self.args.publish_frames
        for j, segment in enumerate(split_text(text, self.args.max_chars_per_segment)):
            i = j if phrase == 0 else phrase * 1000 + j
            assembler = FrameAssembler(self.layout)
            pending: list[np.ndarray] = []
            n_pending = 0
            prompt = self.prompt_ids(segment, voice)
            ctx.add_usage(input_tokens=len(prompt))
            async for toks in engine.generate(f"{request_id}-s{i}", prompt_token_ids=prompt, sampling=self.sampling(segment, params, i)):
                ctx.add_usage(output_tokens=len(toks))
                frames = assembler.push(toks)
                if len(frames):
                    pending.append(frames)
                    n_pending += len(frames)
                    if n_pending >= publish:
                        yield np.concatenate(pending).astype(np.int32)
                        pending, n_pending = [], 0
            if pending:
                yield np.concatenate(pending).astype(np.int32)


async def _input_text(ctx: StageContext) -> str:
    parts = [p.text or "" for p in await ctx.input().read_all()]
    text = " ".join(t for t in parts if t).strip()
    if not text:
        raise StageError("empty input text")
    return text


class TalkerProcessor(StageProcessor):
    """Split profile, stage 1: text -> codec frames (published as CODES chunks)."""

    @classmethod
    def check_model(cls, model_dir: str) -> None:
        checkpoint.check_architecture(model_dir, "talker", "a causal LM (…ForCausalLM, e.g. Orpheus' LlamaForCausalLM)", lambda a: a.endswith("ForCausalLM"))
        checkpoint.check_tokenizer_files(model_dir, "talker")

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        self.ar = self.engine_as(ArEngine)
        assert spec.model is not None
        self.talker = CodecTalker(spec.model, spec.processor_args)

    async def start(self) -> None:
        await asyncio.to_thread(self.talker.load)

    async def run(self, ctx: StageContext) -> None:
        start = 0
        inp = ctx.input()
        # From the client the whole text arrives at once; from an upstream stage (a
        # thinker) it streams, and each phrase is spoken as soon as it is complete.
        texts = [await _input_text(ctx)] if inp.mode == "client" else phrases(inp)
        seg = 0
        async for text in _aiter(texts):
            async for frames in self.talker.frames(ctx, self.ar, text, seg):
                await ctx.emit(Payload(PayloadKind.CODES, ctx.fence, arrays={"frames": frames}, meta={"frame_start": start}))
                start += len(frames)
            seg += 1


async def _aiter(items: Any) -> AsyncIterator[str]:
    if hasattr(items, "__aiter__"):
        async for x in items:
            yield x
    else:
        for x in items:
            yield x


_PHRASE_END = re.compile(r"[.!?;:,]\s")


async def phrases(
    inp: AsyncIterable[Payload], min_chars: int = 24, max_chars: int = 120, first_chars: int = 32
) -> AsyncIterator[str]:
    """Text deltas -> phrases: cut after punctuation once `min_chars` are buffered, or
    at a word boundary past `max_chars`; the rest when the input ends. The first phrase
    is cut sooner (a word boundary past `first_chars`): it decides time to first audio."""
    buf = ""
    first = True
    async for p in inp:
        buf += p.text or ""
        while True:
            cut = -1
            for m in _PHRASE_END.finditer(buf):
                if m.end() >= (min(min_chars, first_chars) if first else min_chars):
                    cut = m.end()
                    break
            limit = first_chars if first else max_chars
            if cut < 0 and len(buf) > limit:
                cut = buf.rfind(" ", 0, limit) + 1 or limit
            if cut <= 0:
                break
            head, buf = buf[:cut].strip(), buf[cut:]
            if head:
                first = False
                yield head
    if buf.strip():
        yield buf.strip()


# ---- code2wav ---------------------------------------------------------------------------


class SnacFrameDecoder(torch.nn.Module):
    """Batched frames [B, F, 7] (Orpheus order) -> audio [B, F * 2048] float32."""

    def __init__(self, snac: torch.nn.Module) -> None:
        super().__init__()
        self.snac = snac

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        codes = [c.to(frames.device) for c in frames_to_codes(frames.cpu().numpy())]
        audio = self.snac.decode(codes)  # [B, 1, T]
        return audio[:, 0, :].float()


def _snac_module(model_dir: str) -> Callable[[], torch.nn.Module]:
    return lambda: SnacFrameDecoder(load_snac(model_dir))


class Code2WavProcessor(StageProcessor):
    """Split profile, stage 2: codec frames -> PCM chunks."""

    SNAC_KEYS = ("sampling_rate", "codebook_size", "vq_strides", "decoder_rates")
    REALTIME = True

    @staticmethod
    def torch_module(model_dir: str, role: str) -> Callable[[], torch.nn.Module]:
        return _snac_module(model_dir)

    @classmethod
    def check_model(cls, model_dir: str) -> None:
        missing = [k for k in cls.SNAC_KEYS if k not in checkpoint.config(model_dir)]
        if missing:
            raise StageError(f"code2wav {model_dir}: config.json is not a SNAC config (missing {', '.join(missing)})")
        if not any((Path(model_dir) / f).is_file() for f in ("pytorch_model.bin", "model.safetensors")):
            raise StageError(f"code2wav {model_dir}: no weights file (pytorch_model.bin or model.safetensors)")

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        self.decoder = self.engine_as(StepEngine)
        self.decode_times = DecodeTimes()

    async def run(self, ctx: StageContext) -> None:
        inp = ctx.input()
        dec = StreamingDecoder(self.decoder.run, inp.chunking if inp.mode == "chunk" else None, meter=ctx.meter, decode_times=self.decode_times)
        emit = AudioEmitter(ctx)
        async for payload in inp:
            await emit(await dec.push(payload.arrays["frames"]))
        await emit(await dec.finish())


class FusedTalkerProcessor(StageProcessor):
    """Fused profile: one stage; the talker owns a streaming decoder (aux engine 'decoder').

    Generation and decoding run as two tasks joined by a queue, so the talker keeps
    consuming tokens while a chunk is being decoded.
    """

    REALTIME = True

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        self.ar = self.engine_as(ArEngine)
        self.decoder = self.engine_as(StepEngine, "decoder")
        assert spec.model is not None
        self.talker = CodecTalker(spec.model, spec.processor_args)
        self.chunking = self.talker.args.chunking or ChunkingSpec()
        self.decode_times = DecodeTimes()

    @staticmethod
    def torch_module(model_dir: str, role: str) -> Callable[[], torch.nn.Module]:
        return _snac_module(model_dir)

    async def start(self) -> None:
        await asyncio.to_thread(self.talker.load)

    async def run(self, ctx: StageContext) -> None:
        text = await _input_text(ctx)
        queue: asyncio.Queue[np.ndarray | None] = asyncio.Queue()

        async def produce() -> None:
            try:
                async for frames in self.talker.frames(ctx, self.ar, text):
                    queue.put_nowait(frames)
            finally:
                queue.put_nowait(None)  # wake the decoder loop on success and failure alike

        producer = asyncio.get_running_loop().create_task(produce())
        try:
            dec = StreamingDecoder(self.decoder.run, self.chunking, meter=ctx.meter, decode_times=self.decode_times)
            emit = AudioEmitter(ctx)
            while (frames := await queue.get()) is not None:
                await emit(await dec.push(frames))
            await producer  # re-raise a talker failure
            await emit(await dec.finish())
        finally:
            if not producer.done():
                producer.cancel()
                await asyncio.gather(producer, return_exceptions=True)
