"""Qwen/Qwen2.5-Omni-7B and Qwen/Qwen2.5-Omni-3B, as the hub ships them, shrunk.

What the repos hold (the public file lists and config values, read from copies of the
files and from code pinned to the 7B's revision): `config.json` naming
`Qwen2_5OmniModel` (transformers 4.50-era keys: `torch_dtype`, `rope_scaling`), the
thinker's and talker's configs in bfloat16, the thinker untied (`lm_head` stored; the
7B's text vocabulary 152,064 rows, the 3B's 151,936), the talker's codec ids (pad
8292, start 8293, end 8294, mask 8296 of 8,448) and text ids (pad 151859, start 151860,
end 151861), token2wav's DiT over 8,193 code embeddings; weights in bfloat16, sharded
(`model-0000N-of-00005` for the 7B; the 3B in 3), with the index; `spk_dict.pt`
(Chelsie: text start 151872, Ethan: 151870; `cond` (1, 192), `ref_mel` (1, 400, 80));
the Qwen2 tokenizer files (`vocab.json`, `merges.txt`, `tokenizer.json`,
`added_tokens.json` 151643..151664, `tokenizer_config.json` with
`Qwen2Tokenizer`, no bos, eos `<|im_end|>`, pad `<|endoftext|>`),
`preprocessor_config.json` (Whisper's 128-mel front end and Qwen2-VL's image settings,
no video processor file), `chat_template.json` (the family's template: a default
system turn, audio / image / video parts as their placeholder spans, no tools),
`generation_config.json`.

Guessed: the exact key order; the 3B's config beyond its sizes and its shard count;
whether token2wav's config names a dtype; the talker's own `architectures`; that the
tokenizer config names the processor's tokens (`audio_token`, ...) as keys of its own
(transformers 5.19's processor reads them off the tokenizer, with no fallback). Shrunk: widths and depths (head dims and M-RoPE sections as the real
ones, so positions are laid out as there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.hub.files import qwen_tokenizer, save_sharded, write_json

SEED = 5
ADDED = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|AUDIO|>", True), ("<|audio_bos|>", True),
    ("<|audio_eos|>", True), ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_bos|>", True),
    ("<|vision_eos|>", True), ("<|vision_pad|>", True), ("<|IMAGE|>", True), ("<|VIDEO|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False),
)
ADDITIONAL = ["<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
              "<|vision_bos|>", "<|vision_eos|>", "<|vision_pad|>", "<|IMAGE|>", "<|VIDEO|>"]
# what the family's processor reads off its tokenizer (tokenizer.audio_token, ...)
NAMED = {"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>", "vision_bos_token": "<|vision_bos|>",
         "vision_eos_token": "<|vision_eos|>", "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}{% set audio_count.value = audio_count.value + 1 %}"
    "{% if add_audio_id %}Audio {{ audio_count.value }}: {% endif %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPEAKERS = {"Chelsie": 151872, "Ethan": 151870}
# per size: the thinker's vocabulary and the talker's heads (head_dim, M-RoPE sections as the real ones)
SIZES: dict[str, dict[str, Any]] = {
    "7B": {"vocab": 152064, "shards": 5, "talker": {"hidden_size": 128, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 128,
                                                    "mrope_section": [16, 24, 24]}},
    "3B": {"vocab": 151936, "shards": 3, "talker": {"hidden_size": 64, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64,
                                                    "mrope_section": [16, 16, 0]}},
}
HIDDEN = 128  # the thinker's width (head_dim 128 as the real: M-RoPE [16, 24, 24])
IDS = {"audio_token_index": 151646, "image_token_index": 151655, "video_token_index": 151656, "audio_start_token_id": 151647,
       "audio_end_token_id": 151648, "vision_start_token_id": 151652, "vision_end_token_id": 151653, "vision_token_id": 151654}


def config(size: str) -> dict[str, Any]:
    s = SIZES[size]
    t = s["talker"]
    thinker = {
        "model_type": "qwen2_5_omni_thinker", "torch_dtype": "bfloat16", **IDS, "user_token_id": 872, "position_id_per_seconds": 25,
        "seconds_per_chunk": 2, "bos_token_id": 151644, "eos_token_id": 151645, "pad_token_id": 151643, "init_std": 0.02,
        "text_config": {
            "model_type": "qwen2_5_omni_text", "vocab_size": s["vocab"], "hidden_size": HIDDEN, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 1, "num_key_value_heads": 1, "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
            "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 28, "tie_word_embeddings": False, "use_cache": True,
            "attention_dropout": 0.0, "initializer_range": 0.02, "torch_dtype": "bfloat16",
        },
        "audio_config": {
            "model_type": "qwen2_5_omni_audio_encoder", "num_mel_bins": 128, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 128,
            "d_model": 64, "max_source_positions": 1500, "n_window": 100, "output_dim": HIDDEN, "activation_function": "gelu", "dropout": 0.0,
            "attention_dropout": 0.0, "activation_dropout": 0.0, "scale_embedding": False, "initializer_range": 0.02,
        },
        "vision_config": {
            "model_type": "qwen2_5_omni_vision_encoder", "depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "in_channels": 3,
            "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [0],
            "out_hidden_size": HIDDEN, "tokens_per_second": 25, "hidden_act": "silu",
        },
    }
    talker = {
        "model_type": "qwen2_5_omni_talker", "architectures": ["Qwen2OmniTalkerForConditionalGeneration"], "torch_dtype": "bfloat16",
        "vocab_size": 8448, "hidden_size": t["hidden_size"], "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": t["num_attention_heads"], "num_key_value_heads": t["num_key_value_heads"], "head_dim": t["head_dim"],
        "embedding_size": HIDDEN, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_scaling": {"mrope_section": t["mrope_section"], "rope_type": "default", "type": "default"}, "hidden_act": "silu",
        "sliding_window": 32768, "use_sliding_window": False, "tie_word_embeddings": False, **IDS, "position_id_per_seconds": 25,
        "seconds_per_chunk": 2, "tts_text_start_token_id": 151860, "tts_text_end_token_id": 151861, "tts_text_pad_token_id": 151859,
        "tts_codec_start_token_id": 8293, "tts_codec_end_token_id": 8294, "tts_codec_pad_token_id": 8292, "tts_codec_mask_token_id": 8296,
    }
    token2wav = {
        "model_type": "qwen2_5_omni_token2wav",
        "dit_config": {
            "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2, "head_dim": 32, "ff_mult": 2, "emb_dim": 32, "mel_dim": 80,
            "repeats": 2, "block_size": 24, "look_ahead_layers": [1], "look_backward_layers": [0, 2], "num_embeds": 8193, "enc_emb_dim": 192,
            "enc_dim": 32, "enc_channels": [32, 32, 32, 32, 96], "enc_kernel_sizes": [5, 3, 3, 3, 1], "enc_dilations": [1, 2, 3, 4, 1],
            "enc_attention_channels": 16, "enc_res2net_scale": 2, "enc_se_channels": 16, "max_position_embeddings": 32768, "dropout": 0.0,
        },
        "bigvgan_config": {
            "mel_dim": 80, "upsample_initial_channel": 64, "resblock_kernel_sizes": [3], "resblock_dilation_sizes": [[1, 3, 5]],
            "upsample_rates": [5, 3, 2, 2, 2, 2], "upsample_kernel_sizes": [11, 7, 4, 4, 4, 4],
        },
    }
    return {"architectures": ["Qwen2_5OmniModel"], "model_type": "qwen2_5_omni", "enable_audio_output": True, "enable_talker": True,
            "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "thinker_config": thinker, "talker_config": talker,
            "token2wav_config": token2wav}


def build(out: Path, size: str) -> None:
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    ids = qwen_tokenizer(
        out, ADDED, {},
        {"tokenizer_class": "Qwen2Tokenizer", "add_prefix_space": False, "additional_special_tokens": ADDITIONAL, "bos_token": None,
         "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 32768,
         "pad_token": "<|endoftext|>", "split_special_tokens": False, "unk_token": None, **NAMED},
        {"additional_special_tokens": ADDITIONAL, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", **NAMED},
    )
    assert ids["<|AUDIO|>"] == IDS["audio_token_index"] and ids["<|IMAGE|>"] == IDS["image_token_index"]
    cfg = config(size)
    write_json(out, "config.json", cfg)
    write_json(out, "generation_config.json", {"_from_model_config": True, "transformers_version": "4.50.0.dev0"})
    write_json(out, "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    write_json(out, "preprocessor_config.json", {
        "chunk_length": 300, "dither": 0.0, "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128, "hop_length": 160,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_processor_type": "Qwen2VLImageProcessor",
        "image_std": [0.26862954, 0.26130258, 0.27577711], "max_pixels": 12845056, "merge_size": 2, "min_pixels": 3136, "n_fft": 400,
        "n_samples": 4800000, "nb_max_frames": 30000, "padding_side": "right", "padding_value": 0.0, "patch_size": 14,
        "processor_class": "Qwen2_5OmniProcessor", "return_attention_mask": True, "sampling_rate": 16000, "temporal_patch_size": 2,
    })
    config_obj = Qwen2_5OmniConfig.from_pretrained(str(out))
    torch.manual_seed(SEED)
    model = Qwen2_5OmniForConditionalGeneration._from_config(config_obj, dtype=torch.float32).eval()
    save_sharded(model, out, SIZES[size]["shards"])
    gen = torch.Generator().manual_seed(SEED)
    speakers = {name: {"cond": torch.randn(1, 192, generator=gen), "ref_mel": torch.randn(1, 400, 80, generator=gen) * 0.5 - 4.0, "bos_token": bos}
                for name, bos in SPEAKERS.items()}
    torch.save(speakers, str(out / "spk_dict.pt"))
