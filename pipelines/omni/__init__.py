"""The voice pipeline's `omni` profile: one Qwen2.5-Omni checkpoint, three stages.

    thinker (vLLM: text + the user's audio -> text, `talker_states`)
      -> omni_talker (torch: the thinker's states -> codec tokens, `OmniTalkerModule`)
      -> token2wav (torch: codes -> 24 kHz PCM, `Token2WavModule`, in chunks)

How the talker gets the thinker's states: the thinker's first payload carries the
prompt's token ids and audio, and every text delta its token ids (`TALKER_PROMPT`,
`token_ids`); the talker stage recomputes the embeddings and last hidden states with the
checkpoint's own thinker weights, incrementally. docs/design.md says why (vLLM streams
tokens, not states) and what it costs (the thinker's weights twice; its compute once
more, without sampling).

The talker's sampling and stopping are the reference's (`Qwen2_5OmniForConditionalGeneration.generate`:
top-k 40, top-p 0.8, temperature 0.9, repetition penalty 1.05, codec pad/end stop);
with the same thinker tokens and greedy decoding its codes equal the reference's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import Field

from omni_rt.engines.base import Engine, StepEngine
from omni_rt.payloads import TALKER_PROMPT, TOOL_CALL, Payload, PayloadKind
from omni_rt.specs import StageSpec
from omni_rt.stage import ProcessorArgs, StageContext, StageError, StageProcessor
from pipelines import checkpoint
from pipelines.omni.models import OmniTalkerModule, Token2WavModule, load_speakers, omni_config
from pipelines.streaming import AudioEmitter, StreamingDecoder
from pipelines.voice import feature_pad

# the hub repos declare Qwen2_5OmniModel; transformers saves Qwen2_5OmniForConditionalGeneration
OMNI_ARCHITECTURES = frozenset({"Qwen2_5OmniForConditionalGeneration", "Qwen2_5OmniModel"})


def check_omni(model_dir: str, what: str, part: str, family: str = "Qwen2_5OmniForConditionalGeneration",
               archs: frozenset[str] = OMNI_ARCHITECTURES, speakers_file: bool = True) -> None:
    """An Omni checkpoint of `family` with `part` (talker_config / token2wav_config /
    code2wav_config) and its speakers, from the files alone."""
    checkpoint.check_architecture(model_dir, what, f"{family} (the family's full checkpoint)", lambda a: a in archs)
    cfg = checkpoint.config(model_dir)
    missing = [k for k in ("thinker_config", part) if not isinstance(cfg.get(k), dict)]
    if missing:
        raise StageError(f"{what} {model_dir}: config.json has no {', '.join(missing)}")
    if cfg.get("enable_audio_output") is False:
        raise StageError(f"{what} {model_dir}: config.json says enable_audio_output false (a thinker-only checkpoint)")
    if speakers_file and not (Path(model_dir) / "spk_dict.pt").is_file():
        raise StageError(f"{what} {model_dir}: no spk_dict.pt (the checkpoint's speakers)")
    if not any(Path(model_dir).glob("*.safetensors")):
        raise StageError(f"{what} {model_dir}: no *.safetensors weights")


def check_talker_files(model_dir: str) -> None:
    """What a talker stage reads besides the weights: the tokenizer and the thinker's
    audio front end (it prepares the user's audio as the thinker's processor does)."""
    checkpoint.check_tokenizer_files(model_dir, "talker")
    if not checkpoint.config(model_dir, "preprocessor_config.json").get("feature_extractor_type"):
        raise StageError(f"talker {model_dir}: no preprocessor_config.json with a feature extractor (the thinker's audio front end)")


def speaker_of(speakers: Mapping[str, Any], params: Mapping[str, Any]) -> str:
    """The request's voice as one of the checkpoint's speakers (the pipeline's voice
    map has turned OpenAI names into speakers; the first speaker when none is set)."""
    voice = params.get("voice")
    if voice is None:
        return next(iter(speakers))
    for name in speakers:
        if name.lower() == str(voice).lower():
            return name
    raise StageError(f"unknown voice {voice!r}; this checkpoint speaks {', '.join(speakers)}")


class ThinkerReply:
    """The thinker's reply as the talker reads it: token ids as they stream in."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.ended = False
        self.changed = asyncio.Event()


