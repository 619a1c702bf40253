"""Builders of the tiny diffusion checkpoints: the image pipeline's FluxPipeline (and
SD3), the world models (Flux + a conditioner; SkyReels-V2 DF + an action module), the
live video's SkyReels-V2 diffusion forcing, and the video jobs' Wan 2.1 and LTX-Video.

Each writes a directory as diffusers saves the pipeline (``model_index.json`` and a
folder per component), with random weights from fixed seeds and tokenizers built here
(no hub), so it loads unchanged by the family's ``from_pretrained``. Called by
`pipelines.tiny.build_tiny` (which builds each atomically).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipelines.tiny import SEED


def _fill_image(out: Path) -> None:
    _fill_flux(out, SEED + 4)


def _fill_flux(out: Path, seed: int) -> None:
    """A FluxPipeline directory (loads with `FluxPipeline.from_pretrained`): a Flux
    transformer (1 double + 1 single block, width 32), a 4-level VAE (8x, narrow), a
    CLIP text encoder with a byte-level tokenizer and a T5 encoder with a character
    unigram tokenizer, both built here (no hub)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    clip_tok, clip = _clip_byte_tokenizer()
    clip_tok.save_pretrained(str(out / "tokenizer"))
    t5_tok = _t5_character_tokenizer()
    t5_tok.save_pretrained(str(out / "tokenizer_2"))
    CLIPTextModel(clip).save_pretrained(str(out / "text_encoder"))
    t5 = T5Config(vocab_size=len(t5_tok), d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2, relative_attention_num_buckets=8)
    T5EncoderModel(t5).save_pretrained(str(out / "text_encoder_2"))
    FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                           joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=False, axes_dims_rope=(4, 6, 6)).save_pretrained(str(out / "transformer"))
    AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                  block_out_channels=(4, 4, 8, 16), layers_per_block=0, latent_channels=4, norm_num_groups=4, sample_size=256,
                  mid_block_add_attention=False, shift_factor=0.0, scaling_factor=1.0, use_quant_conv=False,
                  use_post_quant_conv=False).save_pretrained(str(out / "vae"))
    FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                    max_image_seq_len=4096).save_pretrained(str(out / "scheduler"))
    components = {
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    (out / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline", **components}, indent=2) + "\n")


def _clip_byte_tokenizer() -> tuple[Any, Any]:
    """A CLIP tokenizer over the byte alphabet (no merges), made here, and a tiny CLIP
    text config (1 layer, width 32, projection 32) that fits it."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTextConfig, CLIPTokenizer

    chars = sorted(ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    bos, eos = len(vocab), len(vocab) + 1
    vocab.update({"<|startoftext|>": bos, "<|endoftext|>": eos})
    config = CLIPTextConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                            max_position_embeddings=77, projection_dim=32, bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77), config


def _fill_sd3(out: Path) -> None:
    """A StableDiffusion3Pipeline directory (loads with `from_pretrained`): two CLIP
    encoders with projections and a T5 encoder (width 64) with tokenizers made here, an
    SD3 transformer (1 layer, 4 heads x 8, 2x2 patches), a narrow 8x VAE with 16 latent
    channels and SD3's shift and scale, and flow-matching Euler (shift 3)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

    torch.manual_seed(SEED + 12)
    clip_tok, clip = _clip_byte_tokenizer()
    for n in ("tokenizer", "tokenizer_2"):
        clip_tok.save_pretrained(str(out / n))
    for n in ("text_encoder", "text_encoder_2"):
        CLIPTextModelWithProjection(clip).save_pretrained(str(out / n))
    t5_tok = _t5_character_tokenizer()
    t5_tok.save_pretrained(str(out / "tokenizer_3"))
    T5EncoderModel(T5Config(vocab_size=len(t5_tok), d_model=64, d_kv=16, d_ff=64, num_layers=1, num_heads=2,
                            relative_attention_num_buckets=8)).save_pretrained(str(out / "text_encoder_3"))
    SD3Transformer2DModel(sample_size=32, patch_size=2, in_channels=16, num_layers=1, attention_head_dim=8, num_attention_heads=4, joint_attention_dim=64,
                          caption_projection_dim=32, pooled_projection_dim=64, out_channels=16, pos_embed_max_size=96).save_pretrained(str(out / "transformer"))
    AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                  block_out_channels=(4, 4, 8, 16), layers_per_block=0, latent_channels=16, norm_num_groups=4, sample_size=256,
                  mid_block_add_attention=False, shift_factor=0.0609, scaling_factor=1.5305, use_quant_conv=False,
                  use_post_quant_conv=False).save_pretrained(str(out / "vae"))
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(str(out / "scheduler"))
    components = {
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
        "text_encoder_3": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "CLIPTokenizer"],
        "tokenizer_3": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "SD3Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    (out / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline", **components}, indent=2) + "\n")


