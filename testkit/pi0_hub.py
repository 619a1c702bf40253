"""π0 directories laid out as the public repos are, for the tests that load them.

- `paligemma_processor`: a processor folder as google/paligemma-3b-pt-224 has it
  (`tokenizer.json`, `tokenizer_config.json`, `preprocessor_config.json`): the token ids
  are the real ones — `<pad>` 0, `<eos>` 1, `<bos>` 2, `<unk>` 3, Gemma's 256,000
  pieces (placeholders here, but for a few words), 1,024 `<locNNNN>` from 256000, 128
  `<segNNN>` from 257024, `<image>` at 257152: 257,153 tokens. The image settings are
  SigLIP's at the tiny vision tower's size.
- `pi0_dir`: a π0 whose text model embeds 257,152 ids with `image_token_id` 257152, as
  lerobot/pi0's config says (transformers' `PI0Config` defaults too), at the tiny
  widths; `layout="lerobot"` writes lerobot's parameter names and its
  `policy_preprocessor.json` / `policy_postprocessor.json` with DROID statistics.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from pipelines.tiny.pi0 import IMAGE_SIZE, PATCH, PI0_SIZES

GEMMA_PIECES = 256_000
VOCAB = 257_152  # what π0 / PaliGemma embed
IMAGE_TOKEN = 257_152  # one past the table: its positions take the vision tower's features
WORDS = "pick up the cup put it in bowl open drawer close fold towel move arm left right".split()
DROID_NORM = {"eps": 1e-8, "norm_map": {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"},
              "features": {"observation.state": {"type": "STATE", "shape": [8]}, "action": {"type": "ACTION", "shape": [8]}}}


def paligemma_processor(d: Path, extra_tokens: tuple[str, ...] = ()) -> Path:
    """The processor folder (`extra_tokens`: added after `<image>`, for refusals)."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    vocab.update({w: 4 + i for i, w in enumerate(WORDS)})
    vocab.update({f"<unused{i}>": i for i in range(len(vocab), GEMMA_PIECES)})
    vocab.update({f"<loc{i:0>4}>": GEMMA_PIECES + i for i in range(1024)})
    vocab.update({f"<seg{i:0>3}>": GEMMA_PIECES + 1024 + i for i in range(128)})
    assert len(vocab) == VOCAB
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<image>", *extra_tokens])
    assert tok.token_to_id("<image>") == IMAGE_TOKEN
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>",
                                   padding_side="right")
    d.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(d))
    side = IMAGE_SIZE
    (d / "preprocessor_config.json").write_text(json.dumps({
        "do_convert_rgb": None, "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "SiglipImageProcessor", "image_seq_length": (side // PATCH) ** 2, "image_std": [0.5, 0.5, 0.5],
        "processor_class": "PaliGemmaProcessor", "resample": 3, "rescale_factor": 1 / 255, "size": {"height": side, "width": side},
    }, indent=2))
    return d


def lerobot_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' π0 parameter names -> lerobot's (the format of lerobot/pi0_base)."""
    out = {}
    for k, v in state.items():
        if k == "model.vlm.language_model.embed_tokens.weight":
            k = "paligemma_with_expert.paligemma.lm_head.weight"
        elif k == "model.dit.embed_tokens.weight":
            k = "paligemma_with_expert.gemma_expert.lm_head.weight"
        elif k.startswith("model.vlm."):
            k = "paligemma_with_expert.paligemma.model." + k[len("model.vlm."):]
        elif k.startswith("model.dit."):
            k = "paligemma_with_expert.gemma_expert.model." + k[len("model.dit."):]
        elif k.startswith("embed_action_time."):
            k = k.replace("embed_action_time.", "")
        out[k] = v.contiguous()
    return out


def pi0_dir(d: Path, tiny_pi0: Path, layout: str = "transformers") -> Path:
    """A π0 with the real vocabulary (random weights at the tiny widths)."""
    from safetensors.numpy import save_file as save_np
    from safetensors.torch import load_file, save_file
    from transformers import PI0Config, PI0ForConditionalGeneration

    conf = json.loads((tiny_pi0 / "config.json").read_text())
    vlm = conf["vlm_config"]
    vlm.update(vocab_size=VOCAB, image_token_id=IMAGE_TOKEN)
    ids = {"vocab_size": VOCAB, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
    vlm["text_config"].update(ids)
    conf["dit_config"].update(ids)
    config = PI0Config(**{k: v for k, v in conf.items() if k not in ("architectures", "model_type", "transformers_version")})
    assert config.vlm_config.image_token_id == IMAGE_TOKEN and config.vlm_config.text_config.vocab_size == VOCAB
    assert all(config.to_dict()[k] == v for k, v in PI0_SIZES.items())
    torch.manual_seed(5)
    PI0ForConditionalGeneration(config).eval().save_pretrained(str(d), safe_serialization=True)
    if layout == "lerobot":
        weights = d / "model.safetensors"
        save_file(lerobot_keys(load_file(str(weights))), str(weights))
        stats = {f"{f}.{k}": np.full(8, v, np.float32) for f in ("observation.state", "action") for k, v in (("mean", 0.0), ("std", 1.0))}
        save_np(stats, str(d / "normalizer.safetensors"))
        for name, step in (("policy_preprocessor.json", "normalizer_processor"), ("policy_postprocessor.json", "unnormalizer_processor")):
            (d / name).write_text(json.dumps({"name": name[:-5], "steps": [{"registry_name": step, "config": DROID_NORM,
                                                                              "state_file": "normalizer.safetensors"}]}))
    return d


