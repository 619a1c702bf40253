"""The asr pipeline's stage: Whisper on vLLM (the encoder takes the audio through vLLM's
own processor, the decoder writes the transcript).

The request's AUDIO payload (any rate) is resampled to 16 kHz and cut into 30 s windows
(Whisper's context); each window is one engine request with the decoder prompt
`[<|startofprev|> prompt] <|startoftranscript|> <|lang|> <|transcribe|/|translate|>
<|notimestamps|>`, and its text streams out as TEXT payloads whose meta names the
window (`segment`, `start`, `end` in seconds). Without a language the first window's
language is detected (one decoder step limited to the language tokens). Any directory
laid out like a hub `openai/whisper-*` checkpoint loads, the tiny default included.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import numpy as np
from pydantic import Field

from omni_rt.engines.base import ArEngine, Engine
from omni_rt.payloads import Payload, PayloadKind
from omni_rt.specs import StageSpec
from omni_rt.stage import ProcessorArgs, StageContext, StageError, StageProcessor
from pipelines import checkpoint

RATE = 16000
WINDOW_S = 30.0


class AsrArgs(ProcessorArgs):
    max_tokens: int = Field(default=440, ge=2, description="tokens a 30-s window's transcript may take (Whisper's decoder holds 448)")


class AsrProcessor(StageProcessor):

    @classmethod
    def check_model(cls, model_dir: str) -> None:
        checkpoint.check_architecture(model_dir, "asr", "WhisperForConditionalGeneration", lambda a: a == "WhisperForConditionalGeneration")
        fe = checkpoint.config(model_dir, "preprocessor_config.json").get("feature_extractor_type")
        if fe != "WhisperFeatureExtractor":
            raise StageError(f"asr {model_dir}: preprocessor_config.json must name WhisperFeatureExtractor (got {fe!r})")
        checkpoint.check_tokenizer_files(model_dir, "asr")

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        super().__init__(spec, engine, aux)
        self.ar = self.engine_as(ArEngine)
        assert spec.model is not None
        self.args = AsrArgs.parse(spec.processor_args, "asr")
        self.tokenizer: Any = None
        self._languages: dict[str, int] = {}

    def _load(self) -> None:
        from transformers import AutoTokenizer

        assert self.spec.model is not None
        self.tokenizer = AutoTokenizer.from_pretrained(self.spec.model)
        tok = self.tokenizer
        for t in tok.all_special_tokens + list(tok.get_added_vocab()):
            code = t[2:-2] if t.startswith("<|") and t.endswith("|>") else ""
            if 2 <= len(code) <= 3 and code.isalpha() and code.islower():
                self._languages[code] = tok.convert_tokens_to_ids(t)
        self.ids = {name: tok.convert_tokens_to_ids(f"<|{name}|>") for name in
                    ("startoftranscript", "transcribe", "translate", "notimestamps", "startofprev", "endoftext")}

    async def start(self) -> None:
        if self.tokenizer is None:  # the wire may have asked for the languages already
            await asyncio.to_thread(self._load)

    def languages(self) -> list[str]:
        if self.tokenizer is None:
            self._load()
        return sorted(self._languages)

    def _decoder_prompt(self, language: str, task: str, prompt: str | None) -> list[int]:
        ids = self.ids
        head: list[int] = []
        if prompt:
            # the previous-text context, as Whisper was trained with it (at most half the decoder's context)
            head = [ids["startofprev"], *self.tokenizer.encode(" " + prompt.strip(), add_special_tokens=False)[-(self.args.max_tokens // 2) :]]
        return [*head, ids["startoftranscript"], self._languages[language], ids[task], ids["notimestamps"]]

    async def _detect(self, request_id: str, audio: np.ndarray) -> str:
        sampling = {"max_tokens": 1, "temperature": 0.0, "allowed_token_ids": sorted(self._languages.values())}
        token = None
        async for toks in self.ar.generate(request_id, prompt_token_ids=[self.ids["startoftranscript"]], encoder_audio=(audio, RATE), sampling=sampling):
            token = toks[0]
        by_id = {v: k for k, v in self._languages.items()}
        return by_id.get(token, "en") if token is not None else "en"

    async def run(self, ctx: StageContext) -> None:
        import soxr

        chunks = [p for p in await ctx.input().read_all() if p.kind == PayloadKind.AUDIO]
        if not chunks:
            raise StageError("asr: no audio")
        rate = int(chunks[0].meta.get("sample_rate", RATE))
        pcm = np.concatenate([np.asarray(p.arrays["pcm"], np.float32).reshape(-1) for p in chunks])
        if rate != RATE:
            pcm = await asyncio.to_thread(soxr.resample, pcm, rate, RATE)
        # A transcription request names its task (and may set language, prompt,
        # temperature); a request that passes through asr on its way to the thinker (the
        # voice cascade's chat turn) carries the thinker's settings: it is transcribed
        # greedily, its language detected.
        p = ctx.params if ctx.params.get("task") in ("transcribe", "translate") else {}
        task = "translate" if p.get("task") == "translate" else "transcribe"
        win = int(WINDOW_S * RATE)
        language = p.get("language")
        if language is None:
            language = await self._detect(f"{ctx.request_id}-lang", pcm[:win])
        if language not in self._languages:
            raise StageError(f"asr: the model has no language {language!r}")
        temperature = float(p.get("temperature") or 0.0)
        eot = self.ids["endoftext"]
        for i, lo in enumerate(range(0, len(pcm), win)):
            part = pcm[lo : lo + win]
            meta = {"segment": i, "start": lo / RATE, "end": (lo + len(part)) / RATE, "language": language}
            decoder = self._decoder_prompt(language, task, p.get("prompt") if i == 0 else None)
            sampling = {"max_tokens": self.args.max_tokens, "temperature": temperature, "stop_token_ids": [eot]}
            out: list[int] = []
            sent = ""
            async for toks in self.ar.generate(f"{ctx.request_id}-w{i}", prompt_token_ids=decoder, encoder_audio=(part, RATE), sampling=sampling):
                ctx.add_usage(output_tokens=len(toks))
                out += [t for t in toks if t != eot]
                text = self.tokenizer.decode(out, skip_special_tokens=True)
                if text.endswith("\ufffd"):
                    continue  # inside a multi-byte character: wait for the rest
                if text[len(sent) :]:
                    await ctx.emit(Payload(PayloadKind.TEXT, ctx.fence, text=text[len(sent) :], meta=meta))
                    sent = text
