"""Builder of a tiny random Qwen3-Omni checkpoint (the voice pipeline's `omni3` profile).

Writes a directory laid out like the hub ``Qwen/Qwen3-Omni-30B-A3B-Instruct`` checkpoint,
loaded unchanged by vLLM (architecture ``Qwen3OmniMoeForConditionalGeneration``, served
by vLLM's ``Qwen3OmniMoeThinkerForConditionalGeneration``) and by transformers
(``Qwen3OmniMoeForConditionalGeneration`` / ``Qwen3OmniMoeProcessor``):

* ``config.json`` + ``model.safetensors``: the real architecture with tiny sizes: the
  thinker's MoE text model (2 layers x 256, 4 experts, 2 a token; M-RoPE), its audio
  encoder (1 layer x 128) and vision encoder (1 layer x 64); the talker (an MoE decoder
  over the first codebook, 2 layers x 128) with its code predictor (1 layer x 64, the
  other codebooks of each frame); code2wav (the causal-conv decoder: 8 codebooks at
  12.5 Hz -> 24 kHz, 1920 samples a frame, as the real one); the repo's dtypes
  (``dtype`` bfloat16 at the top level and in the thinker's config, none in the
  talker's or code2wav's; the weights in bfloat16);
* the processor files (``preprocessor_config.json``: ``WhisperFeatureExtractor`` with
  128 mels + ``Qwen2VLImageProcessor`` fields, ``processor_class: Qwen3OmniMoeProcessor``),
  the family's chat template (``<|audio_start|><|audio_pad|><|audio_end|>`` per audio
  part) and a byte-level BPE trained on `pipelines.tiny.CORPUS` with the family's special
  tokens; the role words (``system``, ``user``, ``assistant``) are pieces of their own,
  as in the real vocabulary, since the talker finds the turns by them.

Speakers are the talker config's ``speaker_id`` map (Qwen3-Omni ships no spk_dict.pt).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipelines.chat_templates import OMNI3_SPANS, qwen_chat_template
from pipelines.tiny import save_bf16, save_sampling
from pipelines.tiny.omni import DEFAULT_SYSTEM, FEATURE_EXTRACTOR, IMAGE_PROCESSOR, TEXT_CONFIG, write_tokenizer

SEED = 13
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
    "<|video_pad|>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<|audio_pad|>",
)
NAMED_TOKENS = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}
ROLE_WORDS = ("system", "user", "assistant")
CHAT_TEMPLATE = qwen_chat_template(DEFAULT_SYSTEM, multimodal=True, spans=OMNI3_SPANS)

MOE = {"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1}
THINKER_TEXT: dict[str, Any] = {
    **{k: v for k, v in TEXT_CONFIG.items() if k not in ("use_sliding_window", "intermediate_size")},
    **MOE,
    "head_dim": TEXT_CONFIG["hidden_size"] // TEXT_CONFIG["num_attention_heads"],
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "norm_topk_prob": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [8, 12, 12], "mrope_interleaved": True},
}
AUDIO_CONFIG: dict[str, Any] = {
    "num_mel_bins": FEATURE_EXTRACTOR["feature_size"], "encoder_layers": 1, "encoder_attention_heads": 4, "encoder_ffn_dim": 256,
    "d_model": 128, "max_source_positions": 1500, "n_window": 50, "n_window_infer": 400, "conv_chunksize": 500,
    "downsample_hidden_size": 32, "output_dim": THINKER_TEXT["hidden_size"],
}
VISION_CONFIG: dict[str, Any] = {
    "depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "patch_size": 16, "spatial_merge_size": 2,
    "temporal_patch_size": 2, "out_hidden_size": THINKER_TEXT["hidden_size"], "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [0], "image_size": 768, "apply_vit_abs_pos_embed": True,  # keys of the real config vLLM reads
}
# codec ids as the real talker lays them out, scaled: codes 0..CODEBOOK-1 (the real
# 0..2047), then pad, bos, eos, nothink, think-bos, think-eos and the speakers at the
# real ones' offsets past the codebook; 1024 ids past the codebook (the reference
# suppresses all but eos)
CODEBOOK = 256
CODE_GROUPS = 8
TALKER_VOCAB = CODEBOOK + 1024
SPEAKERS = {"chelsie": CODEBOOK + 253, "ethan": CODEBOOK + 254, "aiden": CODEBOOK + 255}
TALKER_TEXT: dict[str, Any] = {
    "vocab_size": TALKER_VOCAB, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 32768, **MOE, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6], "mrope_interleaved": True},
}
CODE_PREDICTOR: dict[str, Any] = {
    "vocab_size": CODEBOOK, "hidden_size": TALKER_TEXT["hidden_size"], "intermediate_size": 128, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "num_code_groups": CODE_GROUPS,
    "max_position_embeddings": 64,
}
CODE2WAV: dict[str, Any] = {
    "codebook_size": CODEBOOK, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 1,
    "intermediate_size": 128, "sliding_window": 72, "num_quantizers": CODE_GROUPS, "decoder_dim": 64,
    "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2], "max_position_embeddings": 8000,
}


def fill(out: Path) -> None:
    import torch
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    ids = write_tokenizer(out, SPECIAL_TOKENS, NAMED_TOKENS, CHAT_TEMPLATE, ROLE_WORDS)
    vocab_size = -(-(max(ids.values()) + 1) // 64) * 64
    thinker = {
        "audio_config": AUDIO_CONFIG,
        "vision_config": VISION_CONFIG,
        "text_config": {**THINKER_TEXT, "vocab_size": vocab_size, "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]},
        "audio_token_id": ids["<|audio_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "audio_start_token_id": ids["<|audio_start|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "user_token_id": ids["user"],
        "position_id_per_seconds": 13,
        "tie_word_embeddings": False,
    }
    talker = {
        "text_config": TALKER_TEXT,
        "code_predictor_config": CODE_PREDICTOR,
        "num_code_groups": CODE_GROUPS,
        "thinker_hidden_size": THINKER_TEXT["hidden_size"],
        "accept_hidden_layer": 1,  # of the thinker's 2 (the real one: 24 of 48)
        "codec_pad_id": CODEBOOK + 148, "codec_bos_id": CODEBOOK + 149, "codec_eos_token_id": CODEBOOK + 150,
        "codec_nothink_id": CODEBOOK + 155, "codec_think_bos_id": CODEBOOK + 156, "codec_think_eos_id": CODEBOOK + 157,
        "audio_token_id": ids["<|audio_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "audio_start_token_id": ids["<|audio_start|>"],
        "position_id_per_seconds": 13,
        "speaker_id": SPEAKERS,
        "spatial_merge_size": VISION_CONFIG["spatial_merge_size"],  # the real config has it; the class no default
    }
    hf_logging.set_verbosity_error()
    try:
        config = Qwen3OmniMoeConfig(
            thinker_config=thinker, talker_config=talker, code2wav_config=CODE2WAV, enable_audio_output=True,
            im_start_token_id=ids["<|im_start|>"], im_end_token_id=ids["<|im_end|>"], tts_pad_token_id=ids["<tts_pad>"],
            tts_bos_token_id=ids["<tts_text_bos>"], tts_eos_token_id=ids["<tts_text_eod>"], system_token_id=ids["system"],
            user_token_id=ids["user"], assistant_token_id=ids["assistant"], torch_dtype="bfloat16",
        )
        config.thinker_config.dtype = torch.bfloat16  # the hub's: bfloat16 here and at the top level, none in the talker's
    finally:
        hf_logging.set_verbosity_warning()
    config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    torch.manual_seed(SEED)
    model = Qwen3OmniMoeForConditionalGeneration._from_config(config, dtype=torch.float32).eval()
    # transformers' _init_weights covers the thinker's MoE blocks but not the talker's:
    # its experts are left as torch.empty (whatever memory held: zeros in a fresh
    # process, inf/NaN after other builders ran) and its router at zeros; both are drawn
    # here, seeded, as the thinker's are
    std = config.talker_config.text_config.initializer_range
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for module in model.talker.modules():
            if type(module).__name__ in ("Qwen3OmniMoeTalkerTextExperts", "Qwen3OmniMoeTalkerTextTopKRouter"):
                for param in module.parameters(recurse=False):
                    param.copy_(torch.randn(param.shape, generator=gen) * std)
    # as in the tiny Qwen2.5-Omni: a random talker samples its stop code as often as any
    # other; its row of the codec head is zeroed so the tiny speaks to its budget
    with torch.no_grad():
        model.talker.codec_head.weight[config.talker_config.codec_eos_token_id] = 0
    # the random code2wav passes almost nothing through its stages (silence at 16 bits):
    # its last conv is scaled so the tiny speaks at an audible level (RMS ~0.1)
    last = model.code2wav.decoder[-1].conv
    with torch.no_grad():
        codes = torch.randint(0, CODEBOOK, (1, CODE_GROUPS, 50), generator=torch.Generator().manual_seed(SEED))
        last.bias.zero_()
        rms = model.code2wav(codes).float().pow(2).mean().sqrt()
        last.weight.mul_(0.1 / float(rms))
    save_bf16(model, out, sub_dtypes={"thinker_config": "bfloat16"})
    save_sampling(out, [ids["<|im_end|>"], ids["<|endoftext|>"]], ids["<|endoftext|>"], 0.7)
    pre = {**FEATURE_EXTRACTOR, **IMAGE_PROCESSOR, "patch_size": VISION_CONFIG["patch_size"], "processor_class": "Qwen3OmniMoeProcessor"}
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2) + "\n")
    (out / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
