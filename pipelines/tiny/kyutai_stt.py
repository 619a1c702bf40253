"""Builder of a tiny random Kyutai STT checkpoint (streaming speech to text: the `stt`
stage's model).

Writes a directory laid out as kyutai/stt-1b-en_fr-trfs is (transformers' conversion of
Kyutai's release, loaded by ``KyutaiSpeechToTextForConditionalGeneration.from_pretrained``):
``config.json`` with Mimi's config inside as ``codec_config``, the weights
(``model.safetensors``: the decoder and Mimi), the feature extractor's
``preprocessor_config.json`` (24 kHz; how far the text runs behind the audio), and the
text tokenizer in Kyutai's SentencePiece layout (the Moshi builder's, `pipelines.tiny.moshi`).

The real architecture at tiny widths, random weights from a fixed seed: Mimi as the tiny
Moshi's (24 kHz, 12.5 frames a second, 8 codebooks of 64 codes), a 2-layer decoder that
reads, each frame, the previous text token and the frame's 8 codes and writes the next
text token (1,024 pieces and a text BOS).
"""

from __future__ import annotations

import json
from pathlib import Path

from pipelines.tiny.moshi import AUDIO_VOCAB, CODEBOOKS, MIMI, TEXT_VOCAB, text_tokenizer

SEED = 29
DELAY_S = 0.5  # the text's delay behind the audio (stt-1b-en_fr: 0.5 s)


def fill(out: Path) -> None:
    import torch
    from transformers import KyutaiSpeechToTextConfig, KyutaiSpeechToTextForConditionalGeneration, MimiConfig

    tok = text_tokenizer(out)
    assert len(tok) == TEXT_VOCAB
    codebook_vocab = AUDIO_VOCAB + 1  # and the audio BOS
    vocab = TEXT_VOCAB + 1  # and the text BOS
    config = KyutaiSpeechToTextConfig(
        vocab_size=vocab, codebook_vocab_size=codebook_vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=16, ffn_dim=128, max_position_embeddings=750, sliding_window=375, num_codebooks=CODEBOOKS,
        audio_bos_token_id=AUDIO_VOCAB, audio_pad_token_id=vocab + CODEBOOKS * codebook_vocab, pad_token_id=3, bos_token_id=TEXT_VOCAB,
        codec_config=MimiConfig(**MIMI).to_dict(),
    )
    torch.manual_seed(SEED)
    model = KyutaiSpeechToTextForConditionalGeneration(config).eval()
    model.save_pretrained(str(out))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "audio_delay_seconds": DELAY_S, "audio_silence_prefix_seconds": 0.0, "feature_extractor_type": "KyutaiSpeechToTextFeatureExtractor",
        "feature_size": 1, "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True, "sampling_rate": 24000,
        "processor_class": "KyutaiSpeechToTextProcessor"}, indent=2) + "\n")