def _t5_character_tokenizer() -> Any:
    """A T5 (unigram) tokenizer over printable ASCII characters, made here."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)] + [(chr(i), -2.0) for i in range(32, 127)]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=512)


def _fill_forcing(out: Path) -> None:
    """A SkyReelsV2DiffusionForcingPipeline directory (SkyReels-V2 DF layout; loads with
    `SkyReelsV2DiffusionForcingPipeline.from_pretrained`): the tiny Wan's text encoder
    and VAE sizes, a SkyReels-V2 transformer (2 layers, 2 heads x 12; without the fps
    embedding, `inject_sample_info`: the shapes bench runs the 1.3B checkpoint's, which
    has it) and UniPC with flow sigmas (shift 8)."""
    _fill_wan(out, transformer="SkyReelsV2Transformer3DModel", pipeline="SkyReelsV2DiffusionForcingPipeline", seed=SEED + 9, shift=8.0)


ACTION_CONFIG = {"action_dim": 4, "tokens": 4, "text_dim": 32}


def _fill_world_forcing(out: Path) -> None:
    """The world model on a diffusion-forcing backbone: the tiny SkyReels-V2 DF
    directory plus an action module (`action.json`, `action_encoder.safetensors`: 4
    action dims -> 4 tokens in the text encoder's 32-wide space)."""
    import torch
    from safetensors.torch import save_file

    from pipelines.world import ActionEncoder

    _fill_wan(out, transformer="SkyReelsV2Transformer3DModel", pipeline="SkyReelsV2DiffusionForcingPipeline", seed=SEED + 10, shift=8.0)
    torch.manual_seed(SEED + 11)
    enc = ActionEncoder(ACTION_CONFIG).eval()
    with torch.no_grad():  # default-initialised action tokens barely move a random rollout (~1 level): scaled so they do
        enc.proj[2].weight.mul_(10.0)
        enc.proj[2].bias.mul_(10.0)
    (out / "action.json").write_text(json.dumps(ACTION_CONFIG, indent=2) + "\n")
    save_file({k: v.detach().contiguous() for k, v in enc.state_dict().items()}, str(out / "action_encoder.safetensors"))


def _fill_wan(out: Path, transformer: str = "WanTransformer3DModel", pipeline: str = "WanPipeline", seed: int = SEED + 7, shift: float = 3.0) -> None:
    """A WanPipeline directory (Wan 2.1 text-to-video layout; loads with
    `WanPipeline.from_pretrained`): a UMT5 encoder (1 layer, width 32) with a character
    tokenizer made here, a Wan transformer (2 layers, 2 heads x 12, 1x2x2 patches), a
    narrow Wan VAE (8x spatial, 4x temporal, 16 latent channels) and UniPC with flow
    sigmas, as the published checkpoints ship it."""
    import diffusers
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    tok = _t5_character_tokenizer()
    tok.save_pretrained(str(out / "tokenizer"))
    UMT5EncoderModel(UMT5Config(vocab_size=len(tok), d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2,
                                relative_attention_num_buckets=8)).save_pretrained(str(out / "text_encoder"))
    getattr(diffusers, transformer)(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16, text_dim=32,
                                    freq_dim=32, ffn_dim=32, num_layers=2).save_pretrained(str(out / "transformer"))
    AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]).save_pretrained(str(out / "vae"))
    UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift, num_train_timesteps=1000).save_pretrained(str(out / "scheduler"))
    components = {
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", transformer],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    (out / "model_index.json").write_text(json.dumps({"_class_name": pipeline, **components}, indent=2) + "\n")


def _fill_ltx(out: Path) -> None:
    """An LTXPipeline directory (LTX-Video layout; loads with `LTXPipeline.from_pretrained`):
    a T5 encoder (1 layer, width 32) with a character tokenizer made here, an LTX
    transformer (1 layer, 2 heads x 8), a narrow LTX VAE (32x spatial, 8x temporal, 16
    latent channels) and flow-matching Euler."""
    import torch
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXVideoTransformer3DModel
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(SEED + 8)
    tok = _t5_character_tokenizer()
    tok.save_pretrained(str(out / "tokenizer"))
    T5EncoderModel(T5Config(vocab_size=len(tok), d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2,
                            relative_attention_num_buckets=8)).save_pretrained(str(out / "text_encoder"))
    LTXVideoTransformer3DModel(in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16, num_layers=1,
                               caption_channels=32).save_pretrained(str(out / "transformer"))
    AutoencoderKLLTXVideo(latent_channels=16, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
                          decoder_layers_per_block=(1, 1, 1, 1, 1)).save_pretrained(str(out / "vae"))
    FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
                                    max_image_seq_len=4096).save_pretrained(str(out / "scheduler"))
    components = {
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "LTXVideoTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLLTXVideo"],
    }
    (out / "model_index.json").write_text(json.dumps({"_class_name": "LTXPipeline", **components}, indent=2) + "\n")