class OmniTalkerArgs(ProcessorArgs):
    """An Omni talker's processor_args: the first codebook's sampling (`greedy`: none),
    and the budget of an answer's codes (`base_codes` + `codes_per_token` x the reply's
    tokens, at most `max_codes`: a bound a trained model never reaches)."""

    temperature: float = Field(default=0.9, gt=0.0)
    top_k: int = Field(default=40, ge=1)
    top_p: float = Field(default=0.8, gt=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.05, gt=0.0)
    greedy: bool = False
    max_codes: int = Field(default=4096, ge=1)
    base_codes: int = Field(default=25, ge=0)
    codes_per_token: int = Field(default=12, ge=0)


class Token2WavArgs(ProcessorArgs):
    """The DiT's ODE: the reference's steps, guidance and sway."""

    steps: int = Field(default=10, ge=1)
    guidance: float = 0.5
    sway: float = -1.0


class ReplyRows:
    """The rows a talker reads of the thinker's reply, made as its tokens stream in
    (`embed`: new token ids -> their rows, in the talker's module) after the `rows`
    already there; `upto(n)` waits until there are `n` (True) or the reply ended short of
    them (False)."""

    def __init__(self, reply: ThinkerReply, embed: Callable[[np.ndarray], Awaitable[Sequence[np.ndarray]]], rows: Sequence[np.ndarray] = ()) -> None:
        self.reply = reply
        self.embed = embed
        self.rows: list[np.ndarray] = list(rows)
        self.fed = 0

    async def upto(self, n: int) -> bool:
        while True:
            if self.fed < len(self.reply.ids):
                new = np.asarray(self.reply.ids[self.fed :], np.int64)
                self.fed = len(self.reply.ids)
                self.rows.extend(await self.embed(new))
                continue
            if len(self.rows) >= n:
                return True
            if self.reply.ended:
                return False
            self.reply.changed.clear()
            await self.reply.changed.wait()


