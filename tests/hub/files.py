"""What the hub-shaped builders share: the text they train tokenizers on, the Qwen
families' byte-level BPE with its real token ids, Kyutai's SentencePiece layout, and
weights written as the hub shards them."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

CORPUS: tuple[str, ...] = (
    "Hello there, how are you today?",
    "I am doing well, thank you for asking.",
    "What is the weather like in Paris this morning?",
    "It is sunny and warm, with a light wind from the west.",
    "Could you tell me something nice about the sea?",
    "The sea is calm tonight and the moon is bright above the water.",
    "Please book a table for two at seven in the evening.",
    "Sure, I have booked a table for two people at seven.",
    "The user asked the assistant a question and the system answered.",
    "system user assistant system user assistant tool function call",
    "system\nYou are a helpful assistant.",
    "user\nWhat time is it?",
    "assistant\nIt is seven in the evening.",
    "Numbers like 1, 2, 3, 42 and 2025 appear in many answers.",
    "A quick brown fox jumps over the lazy dog near the river bank.",
    "Do you know where the nearest train station is?",
    "Turn left at the bakery, then walk straight for five minutes.",
    "Lima, Oslo, Paris, Tokyo and Nairobi are cities of the world.",
    "Music, stories and jokes make a long journey feel short.",
)

# The Qwen2 / Qwen2.5 / Qwen3 pre-tokenizer split (the published tokenizer.json's regex).
QWEN_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
QWEN_BASE_VOCAB = 151_643  # byte-level BPE pieces before the first added token (<|endoftext|>)


def qwen_tokenizer(out: Path, added: Sequence[tuple[str, bool]], words_at: Mapping[str, int], config: Mapping[str, Any],
                   special_map: Mapping[str, Any]) -> dict[str, int]:
    """A Qwen-family tokenizer as the repos ship it: `vocab.json` + `merges.txt` (a
    byte-level BPE of QWEN_BASE_VOCAB pieces: the ones trained here on CORPUS, the rest
    word pieces no text here produces), `tokenizer.json`, `added_tokens.json` (`added`:
    (token, special) from id 151643 on), `tokenizer_config.json` (`config`, plus
    `added_tokens_decoder`) and `special_tokens_map.json`. `words_at` puts pieces at the
    ids the real vocabulary has them (Qwen3-Omni's talker finds turns by `user` = 872).
    Returns every added token's id."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    def shell(model: Any) -> Any:
        t = Tokenizer(model)
        t.normalizer = normalizers.NFC()
        t.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        t.decoder = decoders.ByteLevel()
        return t

    trained = shell(models.BPE())
    trained.train_from_iterator(list(CORPUS) * 8, trainers.BpeTrainer(vocab_size=1200, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                                     show_progress=False))
    state = json.loads(trained.to_str())["model"]
    merges: list[tuple[str, str]] = [(m.split(" ")[0], m.split(" ")[1]) if isinstance(m, str) else (m[0], m[1]) for m in state["merges"]]
    pieces = sorted(state["vocab"], key=state["vocab"].get)
    # the rest of the real vocabulary: word pieces (half of them starting a word) no
    # merge of this BPE produces, but a random model writes
    pieces += [f"\u0120w{i}" if i % 2 == 0 else f"w{i}" for i in range(QWEN_BASE_VOCAB - len(pieces))]
    for word, at in words_at.items():
        i = pieces.index(word)  # the corpus makes each one piece
        pieces[i], pieces[at] = pieces[at], pieces[i]
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = shell(models.BPE(vocab=vocab, merges=merges))
    for content, special in added:
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
    ids = {content: QWEN_BASE_VOCAB + i for i, (content, _) in enumerate(added)}
    assert all(tok.token_to_id(c) == i for c, i in ids.items())
    tok.save(str(out / "tokenizer.json"))
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (out / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    (out / "added_tokens.json").write_text(json.dumps(ids, indent=2, sort_keys=True) + "\n")
    decoder = {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": s}
               for (c, s), i in zip(added, ids.values(), strict=True)}
    (out / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder, **config}, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(dict(special_map), indent=2) + "\n")
    return ids


def save_sharded(model: torch.nn.Module, out: Path, shards: int, dtype: torch.dtype = torch.bfloat16,
                 shard_name: str = "model-{:05d}-of-{:05d}.safetensors") -> None:
    """The model's weights as the hub holds them: transformers' own checkpoint names
    (`save_pretrained`, which writes the hub's per-expert MoE layout), cast to `dtype`,
    split in key order over `shards` files of about equal size, with
    `model.safetensors.index.json`."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(dir=out) as tmp:
        model.to(dtype).save_pretrained(tmp, safe_serialization=True, max_shard_size="100GB")
        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                for k in st.keys():
                    tensors[k] = st.get_tensor(k)
    keys = list(tensors)  # transformers' order: a family's parts stay together
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    weight_map: dict[str, str] = {}
    # contiguous runs of about equal tensor counts (at these widths the embeddings
    # would leave shards empty if split by bytes)
    groups = [keys[len(keys) * i // shards : len(keys) * (i + 1) // shards] for i in range(shards)]
    for i, group in enumerate(groups):
        name = shard_name.format(i + 1, shards)
        save_file({k: tensors[k].contiguous() for k in group}, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in group})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_json(out: Path, name: str, body: Mapping[str, Any]) -> None:
    (out / name).write_text(json.dumps(body, indent=2) + "\n")


def sentencepiece_tokenizer(out: Path, vocab_size: int, trained_pieces: int = 600) -> Any:
    """Kyutai's text tokenizer layout (tokenizer_spm_32k_3.model): a SentencePiece
    unigram with `<unk>` 0, `<s>` 1, `</s>` 2, `<pad>` 3, byte fallback pieces from 4,
    then the pieces trained here on CORPUS, then word pieces up to `vocab_size`;
    converted to tokenizer.json as transformers' Moshi conversion does (`MoshiConverter`,
    `PreTrainedTokenizerFast` with only `<unk>` named). Returns the fast tokenizer."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import MoshiConverter

    with tempfile.TemporaryDirectory() as tmp:
        prefix = str(Path(tmp) / "spm")
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(list(CORPUS) * 20), model_prefix=prefix, model_type="unigram", vocab_size=trained_pieces,
            hard_vocab_limit=False, byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=3, character_coverage=1.0,
            minloglevel=2,
        )
        proto = pb.ModelProto()
        proto.ParseFromString(Path(prefix + ".model").read_bytes())
        # the rest of the real vocabulary's pieces: words (half of them starting one, with
        # "\u2581") that no text here encodes to, but a random model writes
        for i in range(vocab_size - len(proto.pieces)):
            piece = f"\u2581w{i}" if i % 2 == 0 else f"w{i}"
            proto.pieces.append(pb.ModelProto.SentencePiece(piece=piece, score=-1000.0 - i * 1e-3, type=pb.ModelProto.SentencePiece.NORMAL))
        path = Path(tmp) / "tokenizer_spm_32k_3.model"
        path.write_bytes(proto.SerializeToString())
        backend = MoshiConverter(str(path)).converted()
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", clean_up_tokenization_spaces=False,
                                   model_input_names=["input_ids", "attention_mask"])
    fast.save_pretrained(str(out))
    # the files as the conversion wrote them in transformers 4.45 (the hub's): the
    # converted pieces 0..3 are added tokens, and only <unk> is named
    added = {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
             for i, c in enumerate(("<unk>", "<s>", "</s>", "<pad>"))}
    write_json(out, "tokenizer_config.json", {"added_tokens_decoder": added, "clean_up_tokenization_spaces": False,
                                              "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 1000000000000000019884624838656,
                                              "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"})
    write_json(out, "special_tokens_map.json", {"unk_token": "<unk>"})
    return fast


def copy_files(src: Path, dst: Path, names: Sequence[str]) -> None:
    for n in names:
        shutil.copy(src / n, dst / n)
