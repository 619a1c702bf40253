"""Builder of a tiny random π0 checkpoint (the robot pipeline's reference policy).

Writes a directory as transformers saves a π0 (`PI0ForConditionalGeneration` /
`PI0Processor` ``.save_pretrained``), loadable unchanged by
``PI0ForConditionalGeneration.from_pretrained`` and by the robot pipeline:

* ``config.json`` + ``model.safetensors``: the real architecture — a PaliGemma prefix
  (SigLIP vision tower, 14-pixel patches of 112x112 images, 64 tokens per camera, where
  the real one has 224x224 and 256; a Gemma text model) and a Gemma action expert with the VLM's layer count, KV heads and
  head size (it attends into the VLM's cache) — at tiny widths, random weights from a
  fixed seed; a 16-step chunk, state and actions padded to 32 dims, 10 flow steps;
* the processor files ``PI0Processor`` writes: ``processor_config.json`` (the image
  processor's settings: resize to 112x112, bicubic, scaled to [-1, 1]; 64 image
  tokens) and a byte-level BPE tokenizer trained here on `pipelines.tiny.CORPUS`, with
  PaliGemma's special tokens (``<pad>``, ``<eos>``, ``<bos>``, ``<unk>``, ``<image>``) and
  its 1024 ``<locNNNN>`` and 128 ``<segNNN>`` tokens, which the processor would add
  anyway.

No normalisation statistics: a checkpoint fine-tuned on one embodiment carries them
(lerobot's ``policy_preprocessor.json``/``policy_postprocessor.json``), a base model
serves raw values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SEED = 11
TEXT_VOCAB = 512
PALIGEMMA_SPECIAL = ("<pad>", "<eos>", "<bos>", "<unk>", "<image>")
# Real π0 sees 224x224 (256 tokens a camera); the tiny one 112x112 (64 tokens), so that on
# a CPU the prefix encode does not dwarf the denoising steps that robots share.
IMAGE_SIZE = 112
PATCH = 14
PI0_SIZES: dict[str, Any] = {"chunk_size": 16, "max_state_dim": 32, "max_action_dim": 32, "num_inference_steps": 10}
# The expert attends into the VLM's KV cache: same layers, KV heads and head size.
LAYERS, KV_HEADS, HEAD_DIM = 2, 1, 32


def fill(out: Path) -> None:
    import torch
    from tokenizers import decoders
    from transformers import PI0Config, PI0ForConditionalGeneration, PI0Processor, PreTrainedTokenizerFast

    from pipelines.robot import Pi0ImageProcessor
    from pipelines.tiny import train_byte_bpe

    tok = train_byte_bpe(TEXT_VOCAB)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(PALIGEMMA_SPECIAL))
    tok.add_tokens([f"<loc{i:0>4}>" for i in range(1024)] + [f"<seg{i:0>3}>" for i in range(128)])
    vocab = tok.get_vocab_size()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>", padding_side="right"
    )
    image_token = tok.token_to_id("<image>")
    gemma = {"model_type": "gemma", "num_hidden_layers": LAYERS, "num_attention_heads": 2, "num_key_value_heads": KV_HEADS,
             "head_dim": HEAD_DIM, "vocab_size": vocab, "pad_token_id": tok.token_to_id("<pad>"),
             "bos_token_id": tok.token_to_id("<bos>"), "eos_token_id": tok.token_to_id("<eos>")}
    config = PI0Config(
        vlm_config={
            "model_type": "paligemma",
            "text_config": {**gemma, "hidden_size": 64, "intermediate_size": 128},
            "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                              "num_attention_heads": 2, "patch_size": PATCH, "image_size": IMAGE_SIZE, "vision_use_head": False},
            "projection_dim": 64,
            "image_token_id": image_token,
            "vocab_size": vocab,
        },
        dit_config={**gemma, "hidden_size": 32, "intermediate_size": 64},
        **PI0_SIZES,
    )
    torch.manual_seed(SEED)
    model = PI0ForConditionalGeneration(config).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    images = Pi0ImageProcessor(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, pad_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_seq_length=(IMAGE_SIZE // PATCH) ** 2,
    )
    processor = PI0Processor(image_processor=images, tokenizer=tokenizer)
    processor.save_pretrained(str(out))
    # name the class transformers' AutoProcessor builds (it needs torchvision; the robot
    # pipeline runs the same settings on PIL)
    path = out / "processor_config.json"
    conf = json.loads(path.read_text())
    conf["image_processor"]["image_processor_type"] = "PI0ImageProcessor"
    path.write_text(json.dumps(conf, indent=2) + "\n")
