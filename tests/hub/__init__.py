"""Model directories laid out as the public hub repos are, for the tests that serve them.

Each builder writes what the repo holds — its file list (sharded safetensors and their
index, the tokenizer files, the processor files, `spk_dict.pt`), its config.json keys and
dtypes, its token ids and speakers — at shrunken sizes with random weights, using
transformers' (and tokenizers' / sentencepiece's) own classes, and none of omni-rt's
tiny builders (`pipelines/tiny*.py`): a loader assumption cannot hide behind a builder
that shares it. What is known of each repo, and what is a guess, is said in its module:

* `qwen_omni`: Qwen/Qwen2.5-Omni-7B and -3B (`Qwen2_5OmniModel`, bfloat16 thinker and
  talker, float32-run token2wav, spk_dict.pt with (1, 192) / (1, 400, 80) tensors);
* `qwen3_omni`: Qwen/Qwen3-Omni-30B-A3B-Instruct (bfloat16 at the top level and in the
  thinker's config only, 15 shards, the speakers in the talker's config);
* `moshi`: kmhf/hf-moshiko (transformers' Moshi conversion: bfloat16, a 32,000-piece
  SentencePiece unigram text tokenizer with only `<unk>` declared special).

`build(name, root)` builds one (once per root).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def _builders() -> dict[str, Callable[[Path], None]]:
    from tests.hub import moshi, qwen3_omni, qwen_omni

    return {
        "Qwen2.5-Omni-7B": lambda d: qwen_omni.build(d, "7B"),
        "Qwen2.5-Omni-3B": lambda d: qwen_omni.build(d, "3B"),
        "Qwen3-Omni-30B-A3B-Instruct": qwen3_omni.build,
        "hf-moshiko": moshi.build,
    }


NAMES = ("Qwen2.5-Omni-7B", "Qwen2.5-Omni-3B", "Qwen3-Omni-30B-A3B-Instruct", "hf-moshiko")


def build(name: str, root: Path) -> Path:
    """The hub-shaped directory `name` under `root` (built once: a `.complete` marker)."""
    d = root / name
    if not (d / ".complete").is_file():
        d.mkdir(parents=True, exist_ok=True)
        _builders()[name](d)
        (d / ".complete").write_text("")
    return d
