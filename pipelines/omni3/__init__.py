"""The voice pipeline's `omni3` profile: one Qwen3-Omni checkpoint, three stages.

    thinker (vLLM: text + the user's audio -> text, `talker_states`)
      -> omni_talker (torch: the thinker's tokens and audio states -> codec frames,
         `Omni3TalkerModule`: the MoE talker + its code predictor)
      -> omni_code2wav (torch: frames -> 24 kHz PCM, `Omni3Code2WavModule`, causal, in chunks)

The talker's prompt is the reference's (`Qwen3OmniMoeForConditionalGeneration.generate`):
the user turns of the conversation (their text as the thinker's embeddings, their audio as
the thinker's hidden states at `accept_hidden_layer`), then the assistant turn's opening,
the codec's no-think / speaker / pad / start rows, and the reply's first token; each
later frame adds the next reply token, then the text end, then pads. The first codebook
is sampled as the reference samples it (top-k 50, temperature 0.9, repetition penalty
1.05, the codec's extra ids suppressed but its end); the code predictor draws the others
(top-k 50, top-p 0.8). With greedy decoding the frames equal the reference's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from pydantic import Field

from omni_rt.engines.base import Engine, StepEngine
from omni_rt.payloads import Payload, PayloadKind
from omni_rt.specs import StageSpec
from omni_rt.stage import StageContext, StageError, StageProcessor
from pipelines.omni import OmniTalkerArgs, ReplyRows, TalkerBase, ThinkerReply, check_omni, check_talker_files, request_seed
from pipelines.omni3.models import Omni3Code2WavModule, Omni3TalkerModule, omni3_config
from pipelines.streaming import AudioEmitter, StreamingDecoder

OMNI3_ARCHITECTURES = frozenset({"Qwen3OmniMoeForConditionalGeneration"})
SUPPRESSED = 1024  # the reference suppresses the codec vocabulary's last 1024 ids (its control ids), but the end


def check_omni3(model_dir: str, what: str, part: str) -> None:
    check_omni(model_dir, what, part, "Qwen3OmniMoeForConditionalGeneration", OMNI3_ARCHITECTURES, speakers_file=False)


class Omni3TalkerArgs(OmniTalkerArgs):
    """As the Qwen2.5-Omni talker's, with the reference's values (codes are 12.5 Hz frames)."""

    top_k: int = Field(default=50, ge=1)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_codes: int = Field(default=2048, ge=1)
    base_codes: int = Field(default=6, ge=0)
    codes_per_token: int = Field(default=3, ge=0)


class Omni3TalkerProcessor(TalkerBase):
    """thinker payloads -> codec frames (CODES [1, num_code_groups] each), the reference's
    talker and code predictor.

    processor_args: the first codebook's sampling (`temperature`, `top_k`, `top_p`,
    `repetition_penalty`; `greedy`, for the code predictor too), the budget (`max_codes`;
    `base_codes` + `codes_per_token` x reply tokens, in 12.5 Hz frames: a bound a trained
    model never reaches). The module's cache has `SLOTS` rows of
    `Omni3TalkerModule.MAX_LEN` positions.
    """

    ARGS = Omni3TalkerArgs
    SLOTS = Omni3TalkerModule.SLOTS

    @classmethod
    def check_model(cls, model_dir: str) -> None:
        check_omni3(model_dir, "talker", "talker_config")
        check_talker_files(model_dir)

    @staticmethod
    def torch_module(model_dir: str, role: str) -> Callable[[], torch.nn.Module]:
        return lambda: Omni3TalkerModule(model_dir)

    def _load_family(self) -> None:
        cfg = omni3_config(self.model_dir)
        tc = cfg.talker_config
        self.speakers = dict(tc.speaker_id or {})
        if not self.speakers:
            raise StageError(f"talker {self.model_dir}: talker_config.speaker_id names no speakers")
        vocab = int(tc.text_config.vocab_size)
        self.eos = int(tc.codec_eos_token_id)
        self.allowed = torch.zeros(vocab)
        self.allowed[max(0, vocab - SUPPRESSED) :] = float("-inf")
        self.allowed[self.eos] = 0
        self.codec = {k: int(getattr(tc, f"codec_{k}_id")) for k in ("nothink", "think_bos", "think_eos", "pad", "bos")}
        self.tts = [int(cfg.tts_pad_token_id), int(cfg.tts_bos_token_id), int(cfg.tts_eos_token_id)]
        self.im_start, self.user, self.assistant = int(cfg.im_start_token_id), int(cfg.user_token_id), int(cfg.assistant_token_id)
        self.audio_token = int(cfg.thinker_config.audio_token_id)
        self.image_token = int(cfg.thinker_config.image_token_id)
        self.merge = int(cfg.thinker_config.vision_config.spatial_merge_size)

    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        rows = await self.steps.run({"ids": np.array(self.tts, np.int64)}, op="text_rows", priority=0)
        self.pad_row, self.bos_row, self.eos_row = rows
        c = self.codec
        names = list(self.speakers)
        codec = await self.steps.run({"ids": np.array([c["nothink"], c["think_bos"], c["think_eos"], c["pad"], c["bos"],
                                                       *(self.speakers[n] for n in names)], np.int64)}, op="codec_rows", priority=0)
        self.think_rows, self.cpad_row, self.cbos_row = codec[:3], codec[3], codec[4]
        self.speaker_rows = dict(zip(names, codec[5:], strict=True))

    def turns(self, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """The user turns' positions (each position's latest `<|im_start|>` opens a user
        turn) and where the answer's `<|im_start|>assistant` is."""
        n = len(ids)
        starts = np.where(ids == self.im_start, np.arange(n), -1)
        latest = np.maximum.accumulate(starts)
        role = np.where(latest >= 0, ids[np.minimum(latest + 1, n - 1)], -1)
        opens = np.flatnonzero((ids[:-1] == self.im_start) & (ids[1:] == self.assistant))
        if not len(opens):
            raise StageError("the thinker's prompt has no assistant turn to speak (its chat template's generation prompt)")
        return role == self.user, int(opens[-1])

    async def _talk(self, ctx: StageContext, slot: int, ids: np.ndarray, think: dict[str, np.ndarray],
                    audio_len: np.ndarray | None, speaker: str, reply: ThinkerReply) -> None:
        steps, s = self.steps, np.array(slot, np.int64)
        user, at = self.turns(ids)
        head = ids[at:]  # <|im_start|>assistant\n: the first three rows of the answer
        if len(head) < 3:
            raise StageError("the thinker's prompt ends inside the assistant turn's opening")
        prompt_rows = await steps.run({"ids": ids, **think}, op="user_rows", priority=0)

        async def embed(new: np.ndarray) -> Sequence[np.ndarray]:
            return list(await steps.run({"ids": new}, op="text_rows", priority=0))

        reply_rows = ReplyRows(reply, embed, await embed(head))  # the answer's rows: its opening, then the reply's
        rows, rows_for = reply_rows.rows, reply_rows.upto

        if not await rows_for(len(head) + 1):
            return  # nothing to say
        opening = np.stack([rows[0], rows[1], rows[2], *(self.pad_row + r for r in self.think_rows), self.pad_row + self.speaker_rows[speaker],
                            self.bos_row + self.cpad_row, rows[3] + self.cbos_row])
        embeds = np.concatenate([prompt_rows[user], opening]).astype(np.float32)
        talker_ids = np.concatenate([ids[user], np.full(len(opening), self.tts[0])]).astype(np.int64)
        room = Omni3TalkerModule.MAX_LEN - len(talker_ids) - 1
        if room <= 0:
            raise StageError(f"the conversation's user turns are {len(talker_ids)} positions; the talker's cache holds {Omni3TalkerModule.MAX_LEN}")
        prefill = {"slot": s, "embeds": embeds, "talker_ids": talker_ids, "seed": np.array(request_seed(ctx.params), np.int64)}
        if audio_len is not None:
            prefill["audio_lengths"] = audio_len
        if "image_grid_thw" in think:
            prefill["image_grid_thw"] = think["image_grid_thw"]
        logits = await steps.run(prefill, op="prefill", priority=0)
        sample = self._sampler(ctx, [])
        greedy = np.array(self.args.greedy)
        a = self.args
        out: list[int] = []
        while True:
            code = sample(logits, out)
            if code == self.eos:
                break
            k = len(out)  # this frame's step feeds the answer's row 4 + k (then the text end, then pads)
            have = await rows_for(4 + k + 1)
            row = rows[4 + k] if have else self.eos_row if 4 + k == len(rows) else self.pad_row
            res = await steps.run({"slot": s, "code": np.array(code, np.int64), "text": row, "greedy": greedy}, op="frame")
            await ctx.emit(Payload(PayloadKind.CODES, ctx.fence, arrays={"frames": res["codes"].astype(np.int32).reshape(1, -1)},
                                   meta={"frame_start": k}))
            out.append(code)
            logits = res["logits"]
            budget = min(a.max_codes, a.base_codes + a.codes_per_token * (len(rows) - 3))
            if (not have and len(out) >= budget) or len(out) >= room:
                break
        ctx.add_usage(output_audio_tokens=len(out))


