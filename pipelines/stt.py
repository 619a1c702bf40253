"""Streaming speech to text: Kyutai STT (transformers' `KyutaiSpeechToTextForConditionalGeneration`).

The model reads the audio as it comes: every 80 ms frame (1920 samples at 24 kHz) Mimi's
streaming encoder turns into 8 codes, and the decoder reads the previous text token with
them and writes the next one (Kyutai's delayed-streams layout: the text runs a fixed
`audio_delay_seconds` behind the audio). So the transcript grows while the user speaks;
at the end of the input that much silence more lets the last words out.

The stage (`SttProcessor`) runs on a torch engine whose module is `SttSteps`: one
`step` per frame for each live request (a slot of its own: the decoder's KV cache and
Mimi's streaming state), the frames of every live request that are ready at once in one
engine call. Its TEXT payloads are deltas of the transcript; the request ends when its
input does. Any directory laid out like kyutai/stt-1b-en_fr-trfs or stt-2.6b-en-trfs
(transformers' format) loads; the default is a tiny random one (`tiny:kyutai-stt`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import Field

from omni_rt.dtypes import dtype_of
from omni_rt.engines.base import Engine, StepEngine
from omni_rt.payloads import Payload, PayloadKind
from omni_rt.specs import StageSpec
from omni_rt.stage import ProcessorArgs, StageContext, StageError, StageProcessor
from pipelines import checkpoint

ARCHITECTURE = "KyutaiSpeechToTextForConditionalGeneration"
RATE = 24000
FRAME = 1920  # 80 ms at 24 kHz: one step
CONTROL_IDS = 4  # <unk> <s> </s> <pad>: never text


class SttSteps(torch.nn.Module):
    """The engine's module: `step(slot, pcm, fresh)` advances each row's request by one
    frame and returns the text tokens it wrote (two on a request's first frame: the
    one after the BOS, then the frame's; -1 where a row wrote one). The rows run one
    after another (each holds its own positions, caches and Mimi state); the engine
    call carries every live request's frame."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        c = model.config
        self.bos, self.audio_bos, self.codebooks = int(c.bos_token_id), int(c.audio_bos_token_id), int(c.num_codebooks)
        self.slots: dict[int, dict[str, Any]] = {}

    @classmethod
    def load(cls, model_dir: str) -> SttSteps:
        from transformers import KyutaiSpeechToTextForConditionalGeneration

        model = KyutaiSpeechToTextForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        return cls(model)

    def _decode(self, state: dict[str, Any], text_token: int, codes: Any) -> int:
        ids = torch.tensor([[[text_token, *codes]]], dtype=torch.long, device=self.model.device)  # (on the model's device: a GPU's too)
        out = self.model(input_ids=ids, past_key_values=state["kv"], use_cache=True)
        state["kv"] = out.past_key_values
        return int(out.logits[0, -1].argmax())

    def step(self, slot: Any, pcm: Any, fresh: Any) -> dict[str, Any]:
        from transformers import DynamicCache

        rows = []
        with torch.inference_mode():
            for i in range(int(slot.shape[0])):
                key = int(slot[i])
                first = -1
                if bool(fresh[i]) or key not in self.slots:
                    state: dict[str, Any] = {"kv": DynamicCache(), "enc": None, "pad": None}
                    self.slots[key] = state
                    first = self._decode(state, self.bos, [self.audio_bos] * self.codebooks)
                    state["last"] = first
                state = self.slots[key]
                enc = self.model.codec_model.encode(pcm[i].reshape(1, 1, -1).to(dtype_of(self.model.codec_model)), encoder_past_key_values=state["enc"],
                                                    padding_cache=state["pad"], use_streaming=True, return_dict=True)
                state["enc"], state["pad"] = enc.encoder_past_key_values, enc.padding_cache
                codes = [int(c) for c in enc.audio_codes[0, : self.codebooks, 0]]
                state["last"] = self._decode(state, state["last"], codes)
                rows.append([first, state["last"]])
        return {"tokens": torch.tensor(rows, dtype=torch.long)}

    def release(self, slot: Any) -> dict[str, Any]:
        """Forget the rows' requests (their caches hold megabytes on a real model)."""
        for i in range(int(slot.shape[0])):
            self.slots.pop(int(slot[i]), None)
        return {"released": torch.ones(int(slot.shape[0]), dtype=torch.bool)}


class SttArgs(ProcessorArgs):
    max_sessions: int = Field(default=64, ge=1, le=4096, description="requests transcribed at once (a slot each)")


class SttProcessor(StageProcessor):
    """The `stt` stage (see the module docstring)."""

    @staticmethod
    def torch_module(model_dir: str, role: str) -> Callable[[], Any]:
        return lambda: SttSteps.load(model_dir)

    @classmethod
    def check_model(cls, model_dir: str) -> None:
        checkpoint.check_architecture(model_dir, "stt", f"{ARCHITECTURE} (transformers' format, e.g. kyutai/stt-1b-en_fr-trfs)",
                                      lambda a: a == ARCHITECTURE)
        checkpoint.check_mimi(model_dir, checkpoint.config(model_dir).get("codec_config") or {}, "stt")
        if not any((Path(model_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
            raise StageError(f"{model_dir}: no text tokenizer (tokenizer.json or tokenizer.model)")

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        self.args = SttArgs.parse(spec.processor_args, "stt")
        self.steps = self.engine_as(StepEngine)
        assert spec.model is not None
        self.load_text(spec.model)
        try:
            pre = json.loads((Path(spec.model) / "preprocessor_config.json").read_text())
        except (OSError, ValueError):
            pre = {}
        self.delay_frames = math.ceil(float(pre.get("audio_delay_seconds") or 0.0) * RATE / FRAME) + 1
        self._free = list(range(self.args.max_sessions))

    def describe(self) -> dict[str, Any]:
        return {"sample_rate": RATE, "frame_ms": FRAME * 1000 // RATE, "delay_frames": self.delay_frames,
                "live": self.args.max_sessions - len(self._free)}

    def load_text(self, model_dir: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def text(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode([t for t in ids if t >= CONTROL_IDS], skip_special_tokens=True))

    async def run(self, ctx: StageContext) -> None:
        import soxr

        if not self._free:
            raise StageError(f"stt: all {self.args.max_sessions} streams are in use")
        slot = self._free.pop()
        ids: list[int] = []
        said = ""
        buf = np.zeros(0, np.float32)
        fresh = True
        resampler: Any = None
        rate: int | None = None

        async def frame(pcm: np.ndarray) -> None:
            nonlocal fresh, said
            out = await self.steps.run({"slot": np.array(slot, np.int64), "pcm": pcm, "fresh": np.array(fresh)}, op="step", priority=0)
            fresh = False
            ids.extend(int(t) for t in np.asarray(out["tokens"]).reshape(-1) if int(t) >= 0)
            now = self.text(ids)
            if now != said and now.startswith(said):  # pieces that make whole characters
                await ctx.emit(Payload(PayloadKind.TEXT, ctx.fence, text=now[len(said):]))
                said = now

        try:
            async for p in ctx.input():
                if p.kind != PayloadKind.AUDIO:
                    continue
                r = int(p.meta.get("sample_rate", RATE))
                if rate is None:
                    rate = r
                    resampler = soxr.ResampleStream(r, RATE, 1, dtype="float32") if r != RATE else None
                elif r != rate:
                    raise StageError(f"audio sample rate changed mid-stream ({rate} -> {r})")
                x = np.asarray(p.arrays["pcm"], np.float32).reshape(-1)
                buf = np.concatenate([buf, resampler.resample_chunk(x) if resampler is not None else x])
                while len(buf) >= FRAME:
                    await frame(buf[:FRAME])
                    buf = buf[FRAME:]
            if resampler is not None:
                buf = np.concatenate([buf, resampler.resample_chunk(np.zeros(0, np.float32), last=True)])
            # the rest of the last frame, then the text's delay in silence: the last words come out
            tail = np.concatenate([buf, np.zeros((-len(buf)) % FRAME + self.delay_frames * FRAME, np.float32)])
            for i in range(0, len(tail), FRAME):
                await frame(tail[i : i + FRAME])
            final = self.text(ids)
            if final != said and final.startswith(said):
                await ctx.emit(Payload(PayloadKind.TEXT, ctx.fence, text=final[len(said):]))
        finally:
            try:
                await self.steps.run({"slot": np.array(slot, np.int64)}, op="release", priority=0)
            finally:
                self._free.append(slot)