class TalkerBase(StageProcessor):
    """What the Omni families' talkers share: the thinker's payloads read as they stream
    (its prompt's ids and audio first, then the reply's token ids), the user's audio
    prepared as the thinker's processor does, the request's speaker, a slot of the
    module's cache per answer (`SLOTS` answers decode at once; more wait for a slot), and
    the first codebook's sampling (`_sampler`, over `self.allowed`). Subclasses load
    their family's ids (`_load_family`) and speak (`_talk`)."""

    ARGS: type[ProcessorArgs] = ProcessorArgs
    SLOTS = 16
    REALTIME = True

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        self.args: Any = self.ARGS.parse(spec.processor_args, "talker")
        self.steps = self.engine_as(StepEngine)
        assert spec.model is not None
        self.model_dir = spec.model
        self.free: asyncio.Queue[int] = asyncio.Queue()
        for s in range(self.SLOTS):
            self.free.put_nowait(s)
        self.speakers: dict[str, Any] = {}
        self.processor: Any = None
        self.allowed = torch.zeros(0)
        self.audio_token = self.image_token = -1
        self.merge = 1

    def _load(self) -> None:
        from transformers import AutoProcessor

        from omni_rt.vllm_plugin import register

        register()  # the processor's video half needs what the plugin provides
        self.processor = AutoProcessor.from_pretrained(self.model_dir)
        fe = self.processor.feature_extractor
        self.n_fft, self.hop = int(fe.n_fft), int(fe.hop_length)
        self.audio_span = self.processor.audio_bos_token + self.processor.audio_token + self.processor.audio_eos_token
        self._load_family()

    def _load_family(self) -> None:
        raise NotImplementedError

    def _features(self, audio: np.ndarray) -> dict[str, np.ndarray]:
        """The audio as the thinker's processor prepares it (padded just past the audio,
        as the thinker stage asks vLLM to: the frames are the same)."""
        pad = feature_pad(len(audio), self.n_fft, self.hop)
        out = self.processor(text=self.audio_span, audio=[audio], audio_kwargs={"max_length": pad}, return_tensors="np")
        n = int((out["input_ids"][0] == self.audio_token).sum())
        return {"features": out["input_features"][0].astype(np.float32), "feature_mask": out["feature_attention_mask"][0].astype(np.int64),
                "n_audio": np.array(n)}

    def _sampler(self, ctx: StageContext, prompt_codes: list[int]) -> Callable[[np.ndarray, list[int]], int]:
        """The first codebook's sampling (the talker's own: a request's temperature and
        top_p are the thinker's), with the repetition penalty over `prompt_codes` and
        the codes so far (`out`, which only grows)."""
        from transformers import (
            LogitsProcessorList,
            RepetitionPenaltyLogitsProcessor,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        a, p = self.args, ctx.params
        greedy = a.greedy
        procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(a.repetition_penalty)])
        if not greedy:
            procs += [TemperatureLogitsWarper(a.temperature), TopKLogitsWarper(a.top_k), TopPLogitsWarper(a.top_p)]
        allowed = self.allowed
        gen = torch.Generator()
        gen.manual_seed(request_seed(p))

        # The penalty reads each earlier code once however often it came: the distinct
        # codes so far, grown as the answer goes (not the whole history rebuilt a step).
        seen = dict.fromkeys(prompt_codes)
        ids = torch.tensor([list(seen)], dtype=torch.long)
        taken = [0]  # codes of `out` already in `seen`

        def sample(logits: np.ndarray, out: list[int]) -> int:
            nonlocal ids
            fresh = [c for c in out[taken[0]:] if c not in seen]
            taken[0] = len(out)
            if fresh:
                seen.update(dict.fromkeys(fresh))
                ids = torch.cat([ids, torch.tensor([fresh], dtype=torch.long)], dim=1)
            scores = procs(ids, torch.from_numpy(np.asarray(logits, np.float32)).view(1, -1) + allowed)
            if greedy:
                return int(scores.argmax(-1))
            return int(torch.multinomial(torch.softmax(scores, -1), 1, generator=gen))

        return sample

    async def _read(self, inp: AsyncIterator[Payload], reply: ThinkerReply) -> None:
        """Token ids of the reply's text (a talker speaks content, never a call)."""
        tokenizer = self.processor.tokenizer
        try:
            async for p in inp:
                if TOOL_CALL in p.meta:
                    continue
                ids = p.arrays.get("token_ids")
                if ids is not None:
                    reply.ids.extend(int(t) for t in np.asarray(ids).reshape(-1))
                elif p.text:  # content pieces of a tool-parsed answer: re-encoded
                    reply.ids.extend(tokenizer.encode(p.text, add_special_tokens=False))
                reply.changed.set()
        finally:
            reply.ended = True
            reply.changed.set()

    async def run(self, ctx: StageContext) -> None:
        inp = ctx.input().__aiter__()
        first = await anext(inp, None)
        if first is None:
            return
        if not first.meta.get(TALKER_PROMPT):
            raise StageError("the omni talker needs the thinker's prompt first (thinker processor_args.talker_states: true)")
        speaker = speaker_of(self.speakers, ctx.params)
        ids = np.asarray(first.arrays["prompt_ids"], np.int64)
        audio = first.arrays.get("audio")
        think: dict[str, np.ndarray] = {}
        audio_len = None
        if audio is not None:
            f = await asyncio.to_thread(self._features, np.asarray(audio, np.float32))
            at = int(np.flatnonzero(ids == self.audio_token)[0])
            ids = np.concatenate([ids[:at], np.full(int(f["n_audio"]), self.audio_token, np.int64), ids[at + 1 :]])
            think = {"features": f["features"], "feature_mask": f["feature_mask"]}
            audio_len = np.array(int(f["feature_mask"].sum()), np.int64)
        grid = first.arrays.get("image_grid_thw")
        if grid is not None:
            # each image's one placeholder token becomes its rows (the thinker's processor's grid, merged)
            grid = np.asarray(grid, np.int64).reshape(-1, 3)
            spots = np.flatnonzero(ids == self.image_token)
            if len(spots) != len(grid):
                raise StageError(f"the thinker's prompt has {len(spots)} image placeholders for {len(grid)} images")
            counts = grid.prod(-1) // self.merge ** 2
            pieces, at = [], 0
            for spot, n in zip(spots, counts, strict=True):
                pieces += [ids[at:spot], np.full(int(n), self.image_token, np.int64)]
                at = spot + 1
            ids = np.concatenate([*pieces, ids[at:]])
            think.update(pixel_values=np.asarray(first.arrays["pixel_values"], np.float32), image_grid_thw=grid)
        reply = ThinkerReply()
        reader = asyncio.get_running_loop().create_task(self._read(inp, reply))
        slot = await self.free.get()
        try:
            await self._talk(ctx, slot, ids, think, audio_len, speaker, reply)
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            try:
                await self.steps.run({"slot": np.array(slot, np.int64)}, op="release", priority=0)
            finally:
                self.free.put_nowait(slot)

    async def _talk(self, ctx: StageContext, slot: int, ids: np.ndarray, think: dict[str, np.ndarray],
                    audio_len: np.ndarray | None, speaker: str, reply: ThinkerReply) -> None:
        raise NotImplementedError


