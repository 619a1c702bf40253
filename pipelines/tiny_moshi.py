"""Builder of a tiny random Moshi checkpoint (the `moshi` pipeline's full-duplex model).

Writes a directory as transformers saves `MoshiForConditionalGeneration`
(``save_pretrained``: ``config.json`` with the Mimi codec's config inside as
``audio_encoder_config``, ``model.safetensors`` holding the temporal transformer, the
depth decoder and Mimi), plus a tokenizer for the text stream, so it loads unchanged by
``MoshiForConditionalGeneration.from_pretrained`` — the path that loads
``kmhf/hf-moshiko`` / ``kmhf/hf-moshika``.

The real architecture at tiny widths, random weights from a fixed seed: Mimi with the
real frame layout (24 kHz, a 1920-sample hop: 12.5 frames a second, 25 Hz inside its
transformers, 8 codebooks: one semantic, seven acoustic) but 32 channels and 64 codes a
codebook; a 2-layer temporal transformer and a 1-layer depth decoder over those 8
codebooks; the text vocabulary is a byte-level BPE trained here (the real one is a
32,000-piece SentencePiece).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SEED = 23
TEXT_VOCAB = 320
CODEBOOKS = 8
AUDIO_VOCAB = 64
MIMI: dict[str, Any] = {
    "hidden_size": 32, "num_filters": 8, "num_residual_layers": 1, "upsampling_ratios": [8, 6, 5, 4], "codebook_size": AUDIO_VOCAB,
    "codebook_dim": 16, "vector_quantization_hidden_dimension": 16, "upsample_groups": 32, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64, "num_quantizers": CODEBOOKS,
    "num_semantic_quantizers": 1, "sliding_window": 250,
}
# The text stream's padding token (the real models' 3, "pad", written between words).
TEXT_PAD = "<pad>"


def fill(out: Path) -> None:
    import torch
    from tokenizers import decoders
    from transformers import MimiConfig, MoshiConfig, MoshiForConditionalGeneration, PreTrainedTokenizerFast

    from pipelines.tiny import train_byte_bpe

    tok = train_byte_bpe(TEXT_VOCAB)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<unk>", "<s>", "</s>", TEXT_PAD])
    vocab = tok.get_vocab_size()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token=TEXT_PAD)
    mimi = MimiConfig(**MIMI)
    config = MoshiConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=16, ffn_dim=128,
        audio_vocab_size=AUDIO_VOCAB, num_codebooks=CODEBOOKS, max_position_embeddings=3000, sliding_window=3000,
        pad_token_id=tok.token_to_id(TEXT_PAD), audio_encoder_config=mimi.to_dict(),
        depth_decoder_config={
            "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "ffn_dim": 64,
            "input_size": 64, "vocab_size": vocab, "audio_vocab_size": AUDIO_VOCAB, "num_codebooks": CODEBOOKS,
        },
    )
    torch.manual_seed(SEED)
    model = MoshiForConditionalGeneration(config).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
