"""Builder of a tiny random Moshi checkpoint (the `moshi` pipeline's full-duplex model).

Writes a directory laid out as kmhf/hf-moshiko is (transformers' conversion of Kyutai's
release, loaded by ``MoshiForConditionalGeneration.from_pretrained``): ``config.json``
with Mimi's config inside as ``audio_encoder_config`` (bfloat16, no text pad id, as
the repo's), the weights in bfloat16 (``model.safetensors``: the temporal transformer,
the depth decoder and Mimi), Mimi's ``preprocessor_config.json``, and the text stream's
tokenizer as the conversion writes it: Kyutai's SentencePiece unigram layout (``<unk>``
0, ``<s>`` 1, ``</s>`` 2, ``<pad>`` 3, byte fallback pieces from 4, then word pieces;
trained here on `pipelines.tiny.CORPUS`) converted by transformers' ``MoshiConverter``
to ``tokenizer.json``, with a ``tokenizer_config.json`` that names only ``<unk>``.

The real architecture at tiny widths, random weights from a fixed seed: Mimi with the
real frame layout (24 kHz, a 1920-sample hop: 12.5 frames a second, 25 Hz inside its
transformers, 8 codebooks: one semantic, seven acoustic) but 32 channels and 64 codes a
codebook; a 2-layer temporal transformer and a 1-layer depth decoder over those 8
codebooks; a text vocabulary of 1,024 pieces (the real one: 32,000).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

SEED = 23
TEXT_VOCAB = 1024
CODEBOOKS = 8
AUDIO_VOCAB = 64
MIMI: dict[str, Any] = {
    "hidden_size": 32, "num_filters": 8, "num_residual_layers": 1, "upsampling_ratios": [8, 6, 5, 4], "codebook_size": AUDIO_VOCAB,
    "codebook_dim": 16, "vector_quantization_hidden_dimension": 16, "upsample_groups": 32, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64, "num_quantizers": CODEBOOKS,
    "num_semantic_quantizers": 1, "sliding_window": 250,
}
# Kyutai's control pieces, in their ids (Moshi writes 3 between words and 0 before one)
CONTROL = ("<unk>", "<s>", "</s>", "<pad>")


def text_tokenizer(out: Path) -> Any:
    """Kyutai's SentencePiece layout, trained on CORPUS and padded with word pieces to
    TEXT_VOCAB, converted as transformers' Moshi conversion does."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import MoshiConverter

    from pipelines.tiny import CORPUS

    with tempfile.TemporaryDirectory() as tmp:
        prefix = str(Path(tmp) / "text")
        spm.SentencePieceTrainer.train(sentence_iterator=iter(list(CORPUS) * 10), model_prefix=prefix, model_type="unigram",
                                       vocab_size=TEXT_VOCAB - 300, hard_vocab_limit=False, byte_fallback=True, unk_id=0, bos_id=1,
                                       eos_id=2, pad_id=3, character_coverage=1.0, num_threads=1, minloglevel=2)
        proto = pb.ModelProto()
        proto.ParseFromString(Path(prefix + ".model").read_bytes())
        for i in range(TEXT_VOCAB - len(proto.pieces)):  # word pieces, half of them starting one, up to the vocabulary
            proto.pieces.append(pb.ModelProto.SentencePiece(piece=f"\u2581w{i}" if i % 2 == 0 else f"w{i}", score=-1000.0 - i,
                                                            type=pb.ModelProto.SentencePiece.NORMAL))
        path = Path(tmp) / "tokenizer.model"
        path.write_bytes(proto.SerializeToString())
        backend = MoshiConverter(str(path)).converted()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", clean_up_tokenization_spaces=False)
    backend.save(str(out / "tokenizer.json"))
    added = {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
             for i, c in enumerate(CONTROL)}
    config = {"added_tokens_decoder": added, "clean_up_tokenization_spaces": False, "model_input_names": ["input_ids", "attention_mask"],
              "model_max_length": 1000000000000000019884624838656, "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({"unk_token": "<unk>"}, indent=2) + "\n")
    return tok


def fill(out: Path) -> None:
    import torch
    from transformers import MimiConfig, MoshiConfig, MoshiForConditionalGeneration

    from pipelines.tiny import save_bf16

    tok = text_tokenizer(out)
    assert len(tok) == TEXT_VOCAB and tok.convert_ids_to_tokens(list(range(4))) == list(CONTROL)
    mimi = MimiConfig(**MIMI)
    config = MoshiConfig(
        vocab_size=TEXT_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=16, ffn_dim=128,
        audio_vocab_size=AUDIO_VOCAB, num_codebooks=CODEBOOKS, max_position_embeddings=3000, sliding_window=3000,
        audio_encoder_config=mimi.to_dict(), torch_dtype="bfloat16",
        depth_decoder_config={
            "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "ffn_dim": 64,
            "input_size": 64, "vocab_size": TEXT_VOCAB, "audio_vocab_size": AUDIO_VOCAB, "num_codebooks": CODEBOOKS,
        },
    )
    torch.manual_seed(SEED)
    model = MoshiForConditionalGeneration._from_config(config, dtype=torch.float32).eval()
    save_bf16(model, out)
    (out / "preprocessor_config.json").write_text(json.dumps({
        "chunk_length_s": None, "feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1, "overlap": None,
        "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True, "sampling_rate": 24000}, indent=2) + "\n")