def request_seed(params: Mapping[str, Any]) -> int:
    """The request's seed, or a fresh one."""
    return int(params["seed"]) if params.get("seed") is not None else int(torch.randint(0, 2**31 - 1, (1,)))


class OmniTalkerProcessor(TalkerBase):
    """thinker payloads -> codec tokens (CODES [n, 1]), the reference's talker.

    processor_args: sampling (`temperature`, `top_k`, `top_p`, `repetition_penalty`;
    `greedy`), the budget (`max_codes`; `base_codes` + `codes_per_token` x reply tokens,
    a bound a trained model never reaches). The module's cache has `SLOTS` rows of
    `OmniTalkerModule.MAX_LEN` positions (prompt and codes).
    """

    ARGS = OmniTalkerArgs
    SLOTS = OmniTalkerModule.SLOTS

    @classmethod
    def check_model(cls, model_dir: str) -> None:
        check_omni(model_dir, "talker", "talker_config")
        check_talker_files(model_dir)

    @staticmethod
    def torch_module(model_dir: str, role: str) -> Callable[[], torch.nn.Module]:
        return lambda: OmniTalkerModule(model_dir)

    def _load_family(self) -> None:
        self.speakers = load_speakers(self.model_dir)
        cfg = omni_config(self.model_dir)  # transformers' config: the family's defaults for what config.json leaves out
        tc = cfg.talker_config
        self.codec = {k: int(getattr(tc, f"tts_codec_{k}_token_id")) for k in ("start", "end", "pad", "mask")}
        self.text = {k: int(getattr(tc, f"tts_text_{k}_token_id")) for k in ("end", "pad")}
        self.stops = {self.codec["pad"], self.codec["end"]}  # the reference's talker_eos_token_id
        # what the talker may sample: the codes token2wav embeds, and the stops (the
        # start token, which the reference suppresses, and the rest of the vocabulary not)
        self.allowed = torch.full((int(tc.vocab_size),), float("-inf"))
        self.allowed[: int(cfg.token2wav_config.dit_config.num_embeds) + 1] = 0
        self.allowed[sorted(self.stops)] = 0
        self.audio_token = int(cfg.thinker_config.audio_token_index)
        self.image_token = int(cfg.thinker_config.image_token_index)
        self.merge = int(cfg.thinker_config.vision_config.spatial_merge_size)

    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        # the thinker-vocabulary rows every answer uses: the text end and pad, and each
        # speaker's text start
        bos = [int(sp["bos_token"]) for sp in self.speakers.values()]
        rows = await self.steps.run({"ids": np.array([self.text["end"], self.text["pad"], *bos], np.int64)}, op="text_embed", priority=0)
        self.eos_row, self.pad_row = rows[0], rows[1]
        self.bos_rows = dict(zip(self.speakers, rows[2:], strict=True))

    async def _talk(self, ctx: StageContext, slot: int, ids: np.ndarray, think: dict[str, np.ndarray],
                    audio_len: np.ndarray | None, speaker: str, reply: ThinkerReply) -> None:
        steps, s = self.steps, np.array(slot, np.int64)
        pr = await steps.run({"slot": s, "ids": ids, **think}, op="think_prompt", priority=0)

        async def embed(new: np.ndarray) -> Sequence[np.ndarray]:  # per reply token: hidden + embedding
            out = await steps.run({"slot": s, "ids": new}, op="think_reply", priority=0)
            return list(out["hidden"] + out["embeds"])

        reply_rows = ReplyRows(reply, embed)
        rows, rows_for = reply_rows.rows, reply_rows.upto

        if not await rows_for(1):
            return  # nothing to say
        room = OmniTalkerModule.MAX_LEN - len(ids) - 2
        if room <= 0:
            raise StageError(f"the conversation is {len(ids)} tokens; the talker's cache holds {OmniTalkerModule.MAX_LEN} positions")
        bos = int(self.speakers[speaker]["bos_token"])
        embeds = np.concatenate([pr["hidden"] + pr["embeds"], self.bos_rows[speaker][None], rows[0][None]]).astype(np.float32)
        text_ids = np.concatenate([ids, [bos, reply.ids[0]]]).astype(np.int64)
        prefill = {"slot": s, "embeds": embeds, "text_ids": text_ids}
        if audio_len is not None:
            prefill["audio_lengths"] = audio_len
        if "image_grid_thw" in think:
            prefill["image_grid_thw"] = think["image_grid_thw"]
        logits = await steps.run(prefill, op="talk_prefill", priority=0)
        prompt_codes = [self.codec["mask"]] * len(ids) + [self.codec["pad"], self.codec["start"]]
        sample = self._sampler(ctx, prompt_codes)
        a = self.args
        out: list[int] = []
        while True:
            code = sample(logits, out)
            if code in self.stops:
                break
            await ctx.emit(Payload(PayloadKind.CODES, ctx.fence, arrays={"frames": np.array([[code]], np.int32)},
                                   meta={"frame_start": len(out)}))
            out.append(code)
            k = len(out)  # this step feeds reply row k (then the text end, then pads)
            have = await rows_for(k + 1)
            budget = min(a.max_codes, a.base_codes + a.codes_per_token * len(rows))
            if (not have and k >= budget) or k >= room:
                break
            row = rows[k] if have else self.eos_row if k == len(rows) else self.pad_row
            logits = await steps.run({"slot": s, "code": np.array(code, np.int64), "reply": row}, op="talk_step")
        ctx.add_usage(output_audio_tokens=len(out))


