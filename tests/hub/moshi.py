"""kmhf/hf-moshiko (transformers' conversion of Kyutai's Moshi 7B + Mimi), as the hub
ships it, shrunk.

What the repo holds (its file list, its generation config and the diffs of its
config, read from the hub pages; transformers' conversion script for the rest):
`config.json` (`MoshiForConditionalGeneration`, `torch_dtype` bfloat16, text vocabulary
32,000 with no `pad_token_id` / `bos_token_id`, 8 codebooks of 2,048 codes, sliding
window 3,000, untied heads, the depth decoder's config, Mimi's as
`audio_encoder_config` with its 32 quantizers of which Moshi reads 8),
`generation_config.json` (bos / pad 32000: the text stream's start token), weights in
bfloat16 over 4 shards with the index, `tokenizer.json` converted from Kyutai's
SentencePiece unigram (`<unk>` 0, `<s>` 1, `</s>` 2, `<pad>` 3, byte fallback from 4)
with a `tokenizer_config.json` / `special_tokens_map.json` that name only `<unk>`, and
Mimi's `preprocessor_config.json`; no `tokenizer.model`.

Guessed: the byte-level details of tokenizer_config.json. Shrunk: widths and depths.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.hub.files import save_sharded, sentencepiece_tokenizer, write_json

SEED = 9
TEXT_VOCAB = 32000


def config() -> dict[str, Any]:
    mimi = {
        "model_type": "mimi", "sampling_rate": 24000, "frame_rate": 12.5, "audio_channels": 1, "hidden_size": 32, "num_filters": 8,
        "num_residual_layers": 1, "upsampling_ratios": [8, 6, 5, 4], "kernel_size": 7, "last_kernel_size": 3, "residual_kernel_size": 3,
        "dilation_growth_rate": 2, "use_causal_conv": True, "pad_mode": "constant", "compress": 2, "trim_right_ratio": 1.0,
        "codebook_size": 2048, "codebook_dim": 16, "num_quantizers": 32, "use_conv_shortcut": False, "vector_quantization_hidden_dimension": 16,
        "num_semantic_quantizers": 1, "upsample_groups": 32, "num_hidden_layers": 1, "intermediate_size": 64, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "gelu", "max_position_embeddings": 8000, "initializer_range": 0.02,
        "norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": 250, "attention_dropout": 0.0, "layer_scale_initial_scale": 0.01,
        "attention_bias": False, "use_cache": True,
    }
    depth = {
        "model_type": "moshi_depth", "hidden_size": 32, "input_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 16, "ffn_dim": 64, "vocab_size": TEXT_VOCAB, "audio_vocab_size": 2048, "num_codebooks": 8,
        "max_position_embeddings": 9, "sliding_window": 8, "hidden_act": "silu", "rope_theta": 10000.0, "rms_norm_eps": 1e-8,
        "initializer_range": 0.02, "attention_dropout": 0.0, "tie_word_embeddings": False,
    }
    return {"architectures": ["MoshiForConditionalGeneration"], "model_type": "moshi", "torch_dtype": "bfloat16", "transformers_version": "4.45.0.dev0",
            "vocab_size": TEXT_VOCAB, "audio_vocab_size": 2048, "num_codebooks": 8, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "ffn_dim": 128, "hidden_act": "silu",
            "max_position_embeddings": 3000, "sliding_window": 3000, "rope_theta": 10000.0, "rms_norm_eps": 1e-8, "initializer_range": 0.02,
            "attention_dropout": 0.0, "tie_word_embeddings": False, "use_cache": True, "depth_decoder_config": depth, "audio_encoder_config": mimi}


def build(out: Path) -> None:
    from transformers import MoshiConfig, MoshiForConditionalGeneration

    tok = sentencepiece_tokenizer(out, TEXT_VOCAB)
    assert len(tok) == TEXT_VOCAB and tok.convert_ids_to_tokens([0, 1, 2, 3, 4]) == ["<unk>", "<s>", "</s>", "<pad>", "<0x00>"]
    write_json(out, "config.json", config())
    write_json(out, "generation_config.json", {
        "bos_token_id": TEXT_VOCAB, "cache_implementation": "sliding_window", "do_sample": True, "pad_token_id": TEXT_VOCAB, "temp": 0.7,
        "top_k": 25, "transformers_version": "4.46.0.dev0",
        "depth_decoder_config": {"cache_implementation": "sliding_window", "do_sample": True, "max_length": 9, "min_length": 9, "temperature": 0.8,
                                 "top_k": 250, "transformers_version": "4.46.0.dev0"},
    })
    write_json(out, "preprocessor_config.json", {"chunk_length_s": None, "feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1,
                                                 "overlap": None, "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True,
                                                 "sampling_rate": 24000})
    cfg = MoshiConfig.from_pretrained(str(out))
    torch.manual_seed(SEED)
    model = MoshiForConditionalGeneration._from_config(cfg, dtype=torch.float32).eval()
    save_sharded(model, out, 4)
