"""Builder of a tiny random Whisper checkpoint (speech-to-text reference model).

Writes a directory laid out like a hub ``openai/whisper-*`` checkpoint, loadable
unchanged by ``transformers`` (``WhisperForConditionalGeneration`` / ``WhisperProcessor``
``.from_pretrained``) and by vLLM (``AsyncLLM`` with ``model=<dir>``):

* ``config.json`` + ``model.safetensors``: ``WhisperForConditionalGeneration`` with the
  real architecture (2 conv + 2 encoder layers, 2 decoder layers, tied LM head), tiny
  widths, random weights from a fixed seed;
* ``generation_config.json``: the fields real checkpoints carry (``lang_to_id``,
  ``task_to_id``, ``no_timestamps_token_id``, ``suppress_tokens``, ``alignment_heads``,
  ...) and no sampling defaults, so vLLM's ``get_diff_sampling_param`` adds nothing;
* the processor files: ``WhisperFeatureExtractor`` (80 mels, 16 kHz, 30 s chunks,
  ``preprocessor_config.json``) and a ``WhisperTokenizer`` (byte-level BPE trained here
  on `pipelines.tiny.CORPUS`: 256 byte symbols + merges, ``vocab.json``/``merges.txt``/
  ``tokenizer.json``/``normalizer.json``...), saved with
  ``WhisperProcessor(...).save_pretrained``.

Token layout follows the multilingual (large-v3) checkpoints, shifted down to the tiny
text vocabulary T: ``<|endoftext|>`` = T, ``<|startoftranscript|>`` = T+1, then the 100
language tokens in `transformers`' ``LANGUAGES`` order (the tokenizer finds a language
id as ``sot + 1 + LANGUAGES.index(code)``, and vLLM's language detection looks up all
57 of its languages, so none can be left out), ``<|translate|>``, ``<|transcribe|>``,
``<|startoflm|>``, ``<|startofprev|>``, ``<|nospeech|>``, ``<|notimestamps|>`` and the
1501 timestamp tokens ``<|0.00|>`` .. ``<|30.00|>`` (plain added tokens, as in the real
tokenizer). ``config.vocab_size`` is exactly T + 1609, as 51866 = 50257 + 1609 is for
large-v3.

Widths: vLLM's CPU attention backend supports head sizes 32, 64, 80, ... only (not 16),
so d_model 128 with 4 heads (head_dim 32) rather than 64 / 4. ``max_source_positions``
must stay 1500: the feature extractor always pads to 30 s (3000 frames), which the
stride-2 conv turns into 1500 encoder positions, and vLLM reserves exactly
``max_source_positions`` encoder tokens per request.

`pipelines.tiny.build_tiny` builds it with the other tiny checkpoints (`fill` writes
the files; the build goes into a temp dir renamed into place, marker last).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SEED = 7

# Byte alphabet (256) + up to 256 BPE merges trained on the corpus.
TEXT_VOCAB_TARGET = 512
SAMPLE_RATE = 16000
CHUNK_LENGTH_S = 30
NUM_MEL_BINS = 80
WHISPER_CONFIG: dict[str, Any] = {
    "d_model": 128,
    "encoder_layers": 2,
    "encoder_attention_heads": 4,
    "encoder_ffn_dim": 512,
    "decoder_layers": 2,
    "decoder_attention_heads": 4,
    "decoder_ffn_dim": 512,
    "num_mel_bins": NUM_MEL_BINS,
    "max_source_positions": 1500,
    "max_target_positions": 448,
    "activation_function": "gelu",
    "scale_embedding": False,
    "init_std": 0.02,
    "median_filter_width": 7,
    "tie_word_embeddings": True,
}
FEATURE_EXTRACTOR_CONFIG: dict[str, Any] = {
    "feature_size": NUM_MEL_BINS,
    "sampling_rate": SAMPLE_RATE,
    "hop_length": 160,
    "chunk_length": CHUNK_LENGTH_S,
    "n_fft": 400,
    "padding_value": 0.0,
    "return_attention_mask": False,
}
# Decoder self/cross-attention heads used by transformers for word timestamps.
ALIGNMENT_HEADS = [[1, 0], [1, 1], [1, 2], [1, 3]]

TASK_TOKENS = ("<|translate|>", "<|transcribe|>")
# Follow the language tokens, in this order, in every multilingual checkpoint (v3
# names the fifth <|nospeech|>; v1/v2 called it <|nocaptions|>).
CONTROL_TOKENS = ("<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>")
NUM_TIMESTAMPS = 1501  # <|0.00|> .. <|30.00|> in 0.02 s steps

# A small British -> American spelling map, the shape of the real normalizer.json
# (used by WhisperTokenizer.normalize / EnglishTextNormalizer).
NORMALIZER: dict[str, str] = {
    "analyse": "analyze",
    "behaviour": "behavior",
    "centre": "center",
    "colour": "color",
    "colours": "colors",
    "favourite": "favorite",
    "grey": "gray",
    "organise": "organize",
    "realise": "realize",
    "theatre": "theater",
    "travelled": "traveled",
}


def languages() -> tuple[str, ...]:
    """Language codes in the order of their tokens (transformers' Whisper ``LANGUAGES``)."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return tuple(LANGUAGES)


def timestamp_tokens() -> list[str]:
    return ["<|%.2f|>" % (i * 0.02) for i in range(NUM_TIMESTAMPS)]


def special_tokens() -> list[str]:
    """The special tokens after the text vocabulary, in id order (timestamps excluded)."""
    return [
        "<|endoftext|>",
        "<|startoftranscript|>",
        *(f"<|{code}|>" for code in languages()),
        *TASK_TOKENS,
        *CONTROL_TOKENS,
    ]


def _train_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE (Whisper/GPT-2 pre-tokenizer) on the corpus: vocab and merges."""
    from pipelines.tiny import train_byte_bpe  # it imports this module's builder lazily

    tok = train_byte_bpe(TEXT_VOCAB_TARGET)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return dict(model["vocab"]), merges  # type: ignore[return-value]


def _non_speech_tokens(tok: Any) -> list[int]:
    """openai/whisper's ``Tokenizer.non_speech_tokens``: symbols that are not speech.

    One change for the tiny vocabulary: the bare space token is never suppressed (it only
    is at the first step, via ``begin_suppress_tokens``). The real vocabulary has " -",
    " '" and " ♪"-style prefixes as merged tokens; with few merges their first token here
    is the bare space.
    """
    symbols = list('"#()*+/:;<=>@[\\]^_`{|}~「」『』')
    symbols += "<< >> <<< >>> -- --- -( -[ (' (\" (( )) ((( ))) [[ ]] {{ }} ♪♪ ♪♪♪".split()
    miscellaneous = set("♩♪♫♬♭♮♯")
    result: set[int] = set()
    for s in (" -", " '"):
        result.add(tok.encode(s, add_special_tokens=False)[0])
    for symbol in symbols + sorted(miscellaneous):
        for ids in (tok.encode(symbol, add_special_tokens=False), tok.encode(" " + symbol, add_special_tokens=False)):
            if len(ids) == 1 or symbol in miscellaneous:
                result.add(ids[0])
    result.discard(tok.convert_tokens_to_ids("Ġ"))
    return sorted(result)


def fill(out: Path) -> None:
    import torch
    from tokenizers import AddedToken
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizer,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    # --- tokenizer: BPE text vocab, then the specials and timestamps as added tokens.
    vocab, merges = _train_bpe()
    text_vocab = len(vocab)
    norm_file = out / "_normalizer_src.json"
    norm_file.write_text(json.dumps(NORMALIZER))
    specials = special_tokens()
    tok = WhisperTokenizer(
        vocab=vocab,
        merges=merges,
        normalizer_file=str(norm_file),
        unk_token=specials[0],
        bos_token=specials[0],
        eos_token=specials[0],
        pad_token=specials[0],
        add_prefix_space=False,
        model_max_length=WHISPER_CONFIG["max_target_positions"],
        clean_up_tokenization_spaces=False,
    )
    norm_file.unlink()
    tok.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, lstrip=False, rstrip=False, normalized=False, special=True) for t in specials]}
    )
    tok.add_tokens([AddedToken(t, lstrip=False, rstrip=False, normalized=False, special=False) for t in timestamp_tokens()])
    # The constructor built the post-processor's prefix before <|startoftranscript|> and
    # <|notimestamps|> existed (both became <|endoftext|>); rebuild it now.
    tok.set_prefix_tokens()
    ids = {t: tok.convert_tokens_to_ids(t) for t in specials}
    expected = {t: text_vocab + i for i, t in enumerate(specials)}
    if ids != expected:
        bad = {t: (ids[t], expected[t]) for t in specials if ids[t] != expected[t]}
        raise RuntimeError(f"tiny whisper tokenizer: special token ids out of order: {list(bad.items())[:5]}")
    first_ts = tok.convert_tokens_to_ids("<|0.00|>")
    if first_ts != text_vocab + len(specials) or len(tok) != first_ts + NUM_TIMESTAMPS:
        raise RuntimeError("tiny whisper tokenizer: timestamp token ids out of order")
    vocab_size = len(tok)

    eot = ids["<|endoftext|>"]
    sot = ids["<|startoftranscript|>"]
    space = tok.convert_tokens_to_ids("Ġ")  # " " as one byte-level token (220 in the real vocab)
    suppress = _non_speech_tokens(tok) + [
        sot,
        ids["<|translate|>"],
        ids["<|transcribe|>"],
        ids["<|startoflm|>"],
        ids["<|startofprev|>"],
        ids["<|nospeech|>"],
    ]

    feature_extractor = WhisperFeatureExtractor(**FEATURE_EXTRACTOR_CONFIG)
    WhisperProcessor(feature_extractor=feature_extractor, tokenizer=tok).save_pretrained(str(out))
    # transformers 5 writes processor_config.json + tokenizer.json/tokenizer_config.json
    # only; hub checkpoints also have preprocessor_config.json, vocab.json, merges.txt and
    # normalizer.json (transformers 4 readers need them; 5 reads normalizer.json to
    # restore `english_spelling_normalizer`). Write those too.
    feature_extractor.save_pretrained(str(out))
    tok.save_vocabulary(str(out))

    # --- model
    config = WhisperConfig(
        vocab_size=vocab_size,
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=sot,
        begin_suppress_tokens=[space, eot],
        suppress_tokens=[],
        torch_dtype="float32",
        **WHISPER_CONFIG,
    )
    torch.manual_seed(SEED)
    model = WhisperForConditionalGeneration(config).eval()
    model.save_pretrained(str(out), safe_serialization=True)

    # --- generation config: what real multilingual checkpoints carry.
    GenerationConfig(
        alignment_heads=ALIGNMENT_HEADS,
        begin_suppress_tokens=[space, eot],
        bos_token_id=eot,
        decoder_start_token_id=sot,
        eos_token_id=eot,
        pad_token_id=eot,
        forced_decoder_ids=[[1, None], [2, ids["<|transcribe|>"]]],
        is_multilingual=True,
        lang_to_id={f"<|{code}|>": ids[f"<|{code}|>"] for code in languages()},
        task_to_id={"translate": ids["<|translate|>"], "transcribe": ids["<|transcribe|>"]},
        max_initial_timestamp_index=50,
        max_length=WHISPER_CONFIG["max_target_positions"],
        no_timestamps_token_id=ids["<|notimestamps|>"],
        prev_sot_token_id=ids["<|startofprev|>"],
        return_timestamps=False,
        suppress_tokens=suppress,
    ).save_pretrained(str(out))
    for p in out.iterdir():
        p.chmod(0o644)  # safetensors writes 0600
