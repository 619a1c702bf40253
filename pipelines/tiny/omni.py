"""Builder of a tiny random Qwen2.5-Omni checkpoint (the voice pipeline's speech-in thinker).

Writes a directory laid out like the hub ``Qwen/Qwen2.5-Omni-*`` checkpoints, loaded
unchanged by vLLM (``AsyncLLM`` with ``model=<dir>``: architecture
``Qwen2_5OmniForConditionalGeneration``, served by vLLM's own
``Qwen2_5OmniThinkerForConditionalGeneration``, which runs the audio tower on the
audio it is given) and by transformers (``Qwen2_5OmniForConditionalGeneration`` /
``Qwen2_5OmniProcessor.from_pretrained``):

* ``config.json`` + ``model.safetensors``: the architecture the hub repos name
  (``Qwen2_5OmniModel``) with the thinker, the talker and token2wav, the real
  architecture with tiny sizes: text 2 layers x 256 (M-RoPE), audio tower 1 layer x
  128, vision tower 1 layer x 64; the repos' dtypes (bfloat16 at the top level and in
  the thinker's and talker's configs; the weights in bfloat16);
* the processor files of the real checkpoints: ``preprocessor_config.json``
  (``WhisperFeatureExtractor`` with 128 mels + ``Qwen2VLImageProcessor`` fields,
  ``processor_class: Qwen2_5OmniProcessor``), ``chat_template.json`` (the family's template: ``<|audio_bos|><|AUDIO|><|audio_eos|>``
  per audio part, and function calling, which the real template lacks) and the Qwen2
  tokenizer files the repos ship (``Qwen2Tokenizer``: ``vocab.json``, ``merges.txt``,
  ``tokenizer.json``, ``added_tokens.json``, ``special_tokens_map.json``): a byte-level
  BPE trained here on `pipelines.tiny.CORPUS` with the family's special tokens in its
  order (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ``<|AUDIO|>``, ...), each
  multimodal token named in ``tokenizer_config.json`` as the processor reads it; no
  video processor file (the repos have none);
* ``spk_dict.pt``: the speakers file the hub repos ship (transformers loads it), with
  their shapes: ``cond`` (1, 192), ``ref_mel`` (1, 400, 80).

The processor JSON is written as dicts, not with ``save_pretrained``: the video
processor transformers builds needs torchvision, which this environment lacks (see
`omni_rt.vllm_plugin`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipelines.chat_templates import TOOL_TOKENS, qwen_chat_template
from pipelines.tiny import TEXT_VOCAB_SIZE, THINKER_CONFIG, save_bf16, save_sampling, train_byte_bpe

SEED = 11
SAMPLE_RATE = 16000
NUM_MEL_BINS = 128  # Qwen2.5-Omni's front end: Whisper-large-v3's 128-mel log-mel

# In the order of the real tokenizer's added tokens (151643..151656 there).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|vision_pad|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
)
# what Qwen2_5OmniProcessor reads from the tokenizer (tokenizer.audio_token ...)
NAMED_TOKENS = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}
DEFAULT_SYSTEM = "You are a helpful assistant."
# The family's chat template: string contents as they are, list contents part by
# part (audio, image and video parts as their placeholder spans), a default system
# turn when the conversation has none, and the family's function calling.
CHAT_TEMPLATE = qwen_chat_template(DEFAULT_SYSTEM, multimodal=True)

# The legacy Qwen2 thinker's sizes (2 layers x 256, 4 heads, 2 kv heads), so the two
# profiles compare on equal text models; M-RoPE over (time, height, width), its
# sections splitting head_dim / 2 = 32; an LM head of its own (transformers' thinker
# ties by the thinker config, vLLM by the text config: with both false they load the
# same weights).
TEXT_CONFIG: dict[str, Any] = {
    **{k: v for k, v in THINKER_CONFIG.items() if k not in ("rope_theta", "tie_word_embeddings")},
    "hidden_act": "silu",
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": THINKER_CONFIG["rope_theta"], "mrope_section": [8, 12, 12]},
}
AUDIO_CONFIG: dict[str, Any] = {
    "num_mel_bins": NUM_MEL_BINS,
    "encoder_layers": 1,
    "encoder_attention_heads": 4,
    "encoder_ffn_dim": 256,
    "d_model": 128,
    "max_source_positions": 1500,
    "n_window": 100,
    "output_dim": TEXT_CONFIG["hidden_size"],
}
VISION_CONFIG: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "out_hidden_size": TEXT_CONFIG["hidden_size"],
    "fullatt_block_indexes": [0],
}
# The talker (Qwen2_5OmniTalkerForConditionalGeneration, a Qwen2 decoder over codec
# tokens fed the thinker's states): 2 layers x 128, M-RoPE sections over head_dim / 2.
# Codec ids as in the real one, scaled: codes 0..1023 (the real 0..8192), then pad,
# start, end and mask where 8292, 8293, 8294 and 8296 are.
CODEC_CODES = 1024
TALKER_CONFIG: dict[str, Any] = {
    "vocab_size": 1152,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 8192,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]},
    "tts_codec_pad_token_id": CODEC_CODES + 100,
    "tts_codec_start_token_id": CODEC_CODES + 101,
    "tts_codec_end_token_id": CODEC_CODES + 102,
    "tts_codec_mask_token_id": CODEC_CODES + 104,
    "position_id_per_seconds": 25,
    "seconds_per_chunk": 2,
    "tie_word_embeddings": False,
}
# token2wav: the flow-matching DiT (codes at 50 Hz -> 80-bin mel at 100 Hz, in blocks of
# 24 mel frames with one block of look-back / look-ahead in some layers, as the real
# one) and BigVGAN (mel -> 24 kHz, 240 samples a frame: the real upsampling rates)
TOKEN2WAV_CONFIG: dict[str, Any] = {
    "dit_config": {
        "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2, "head_dim": 32, "ff_mult": 2, "emb_dim": 32,
        "block_size": 24, "look_ahead_layers": [1], "look_backward_layers": [0, 2], "repeats": 2, "num_embeds": CODEC_CODES,
        "mel_dim": 80, "dropout": 0.0, "enc_emb_dim": 192, "enc_dim": 32, "enc_channels": [32, 32, 32, 32, 96],
        "enc_kernel_sizes": [5, 3, 3, 3, 1], "enc_dilations": [1, 2, 3, 4, 1], "enc_attention_channels": 16,
        "enc_res2net_scale": 2, "enc_se_channels": 16, "max_position_embeddings": 32768,
    },
    "bigvgan_config": {
        "mel_dim": 80, "upsample_initial_channel": 64, "resblock_kernel_sizes": [3], "resblock_dilation_sizes": [[1, 3, 5]],
        "upsample_rates": [5, 3, 2, 2, 2, 2], "upsample_kernel_sizes": [11, 7, 4, 4, 4, 4],
    },
}
SPEAKERS = ("Chelsie", "Ethan")
FEATURE_EXTRACTOR: dict[str, Any] = {
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": NUM_MEL_BINS,
    "sampling_rate": SAMPLE_RATE,
    "hop_length": 160,
    "n_fft": 400,
    "chunk_length": 300,
    "n_samples": 300 * SAMPLE_RATE,
    "nb_max_frames": 30000,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
    "dither": 0.0,
}
IMAGE_PROCESSOR: dict[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "rescale_factor": 0.00392156862745098,
    "resample": 3,
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": VISION_CONFIG["patch_size"],
    "temporal_patch_size": VISION_CONFIG["temporal_patch_size"],
    "merge_size": VISION_CONFIG["spatial_merge_size"],
}


def write_tokenizer(out: Path, specials: tuple[str, ...] = SPECIAL_TOKENS, named: dict[str, str] = NAMED_TOKENS,
                    chat_template: str = CHAT_TEMPLATE, words: tuple[str, ...] = ()) -> dict[str, int]:
    """The family's tokenizer files: the byte-level BPE, then `specials` (ids returned),
    the function-call markers, and `words` as pieces of their own (added, not special)."""
    from tokenizers import AddedToken, decoders

    tok = train_byte_bpe(TEXT_VOCAB_SIZE)
    tok.decoder = decoders.ByteLevel()
    text_vocab = tok.get_vocab_size()
    model = json.loads(tok.to_str())["model"]
    tok.add_special_tokens(list(specials))
    # then the function-call markers, added tokens that are not special (as at 151657.. there)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (*TOOL_TOKENS, *words)])
    tok.save(str(out / "tokenizer.json"))
    ids = {t: text_vocab + i for i, t in enumerate(specials)}
    ids.update({t: text_vocab + len(specials) + i for i, t in enumerate(TOOL_TOKENS)})
    ids.update({t: text_vocab + len(specials) + len(TOOL_TOKENS) + i for i, t in enumerate(words)})
    # the slow tokenizer's files the repos carry beside tokenizer.json
    (out / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False) + "\n")
    merges = ["#version: 0.2", *(m if isinstance(m, str) else " ".join(m) for m in model["merges"])]
    (out / "merges.txt").write_text("\n".join(merges) + "\n")
    (out / "added_tokens.json").write_text(json.dumps(ids, indent=2, sort_keys=True) + "\n")
    additional = [t for t in specials if t != "<|endoftext|>"]
    special_map = {"additional_special_tokens": additional, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", **named}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "bos_token": None,
        "unk_token": None,
        **special_map,
        "chat_template": chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ids


def fill(out: Path) -> None:
    import torch
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    ids = write_tokenizer(out)
    n_text = min(ids.values())
    # the talker's text-stream ids and one start id per speaker come after the pieces
    reserved = n_text + len(SPECIAL_TOKENS) + len(TOOL_TOKENS)
    vocab_size = -(-(reserved + 3 + len(SPEAKERS)) // 64) * 64
    thinker = {
        "audio_config": AUDIO_CONFIG,
        "vision_config": VISION_CONFIG,
        "text_config": {**TEXT_CONFIG, "vocab_size": vocab_size, "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]},
        "audio_token_index": ids["<|AUDIO|>"],
        "image_token_index": ids["<|IMAGE|>"],
        "video_token_index": ids["<|VIDEO|>"],
        "audio_start_token_id": ids["<|audio_bos|>"],
        "audio_end_token_id": ids["<|audio_eos|>"],
        "vision_start_token_id": ids["<|vision_bos|>"],
        "vision_end_token_id": ids["<|vision_eos|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "user_token_id": ids["<|im_start|>"],
        "position_id_per_seconds": 25,
        "seconds_per_chunk": 2,
        "pad_token_id": ids["<|endoftext|>"],
        "tie_word_embeddings": False,
    }
    talker = {
        **TALKER_CONFIG,
        "embedding_size": TEXT_CONFIG["hidden_size"],
        "audio_token_index": ids["<|AUDIO|>"],
        "image_token_index": ids["<|IMAGE|>"],
        "video_token_index": ids["<|VIDEO|>"],
        "vision_start_token_id": ids["<|vision_bos|>"],
        "vision_end_token_id": ids["<|vision_eos|>"],
        "audio_start_token_id": ids["<|audio_bos|>"],
        "audio_end_token_id": ids["<|audio_eos|>"],
        # thinker-vocabulary rows the talker's text stream uses (unnamed ids past the
        # tokenizer's pieces, as 151859.. are in the real vocabulary)
        "tts_text_pad_token_id": reserved,
        "tts_text_start_token_id": reserved + 1,
        "tts_text_end_token_id": reserved + 2,
    }
    hf_logging.set_verbosity_error()
    try:
        config = Qwen2_5OmniConfig(thinker_config={**thinker, "torch_dtype": "bfloat16"}, talker_config={**talker, "torch_dtype": "bfloat16"},
                                   token2wav_config=TOKEN2WAV_CONFIG, enable_audio_output=True, torch_dtype="bfloat16")
    finally:
        hf_logging.set_verbosity_warning()
    config.architectures = ["Qwen2_5OmniModel"]  # what the hub repos name (transformers saves Qwen2_5OmniForConditionalGeneration)
    torch.manual_seed(SEED)
    model = Qwen2_5OmniForConditionalGeneration._from_config(config, dtype=torch.float32).eval()
    # BigVGAN's random init passes almost nothing through its ten conv stages (~1e-8 at
    # the output): its last conv is scaled so the tiny speaks at an audible level (RMS
    # ~0.1 for a DiT-like mel), or every answer would be silence at 16 bits
    # A random talker samples its stop codes (codec pad / end) as often as any code and
    # would end most answers within a few frames; a trained one stops at the end of
    # speech. Their rows of the codec head are zeroed (logit 0, below the top codes of a
    # zero-mean head): the tiny speaks to its budget, as the tiny Orpheus talker does.
    with torch.no_grad():
        tc = config.talker_config
        model.talker.codec_head.weight[[tc.tts_codec_pad_token_id, tc.tts_codec_end_token_id]] = 0
    vocoder = model.token2wav.code2wav_bigvgan_model
    with torch.no_grad():
        rms = vocoder(torch.randn(1, 80, 200, generator=torch.Generator().manual_seed(SEED))).float().pow(2).mean().sqrt()
        vocoder.conv_post.weight.mul_(0.1 / float(rms))
    save_bf16(model, out, "Qwen2_5OmniModel", {"thinker_config": "bfloat16", "talker_config": "bfloat16"})
    save_sampling(out, [ids["<|im_end|>"], ids["<|endoftext|>"]], ids["<|endoftext|>"], 0.7)
    pre = {**FEATURE_EXTRACTOR, **IMAGE_PROCESSOR, "processor_class": "Qwen2_5OmniProcessor"}
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2) + "\n")
    (out / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    # the speakers file every Qwen2.5-Omni repo ships (transformers' from_pretrained
    # requires it): per voice an x-vector `cond` (the DiT's speaker embedding), a
    # reference mel (`ref_mel`, what the DiT's ECAPA encoder reads) and the thinker-
    # vocabulary id that starts the talker's text stream
    gen = torch.Generator().manual_seed(SEED + 1)
    speakers = {name: {"cond": torch.randn(1, 192, generator=gen), "ref_mel": torch.randn(1, 400, 80, generator=gen) * 0.5 - 4.0,
                       "bos_token": reserved + 3 + i}
                for i, name in enumerate(SPEAKERS)}
    torch.save(speakers, str(out / "spk_dict.pt"))