class Omni3Code2WavProcessor(StageProcessor):
    """codec frames -> 24 kHz PCM in chunks (the edge's chunking, in frames): each window
    decodes `left_context_frames` frames before the chunk (the decoder is causal: no
    look-ahead), as the reference's `chunked_decode` does."""

    REALTIME = True

    @classmethod
    def check_model(cls, model_dir: str) -> None:
        check_omni3(model_dir, "code2wav", "code2wav_config")

    @staticmethod
    def torch_module(model_dir: str, role: str) -> Callable[[], torch.nn.Module]:
        return lambda: Omni3Code2WavModule(model_dir)

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        self.steps = self.engine_as(StepEngine)
        assert spec.model is not None
        self.model_dir = spec.model

    def _load(self) -> None:
        cfg = omni3_config(self.model_dir).code2wav_config
        self.samples_per_frame = int(np.prod([*cfg.upsample_rates, *cfg.upsampling_ratios]))
        self.groups = int(cfg.num_quantizers)

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    async def decode(self, frames: np.ndarray, deadline: float | None = None) -> np.ndarray:
        wav: np.ndarray = await self.steps.run(frames.astype(np.int64), deadline=deadline)
        return wav

    async def run(self, ctx: StageContext) -> None:
        inp = ctx.input()
        decoder = StreamingDecoder(self.decode, inp.chunking if inp.mode == "chunk" else None, meter=ctx.meter,
                                   samples_per_frame=self.samples_per_frame, width=self.groups)
        emit = AudioEmitter(ctx)
        async for payload in inp:
            frames = np.asarray(payload.arrays["frames"], np.int32)
            if frames.ndim != 2 or frames.shape[1] != self.groups:
                raise StageError(f"code2wav takes frames of {self.groups} codes; got an array of shape {frames.shape}")
            await emit(await decoder.push(frames))
        await emit(await decoder.finish())
