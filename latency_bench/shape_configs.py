"""The configurations the shapes bench builds its stages from.

`real`: each public checkpoint's own configuration — the keys of its `config.json` (the
transformers families) or of its transformer's and scheduler's configs (the diffusers
families) that decide its shapes and its step, with their published values:

* `moshi`: kmhf/hf-moshiko (Moshi 7B, the depth decoder, Mimi with 32 quantizers of
  which Moshi reads 8) — transformers' `MoshiConfig` defaults are this checkpoint;
* `pi0`: lerobot/pi0_base as transformers converts it (PaliGemma 3B: Gemma 2B + SigLIP
  so400m/14 at 224 px; the Gemma 300M action expert; 50-action chunks, 10 steps) —
  `PI0Config`'s defaults;
* `omni`: Qwen/Qwen2.5-Omni-7B's talker (896 wide, 24 layers, 12 heads of 128, 4 KV
  heads, 8,448 codes; it reads the 7B thinker's 3,584-wide states) and token2wav (the
  22-layer DiT, BigVGAN) — the token2wav part is `Qwen2_5OmniToken2WavConfig`'s defaults;
* `omni3`: Qwen/Qwen3-Omni-30B-A3B-Instruct's talker (a 20-layer MoE, 128 experts of
  384, 8 a token, reading the thinker's 2,048-wide layer 24), its 5-layer code
  predictor (16 code groups of 2,048) and code2wav — the code2wav part is
  `Qwen3OmniMoeCode2WavConfig`'s defaults with the checkpoint's 16 quantizers;
* `wan`: Wan-AI/Wan2.1-T2V-1.3B-Diffusers's transformer (30 layers, 12 heads of 128,
  FFN 8,960) and UniPC scheduler (flow shift 3);
* `skyreels`: Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers's transformer (Wan 1.3B's
  shapes, with the fps embedding: `inject_sample_info`) and UniPC (flow shift 8);
* `flux`: black-forest-labs/FLUX.1-dev's transformer (19 double + 38 single blocks,
  24 heads of 128, guidance-distilled) and its dynamic-shift Euler scheduler.

`tiny`: the same families read from the tiny checkpoints this repo builds
(`pipelines.tiny`), so the CI tier runs every stage's code at a few seconds' cost.

`tests/test_shapes_bench.py` builds each real configuration in transformers' and
diffusers' own classes (on the meta device: shapes without memory), checks the
parameter counts against the published sizes, and compares the families whose
config classes default to the public checkpoint with those defaults.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# ---- kmhf/hf-moshiko -------------------------------------------------------------------

MIMI: dict[str, Any] = {
    "model_type": "mimi", "sampling_rate": 24000, "frame_rate": 12.5, "audio_channels": 1, "hidden_size": 512, "num_filters": 64,
    "num_residual_layers": 1, "upsampling_ratios": [8, 6, 5, 4], "kernel_size": 7, "last_kernel_size": 3, "residual_kernel_size": 3,
    "dilation_growth_rate": 2, "use_causal_conv": True, "pad_mode": "constant", "compress": 2, "trim_right_ratio": 1.0,
    "codebook_size": 2048, "codebook_dim": 256, "num_quantizers": 32, "use_conv_shortcut": False, "vector_quantization_hidden_dimension": 256,
    "num_semantic_quantizers": 1, "upsample_groups": 512, "num_hidden_layers": 8, "intermediate_size": 2048, "num_attention_heads": 8,
    "num_key_value_heads": 8, "head_dim": 64, "hidden_act": "gelu", "max_position_embeddings": 8000, "norm_eps": 1e-5, "rope_theta": 10000.0,
    "sliding_window": 250, "layer_scale_initial_scale": 0.01, "attention_bias": False,
}
MOSHI: dict[str, Any] = {
    "architectures": ["MoshiForConditionalGeneration"], "model_type": "moshi", "torch_dtype": "bfloat16",
    "vocab_size": 32000, "audio_vocab_size": 2048, "num_codebooks": 8, "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "ffn_dim": 22528, "hidden_act": "silu",
    "max_position_embeddings": 3000, "sliding_window": 3000, "rope_theta": 10000.0, "rms_norm_eps": 1e-8, "tie_word_embeddings": False,
    "depth_decoder_config": {
        "model_type": "moshi_depth", "hidden_size": 1024, "input_size": 4096, "num_hidden_layers": 6, "num_attention_heads": 16,
        "num_key_value_heads": 16, "head_dim": 64, "ffn_dim": 5632, "max_position_embeddings": 9, "sliding_window": 8, "vocab_size": 32000,
        "audio_vocab_size": 2048, "num_codebooks": 8, "hidden_act": "silu", "rms_norm_eps": 1e-8, "tie_word_embeddings": False,
    },
    "audio_encoder_config": MIMI,
}

# ---- lerobot/pi0_base (transformers' PI0) ----------------------------------------------------

_GEMMA: dict[str, Any] = {"model_type": "gemma", "vocab_size": 257152, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
          "hidden_act": "gelu_pytorch_tanh", "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
PI0: dict[str, Any] = {
    "model_type": "pi0", "chunk_size": 50, "max_state_dim": 32, "max_action_dim": 32, "num_inference_steps": 10,
    "vlm_config": {
        "model_type": "paligemma", "image_token_index": 257152, "vocab_size": 257152, "projection_dim": 2048, "hidden_size": 2048,
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                          "num_attention_heads": 16, "image_size": 224, "patch_size": 14, "hidden_act": "gelu_pytorch_tanh",
                          "layer_norm_eps": 1e-6, "vision_use_head": False, "projection_dim": 2048},
        "text_config": {**_GEMMA, "hidden_size": 2048, "intermediate_size": 16384, "num_hidden_layers": 18, "num_image_tokens": 256},
    },
    "dit_config": {**_GEMMA, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 18},
}

# ---- Qwen/Qwen2.5-Omni-7B -------------------------------------------------------------------

_OMNI_IDS: dict[str, Any] = {"audio_token_index": 151646, "image_token_index": 151655, "video_token_index": 151656, "audio_start_token_id": 151647,
             "audio_end_token_id": 151648, "vision_start_token_id": 151652, "vision_end_token_id": 151653}
OMNI: dict[str, Any] = {
    "architectures": ["Qwen2_5OmniModel"], "model_type": "qwen2_5_omni", "torch_dtype": "bfloat16", "enable_audio_output": True,
    "talker_config": {
        "model_type": "qwen2_5_omni_talker", "torch_dtype": "bfloat16", "vocab_size": 8448, "embedding_size": 3584, "hidden_size": 896,
        "intermediate_size": 18944, "num_hidden_layers": 24, "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 128,
        "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"}, "sliding_window": 32768,
        "use_sliding_window": False, "tie_word_embeddings": False, **_OMNI_IDS, "position_id_per_seconds": 25, "seconds_per_chunk": 2,
        "tts_text_start_token_id": 151860, "tts_text_end_token_id": 151861, "tts_text_pad_token_id": 151859,
        "tts_codec_start_token_id": 8293, "tts_codec_end_token_id": 8294, "tts_codec_pad_token_id": 8292, "tts_codec_mask_token_id": 8296,
    },
    "token2wav_config": {
        "model_type": "qwen2_5_omni_token2wav",
        "dit_config": {
            "hidden_size": 1024, "num_hidden_layers": 22, "num_attention_heads": 16, "head_dim": 64, "ff_mult": 2, "emb_dim": 512, "mel_dim": 80,
            "repeats": 2, "block_size": 24, "look_ahead_layers": [10], "look_backward_layers": [0, 20], "num_embeds": 8193, "enc_emb_dim": 192,
            "enc_dim": 128, "enc_channels": [256, 256, 256, 256, 768], "enc_kernel_sizes": [5, 3, 3, 3, 1], "enc_dilations": [1, 2, 3, 4, 1],
            "enc_attention_channels": 64, "enc_res2net_scale": 2, "enc_se_channels": 64, "max_position_embeddings": 32768, "dropout": 0.1,
        },
        "bigvgan_config": {
            "mel_dim": 80, "upsample_initial_channel": 1536, "resblock_kernel_sizes": [3, 7, 11],
            "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]], "upsample_rates": [5, 3, 2, 2, 2, 2],
            "upsample_kernel_sizes": [11, 7, 4, 4, 4, 4],
        },
    },
}
OMNI_THINKER_HIDDEN = 3584  # Qwen2.5-Omni-7B's thinker width (the talker's embedding_size)
OMNI_SPEAKER_MEL_FRAMES = 400  # spk_dict.pt's ref_mel: (1, 400, 80)

# ---- Qwen/Qwen3-Omni-30B-A3B-Instruct ------------------------------------------------------------

_ROPE3: dict[str, Any] = {"mrope_section": [24, 20, 20], "interleaved": True, "mrope_interleaved": True, "rope_type": "default", "type": "default"}
OMNI3: dict[str, Any] = {
    "architectures": ["Qwen3OmniMoeForConditionalGeneration"], "model_type": "qwen3_omni_moe", "dtype": "bfloat16",
    "talker_config": {
        "model_type": "qwen3_omni_moe_talker", "accept_hidden_layer": 24, "num_code_groups": 16, "thinker_hidden_size": 2048,
        "codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_nothink_id": 2155, "codec_think_bos_id": 2156,
        "codec_think_eos_id": 2157, "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303}, "audio_token_id": 151675,
        "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652, "audio_start_token_id": 151669,
        "spatial_merge_size": 2, "position_id_per_seconds": 13,
        "text_config": {
            "model_type": "qwen3_omni_moe_talker_text", "vocab_size": 3072, "hidden_size": 1024, "intermediate_size": 2048,
            "moe_intermediate_size": 384, "shared_expert_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
            "decoder_sparse_step": 1, "norm_topk_prob": True, "mlp_only_layers": [], "num_hidden_layers": 20, "num_attention_heads": 16,
            "num_key_value_heads": 2, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 65536, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "rope_scaling": _ROPE3, "use_sliding_window": False, "sliding_window": None, "tie_word_embeddings": False,
        },
        "code_predictor_config": {
            "model_type": "qwen3_omni_moe_talker_code_predictor", "vocab_size": 2048, "hidden_size": 1024, "intermediate_size": 3072,
            "num_hidden_layers": 5, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "num_code_groups": 16,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu", "tie_word_embeddings": False,
            "use_sliding_window": False, "sliding_window": None,
        },
    },
    "code2wav_config": {
        "model_type": "qwen3_omni_moe_code2wav", "codebook_size": 2048, "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
        "num_key_value_heads": 16, "intermediate_size": 3072, "sliding_window": 72, "num_quantizers": 16, "decoder_dim": 1536,
        "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2], "max_position_embeddings": 8000, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5, "layer_scale_initial_scale": 0.01, "hidden_act": "silu", "attention_bias": False,
    },
}

# ---- the diffusers families: {pipeline, transformer class and config, scheduler class and config} ----

_WAN_1_3B: dict[str, Any] = {"patch_size": [1, 2, 2], "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16, "out_channels": 16,
             "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
             "eps": 1e-6, "image_dim": None, "added_kv_proj_dim": None, "rope_max_seq_len": 1024}
_UNIPC: dict[str, Any] = {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "num_train_timesteps": 1000, "solver_order": 2,
          "solver_type": "bh2", "lower_order_final": True, "predict_x0": True}
# Wan 2.1's VAE (both video checkpoints ship it; its latents' mean / std are AutoencoderKLWan's defaults)
_WAN_VAE: dict[str, Any] = {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [], "temperal_downsample": [False, True, True],
            "dropout": 0.0}
WAN: dict[str, Any] = {"pipeline": "WanPipeline", "transformer": "WanTransformer3DModel", "transformer_config": _WAN_1_3B,
       "scheduler": "UniPCMultistepScheduler", "scheduler_config": {**_UNIPC, "flow_shift": 3.0},
       "vae": "AutoencoderKLWan", "vae_config": _WAN_VAE}
SKYREELS: dict[str, Any] = {"pipeline": "SkyReelsV2DiffusionForcingPipeline", "transformer": "SkyReelsV2Transformer3DModel",
            "transformer_config": {**_WAN_1_3B, "inject_sample_info": True, "num_frame_per_block": 1},
            "scheduler": "UniPCMultistepScheduler", "scheduler_config": {**_UNIPC, "flow_shift": 8.0},
            "vae": "AutoencoderKLWan", "vae_config": _WAN_VAE}
FLUX: dict[str, Any] = {"pipeline": "FluxPipeline", "transformer": "FluxTransformer2DModel",
        "transformer_config": {"patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
                               "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768, "guidance_embeds": True,
                               "axes_dims_rope": [16, 56, 56]},
        "scheduler": "FlowMatchEulerDiscreteScheduler",
        "scheduler_config": {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
                             "base_image_seq_len": 256, "max_image_seq_len": 4096},
        "vae": "AutoencoderKL",
        "vae_config": {"in_channels": 3, "out_channels": 3, "latent_channels": 16, "block_out_channels": [128, 256, 512, 512],
                       "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4, "layers_per_block": 2,
                       "act_fn": "silu", "norm_num_groups": 32, "sample_size": 1024, "scaling_factor": 0.3611, "shift_factor": 0.1159,
                       "use_quant_conv": False, "use_post_quant_conv": False, "mid_block_add_attention": True, "force_upcast": True}}

REAL: dict[str, dict[str, Any]] = {"moshi": MOSHI, "pi0": PI0, "omni": OMNI, "omni3": OMNI3, "wan": WAN, "skyreels": SKYREELS, "flux": FLUX}
CHECKPOINTS = {"moshi": "kmhf/hf-moshiko", "pi0": "lerobot/pi0_base", "omni": "Qwen/Qwen2.5-Omni-7B",
               "omni3": "Qwen/Qwen3-Omni-30B-A3B-Instruct", "wan": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
               "skyreels": "Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers", "flux": "black-forest-labs/FLUX.1-dev"}
FAMILIES = tuple(REAL)

# the tiny checkpoint (pipelines.tiny's builder name) each family is read from at --shapes tiny
TINY = {"moshi": "moshi", "pi0": "policy", "omni": "omni", "omni3": "omni3", "wan": "video", "skyreels": "forcing", "flux": "image"}
DIFFUSERS = ("wan", "skyreels", "flux")


def _read(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def tiny(family: str, models: dict[str, Path]) -> dict[str, Any]:
    """The family's configuration read from its tiny checkpoint (`models`: build_tiny's map)."""
    d = Path(models[TINY[family]])
    if family not in DIFFUSERS:
        return _read(d / "config.json")
    index = _read(d / "model_index.json")
    def part(name: str, file: str = "config.json") -> dict[str, Any]:
        return {k: v for k, v in _read(d / name / file).items() if not k.startswith("_")}

    return {"pipeline": index["_class_name"], "transformer": index["transformer"][1], "scheduler": index["scheduler"][1], "vae": index["vae"][1],
            "transformer_config": part("transformer"), "scheduler_config": part("scheduler", "scheduler_config.json"), "vae_config": part("vae")}


def configuration(family: str, shapes: str, models: dict[str, Path] | None = None) -> dict[str, Any]:
    if shapes == "real":
        return json.loads(json.dumps(REAL[family]))  # a copy: builders may adjust it
    if models is None:
        raise ValueError("the tiny shapes are read from the tiny checkpoints: pass build_tiny's map")
    return tiny(family, models)


def transformers_config(family: str, conf: dict[str, Any]) -> Any:
    """The transformers config object of a transformers family's configuration."""
    import transformers

    cls = {"moshi": transformers.MoshiConfig, "pi0": transformers.PI0Config, "omni": transformers.Qwen2_5OmniConfig,
           "omni3": transformers.Qwen3OmniMoeConfig}[family]
    body = {k: v for k, v in conf.items() if k not in ("architectures", "model_type", "transformers_version")}
    return cls(**body)


DEPTH_KEYS = ("num_hidden_layers", "num_layers", "num_single_layers", "depth", "encoder_layers")


def shallow(conf: dict[str, Any], layers: int) -> dict[str, Any]:
    """`conf` with every layer stack cut to at most `layers` (widths, vocabularies and heads
    kept): the real shapes' code paths at a cost a small machine can run, not their timings."""

    def cut(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: (min(int(v), layers) if k in DEPTH_KEYS and isinstance(v, int) else cut(v)) for k, v in x.items()}
        return x

    out: dict[str, Any] = cut(conf)
    return out
