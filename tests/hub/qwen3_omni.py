"""Qwen/Qwen3-Omni-30B-A3B-Instruct, as the hub ships it, shrunk.

What the repo holds (its config's values as copies of the file and code that reads the
real checkpoint show them): `config.json` naming `Qwen3OmniMoeForConditionalGeneration`
with `dtype` bfloat16 at the top level and in `thinker_config`, none in `talker_config`
or `code2wav_config` (transformers' `from_pretrained` loads all of it in bfloat16; a
sub-model built from its own sub-config alone would be float32), the thinker's MoE text
model (vocabulary 152,064; M-RoPE [24, 20, 20] interleaved over head_dim 128), the
talker taking the thinker's layer `accept_hidden_layer` (24 of 48: here 1 of 2), 16 code
groups of 2,048 codes, codec ids (pad 2148, bos 2149, eos 2150, nothink 2155, think
bos / eos 2156 / 2157 of 3,072), speakers in `talker_config.speaker_id` (chelsie 2301,
ethan 2302, aiden 2303), the role ids (system 8948, user 872, assistant 77091 as
pieces of the BPE, `<|im_start|>` 151644), the tts ids (151671..151673), the audio ids
(`<|audio_start|>` 151669, `<|audio_end|>` 151670, `<|audio_pad|>` 151675); weights in
bfloat16 over 15 shards (`model-000NN-of-00015`) with the index, experts stored one by
one; `tokenizer_config.json` (`Qwen2Tokenizer`), `chat_template.json`,
`preprocessor_config.json`, `generation_config.json`; no `spk_dict.pt`, no video
processor file.

Guessed: the ids 151646..151651 and 151657..151668 (the usual Qwen3 layout); the
chat template's wording (the family's: tools, a default system turn not forced,
audio parts as `<|audio_start|><|audio_pad|><|audio_end|>`). Shrunk: widths, depths and
expert counts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.hub.files import qwen_tokenizer, save_sharded, write_json

SEED = 7
ADDED = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True), ("<|object_ref_end|>", True),
    ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True),
    ("<|vision_end|>", True), ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False), ("<think>", False),
    ("</think>", False), ("<|audio_start|>", True), ("<|audio_end|>", True), ("<tts_pad>", True), ("<tts_text_bos>", True),
    ("<tts_text_eod>", True), ("<tts_text_bos_single>", True), ("<|audio_pad|>", True),
)
NAMED = {"image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>", "video_token": "<|video_pad|>", "vision_bos_token": "<|vision_start|>",
         "vision_eos_token": "<|vision_end|>", "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>"}
ROLES = {"system": 8948, "user": 872, "assistant": 77091}
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}"
    "{{ 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:' }}"
    "{{ '\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{% if messages[0].content is string %}{{ messages[0].content }}"
    "{% else %}{% for c in messages[0].content %}{% if 'text' in c %}{{ c.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ message.content }}\n</tool_response>{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message.role }}\n{% if message.content is string %}{{ message.content }}{% else %}"
    "{% for c in message.content %}{% if c.type == 'audio' or 'audio' in c or 'audio_url' in c %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif c.type == 'image' or 'image' in c or 'image_url' in c %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c.type == 'video' or 'video' in c %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in c %}{{ c.text }}{% endif %}{% endfor %}{% endif %}"
    "{% if message.tool_calls %}{% for tc in message.tool_calls %}{% set f = tc.function if tc.function is defined else tc %}"
    "\n<tool_call>\n{\"name\": \"{{ f.name }}\", \"arguments\": {% if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson }}{% endif %}}\n</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ROPE = {"mrope_section": [24, 20, 20], "interleaved": True, "mrope_interleaved": True, "rope_type": "default"}
HIDDEN = 128


def config() -> dict[str, Any]:
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "norm_topk_prob": True, "mlp_only_layers": []}
    text = {
        "model_type": "qwen3_omni_moe_text", "vocab_size": 152064, "hidden_size": HIDDEN, "intermediate_size": 256, "moe_intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 128, "hidden_act": "silu",
        "max_position_embeddings": 65536, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": ROPE, "use_sliding_window": False,
        "sliding_window": None, "tie_word_embeddings": False, "attention_bias": False, "use_qk_norm": True, "dtype": None, **moe,
        "shared_expert_intermediate_size": 0,
    }
    thinker = {
        "model_type": "qwen3_omni_moe_thinker", "dtype": "bfloat16", "audio_token_id": 151675, "image_token_id": 151655, "video_token_id": 151656,
        "audio_start_token_id": 151669, "audio_end_token_id": 151670, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
        "user_token_id": 872, "position_id_per_seconds": 13, "seconds_per_chunk": 2, "initializer_range": 0.02, "text_config": text,
        "audio_config": {
            "model_type": "qwen3_omni_moe_audio_encoder", "dtype": None, "num_mel_bins": 128, "encoder_layers": 1, "encoder_attention_heads": 2,
            "encoder_ffn_dim": 128, "d_model": 64, "max_source_positions": 1500, "n_window": 50, "n_window_infer": 800, "conv_chunksize": 500,
            "downsample_hidden_size": 32, "output_dim": HIDDEN, "activation_function": "gelu", "scale_embedding": False,
        },
        "vision_config": {
            "model_type": "qwen3_omni_moe_vision_encoder", "dtype": None, "depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
            "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": HIDDEN,
            "num_position_embeddings": 2304, "deepstack_visual_indexes": [0], "image_size": 768, "apply_vit_abs_pos_embed": True,
            "hidden_act": "gelu_pytorch_tanh",
        },
    }
    talker = {
        "model_type": "qwen3_omni_moe_talker", "accept_hidden_layer": 1, "num_code_groups": 16, "thinker_hidden_size": HIDDEN,
        "codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_nothink_id": 2155, "codec_think_bos_id": 2156,
        "codec_think_eos_id": 2157, "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303}, "audio_token_id": 151675,
        "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652, "audio_start_token_id": 151669,
        "audio_end_token_id": 151670, "spatial_merge_size": 2, "position_id_per_seconds": 13, "seconds_per_chunk": 2,
        "output_router_logits": False,
        "text_config": {
            "model_type": "qwen3_omni_moe_talker_text", "vocab_size": 3072, "hidden_size": HIDDEN, "intermediate_size": 256,
            "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 1,
            "num_key_value_heads": 1, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 65536, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "rope_scaling": ROPE, "use_sliding_window": False, "sliding_window": None, "tie_word_embeddings": False,
            **moe,
        },
        "code_predictor_config": {
            "model_type": "qwen3_omni_moe_talker_code_predictor", "dtype": None, "vocab_size": 2048, "hidden_size": HIDDEN,
            "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 128,
            "num_code_groups": 16, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
            "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None,
        },
    }
    code2wav = {
        "model_type": "qwen3_omni_moe_code2wav", "codebook_size": 2048, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2, "intermediate_size": 128, "sliding_window": 72, "num_quantizers": 16, "num_semantic_quantizers": 1,
        "semantic_codebook_size": 4096, "decoder_dim": 64, "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2],
        "max_position_embeddings": 8000, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "layer_scale_initial_scale": 0.01,
        "hidden_act": "silu", "attention_bias": False,
    }
    return {"architectures": ["Qwen3OmniMoeForConditionalGeneration"], "model_type": "qwen3_omni_moe", "dtype": "bfloat16",
            "transformers_version": "4.57.0.dev0", "enable_audio_output": True, "im_start_token_id": 151644, "im_end_token_id": 151645,
            "tts_pad_token_id": 151671, "tts_bos_token_id": 151672, "tts_eos_token_id": 151673, "system_token_id": 8948, "user_token_id": 872,
            "assistant_token_id": 77091, "thinker_config": thinker, "talker_config": talker, "code2wav_config": code2wav}


def build(out: Path) -> None:
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    ids = qwen_tokenizer(
        out, ADDED, ROLES,
        {"tokenizer_class": "Qwen2Tokenizer", "add_prefix_space": False, "bos_token": None, "clean_up_tokenization_spaces": False,
         "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 131072, "pad_token": "<|endoftext|>", "split_special_tokens": False,
         "unk_token": None, **NAMED},
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", **NAMED},
    )
    assert ids["<|audio_pad|>"] == 151675 and ids["<tts_pad>"] == 151671
    write_json(out, "config.json", config())
    write_json(out, "generation_config.json", {"_from_model_config": True, "transformers_version": "4.57.0.dev0"})
    write_json(out, "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    write_json(out, "preprocessor_config.json", {
        "chunk_length": 300, "dither": 0.0, "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128, "hop_length": 160,
        "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessor", "image_std": [0.5, 0.5, 0.5], "max_pixels": 12845056,
        "merge_size": 2, "min_pixels": 3136, "n_fft": 400, "n_samples": 4800000, "nb_max_frames": 30000, "padding_side": "right",
        "padding_value": 0.0, "patch_size": 16, "processor_class": "Qwen3OmniMoeProcessor", "return_attention_mask": True,
        "sampling_rate": 16000, "temporal_patch_size": 2,
    })
    config_obj = Qwen3OmniMoeConfig.from_pretrained(str(out))
    torch.manual_seed(SEED)
    model = Qwen3OmniMoeForConditionalGeneration._from_config(config_obj, dtype=torch.float32).eval()
    # transformers' _init_weights leaves the talker's experts and router as allocated
    # (torch.empty): drawn here, as a trained checkpoint would have them, seeded
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for module in model.talker.modules():
            if type(module).__name__ in ("Qwen3OmniMoeTalkerTextExperts", "Qwen3OmniMoeTalkerTextTopKRouter"):
                for p in module.parameters(recurse=False):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    save_sharded(model, out, 15)