class Token2WavProcessor(StageProcessor):
    """codec tokens -> 24 kHz PCM in chunks (the edge's chunking, in codes): each
    window decodes `left_context_frames` codes before the chunk and `lookahead_frames`
    after it, from noise drawn per code position, so a streamed decode equals the same
    chunks decoded at once. processor_args: the DiT's ODE (`steps` 10, `guidance` 0.5,
    `sway` -1.0: the reference's)."""

    REALTIME = True

    @classmethod
    def check_model(cls, model_dir: str) -> None:
        check_omni(model_dir, "token2wav", "token2wav_config")

    @staticmethod
    def torch_module(model_dir: str, role: str) -> Callable[[], torch.nn.Module]:
        return lambda: Token2WavModule(model_dir)

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        self.args = Token2WavArgs.parse(spec.processor_args, "token2wav")
        self.steps = self.engine_as(StepEngine)
        assert spec.model is not None
        self.model_dir = spec.model
        self.speakers: dict[str, Any] = {}

    def _load(self) -> None:
        self.speakers = load_speakers(self.model_dir)
        cfg = omni_config(self.model_dir).token2wav_config
        self.repeats, self.mel_dim = int(cfg.dit_config.repeats), int(cfg.dit_config.mel_dim)
        self.samples_per_code = self.repeats * int(np.prod(cfg.bigvgan_config.upsample_rates))  # mel frames a code x samples a frame

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    async def run(self, ctx: StageContext) -> None:
        inp = ctx.input()
        decoder = StreamingDecoder(self.decoder(ctx.params), inp.chunking if inp.mode == "chunk" else None, meter=ctx.meter,
                                   samples_per_frame=self.samples_per_code, width=2)
        emit = AudioEmitter(ctx)
        n = 0
        async for payload in inp:
            codes = np.asarray(payload.arrays["frames"], np.int32).reshape(-1)
            frames = np.stack([codes, np.arange(n, n + len(codes), dtype=np.int32)], 1)  # (code, position)
            n += len(codes)
            await emit(await decoder.push(frames))
        await emit(await decoder.finish())

    def decoder(self, params: Mapping[str, Any]) -> Callable[..., Any]:
        """A window decode for `StreamingDecoder` of a request with `params` (its voice
        and seed): frames are (code, position) rows; the noise of each position is the
        request's, drawn in order."""
        sp = self.speakers[speaker_of(self.speakers, params)]
        cond, ref_mel = sp["cond"].numpy(), sp["ref_mel"].numpy()  # (192,), (frames, mel): load_speakers
        gen = torch.Generator()
        gen.manual_seed(request_seed(params))
        noise: list[np.ndarray] = []  # per code: [repeats, mel]
        a = self.args
        ode = {"steps": np.array(a.steps), "guidance": np.array(a.guidance, np.float32), "sway": np.array(a.sway, np.float32)}

        async def decode(frames: np.ndarray, deadline: float | None = None) -> np.ndarray:
            lo, hi = int(frames[0, 1]), int(frames[-1, 1]) + 1
            while len(noise) < hi:
                noise.append(torch.randn(self.repeats, self.mel_dim, generator=gen).numpy())
            x = {"codes": frames[:, 0].astype(np.int64), "noise": np.concatenate(noise[lo:hi]), "cond": cond, "ref_mel": ref_mel, **ode}
            mel = await self.steps.run(x, op="mel", deadline=deadline)
            wav: np.ndarray = await self.steps.run({"mel": mel}, op="vocode", deadline=deadline)
            return wav

        return decode
