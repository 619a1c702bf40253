"""Tiny reference checkpoints (talker + SNAC code2wav) and the codec helpers."""

from __future__ import annotations

import hashlib
import json
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import torch

from pipelines.codec import (
    SAMPLES_PER_FRAME,
    CodecLayout,
    FrameAssembler,
    codes_to_frames,
    decode_window,
    frames_to_codes,
    load_snac,
    orpheus_prompt_ids,
    tokens_to_frames,
)
from pipelines.tiny import build_tiny


def _digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.mark.integration  # builds every tiny checkpoint twice
def test_build_is_deterministic_and_idempotent(tiny: dict[str, Path], tmp_path: Path) -> None:
    # every checkpoint, built a second time in a process whose memory the first build
    # left dirty: a weight a model class leaves as torch.empty would differ here
    again = build_tiny(tmp_path)
    assert set(again) == set(tiny)
    for key in tiny:
        first, second = _digest(tiny[key]), _digest(again[key])
        assert first == second, key
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "codec_layout.json"} <= set(_digest(tiny["talker"]))
    assert {"pytorch_model.bin", "config.json"} <= set(_digest(tiny["code2wav"]))
    # complete -> reused, not rebuilt
    mtime = (again["talker"] / "model.safetensors").stat().st_mtime_ns
    assert build_tiny(tmp_path) == again
    assert (again["talker"] / "model.safetensors").stat().st_mtime_ns == mtime
    # no temp dirs left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in again.values())


@pytest.mark.integration  # builds every tiny checkpoint
def test_every_weight_is_finite_and_drawn(tiny: dict[str, Path]) -> None:
    """No tensor of a tiny checkpoint is inf/NaN, and no weight matrix is one constant
    (a parameter its model class never initialised); the EMA sums of Mimi's codebooks
    start at zero by design."""
    from safetensors.torch import load_file

    constant_by_design = ("codebook.embed_sum",)
    for key, directory in tiny.items():
        for file in sorted(directory.rglob("*.safetensors")):
            for name, t in load_file(str(file)).items():
                if not t.is_floating_point():
                    continue
                where = f"{key}: {file.relative_to(directory)}:{name}"
                assert torch.isfinite(t).all(), where
                if t.ndim >= 2 and t.numel() > 16 and not name.endswith(constant_by_design):
                    assert float(t.float().std()) > 0, where


@pytest.mark.integration  # reads the tiny checkpoints it builds
def test_talker_tokenizer_and_layout(tiny: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny["talker"]), local_files_only=True)
    layout = CodecLayout.load(tiny["talker"])
    assert layout != CodecLayout()  # the tiny ids, not Orpheus defaults
    config = json.loads((tiny["talker"] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] >= layout.audio_token_end
    assert layout.audio_token_end - layout.audio_token_offset == 7 * layout.codebook_size
    snac_config = json.loads((tiny["code2wav"] / "config.json").read_text())
    assert snac_config["codebook_size"] == layout.codebook_size  # talker and decoder agree
    # every control id is a real special token of the tokenizer, below the audio range
    for name in ("start_of_human", "end_of_text", "end_of_human", "start_of_ai",
                 "start_of_speech", "end_of_speech"):
        tid = getattr(layout, name)
        assert tid < layout.audio_token_offset
        assert tok.convert_ids_to_tokens(tid).startswith("<|")
    text = "tara: Hello there, how are you?"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    prompt = orpheus_prompt_ids(tok, "Hello there", layout, voice="tara")
    assert prompt[0] == layout.start_of_human
    assert prompt[-4:] == [layout.end_of_text, layout.end_of_human, layout.start_of_ai, layout.start_of_speech]


def test_codec_layout_defaults_are_orpheus(tmp_path: Path) -> None:
    layout = CodecLayout.load(tmp_path)  # no codec_layout.json
    assert layout.audio_token_offset == 128266 and layout.codebook_size == 4096
    assert (layout.start_of_human, layout.end_of_text, layout.end_of_human) == (128259, 128009, 128260)
    assert (layout.start_of_ai, layout.start_of_speech, layout.end_of_speech) == (128261, 128257, 128258)
    custom = CodecLayout(audio_token_offset=10)
    custom.save(tmp_path)
    assert CodecLayout.load(tmp_path) == custom


@pytest.mark.integration  # reads the tiny checkpoints it builds
def test_snac_decode(tiny: dict[str, Path]) -> None:
    model = load_snac(tiny["code2wav"])
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    frames = np.random.default_rng(0).integers(0, model.codebook_size, size=(10, 7))
    audio = decode_window(model, frames)
    assert audio.shape == (1, 10 * SAMPLES_PER_FRAME) == (1, 20480)
    assert audio.dtype == np.float32
    assert np.isfinite(audio).all()
    assert 0.01 < float(np.sqrt(np.mean(audio**2))) < 0.5
    # deterministic (no noise blocks), batch == one by one
    np.testing.assert_array_equal(decode_window(model, frames), audio)
    batch = decode_window(model, np.stack([frames, frames[::-1]]))
    assert batch.shape == (2, 20480)
    np.testing.assert_allclose(batch[0], audio[0], atol=1e-5)


def test_frames_to_codes_follows_orpheus_layout() -> None:
    # frame f = (c0..c6) -> l0[f]=c0; l1[2f]=c1, l1[2f+1]=c4; l2[4f..4f+3]=c2,c3,c5,c6
    frames = np.array([[0, 1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15, 16]])
    l0, l1, l2 = frames_to_codes(frames)
    assert l0.dtype == l1.dtype == l2.dtype == torch.int64
    assert l0.tolist() == [[0, 10]]
    assert l1.tolist() == [[1, 4, 11, 14]]
    assert l2.tolist() == [[2, 3, 5, 6, 12, 13, 15, 16]]
    np.testing.assert_array_equal(codes_to_frames([l0, l1, l2])[0], frames)


def test_tokens_to_frames_and_assembler() -> None:
    layout = CodecLayout()  # Orpheus ids
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 4096, size=(5, 7))
    # Orpheus encoding: offset + slot * 4096 + code
    tokens = [layout.audio_token_offset + slot * 4096 + int(c) for row in codes for slot, c in enumerate(row)]
    stream = [layout.start_of_speech] + tokens[:10] + [layout.end_of_text] + tokens[10:] + [layout.end_of_speech]
    frames, leftover = tokens_to_frames(stream, layout)
    np.testing.assert_array_equal(frames, codes)
    assert leftover == 0
    frames, leftover = tokens_to_frames(stream[:-4], layout)  # drop eos + 3 codes
    np.testing.assert_array_equal(frames, codes[:4])
    assert leftover == 4
    # a token in the "wrong" slot still maps to a valid code
    frames, _ = tokens_to_frames([layout.audio_token_offset + 3 * 4096 + 7] * 7, layout)
    assert frames.tolist() == [[7] * 7]

    whole = FrameAssembler(layout).push(stream)
    asm = FrameAssembler(layout)
    parts = []
    cuts = [0, 1, 4, 11, 12, 13, 20, 27, len(stream)]
    for a, b in pairwise(cuts):
        parts.append(asm.push(stream[a:b]))
        assert parts[-1].shape[1:] == (7,)
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    np.testing.assert_array_equal(whole, codes)
    assert asm.pending == 0 and asm.frames_emitted == 5
    asm.push(tokens[:3])
    assert asm.pending == 3


def test_load_snac_real_layout_with_noise(tmp_path: Path) -> None:
    """A release-style checkpoint (noise=True, old weight_g/weight_v keys) loads and,
    by default, decodes deterministically."""
    from snac import SNAC

    config = {"sampling_rate": 24000, "encoder_dim": 8, "encoder_rates": [2, 4, 8, 8], "decoder_dim": 64,
              "decoder_rates": [8, 8, 4, 2], "attn_window_size": None, "codebook_size": 4096,
              "codebook_dim": 8, "vq_strides": [4, 2, 1], "noise": True, "depthwise": True}
    torch.manual_seed(0)
    state = SNAC(**config).state_dict()
    old_style = {
        k.replace("parametrizations.weight.original0", "weight_g").replace("parametrizations.weight.original1", "weight_v"): v
        for k, v in state.items()
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    torch.save(old_style, tmp_path / "pytorch_model.bin")
    frames = np.random.default_rng(0).integers(0, 4096, size=(4, 7))
    model = load_snac(tmp_path)
    np.testing.assert_array_equal(decode_window(model, frames), decode_window(model, frames))
    noisy = load_snac(tmp_path, deterministic=False)
    assert not np.array_equal(decode_window(noisy, frames), decode_window(noisy, frames))
    with pytest.raises(FileNotFoundError):
        load_snac(tmp_path / "missing")


@pytest.mark.integration  # reads the tiny checkpoints it builds
def test_thinker_segment_encoder_equals_whole_prompt_encoding(tiny: dict[str, Path]) -> None:
    """Prompt pieces between added tokens are encoded once and remembered; the ids are
    always those of encoding the whole rendered prompt."""
    import random

    from transformers import AutoTokenizer

    from pipelines.tokenizing import SegmentEncoder

    tok = AutoTokenizer.from_pretrained(str(tiny["thinker"]))
    fast = tok.backend_tokenizer
    enc = SegmentEncoder.for_tokenizer(fast)
    assert enc is not None
    rng = random.Random(3)
    alphabet = "ab cdé✓\n\t  .,!?<|>imstartendaudio漢字😀"
    history: list[dict[str, str]] = []
    for _turn in range(60):
        content = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        if rng.random() < 0.3:
            content += "<|audio|>" + content
        history.append({"role": rng.choice(["system", "user", "assistant"]), "content": content})
        text = tok.apply_chat_template(history[-8:], add_generation_prompt=True, tokenize=False)
        assert enc.encode(text) == list(fast.encode(text, add_special_tokens=False).ids), text
    assert 0 < len(enc.pieces) <= SegmentEncoder.MAX_PIECES

    # bounded in pieces and in characters: least recently used pieces go first
    small = SegmentEncoder.for_tokenizer(fast)
    assert small is not None
    small.MAX_PIECES = 2
    for word in ("one", "two", "three"):
        small.encode(f"<|im_start|>{word}<|im_end|>")
    assert list(small.pieces) == ["two", "three"]
    small.MAX_PIECES, small.MAX_CHARS = 100, 10
    small.encode("<|im_start|>four<|im_end|><|im_start|>seven<|im_end|>")
    assert list(small.pieces) == ["four", "seven"] and small.chars == 9
    small.encode("<|im_start|>" + "x" * (SegmentEncoder.MAX_PIECE_CHARS + 1))  # too long to keep
    assert list(small.pieces) == ["four", "seven"]


def _sentencepiece_like():
    """A Llama-2-style tokenizer (Prepend "▁" normalizer) with chat control tokens
    matched on raw text and one added token matched on normalized text."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    corpus = ["Hello world, be brief. rest of the text system user assistant " * 3] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    tok.add_tokens([AddedToken("<|audio|>", normalized=True, special=False)])
    tok.add_special_tokens([AddedToken("<|im_start|>", normalized=False, special=True), AddedToken("<|im_end|>", normalized=False, special=True)])
    return tok


def test_segment_encoder_leaves_normalized_added_tokens_to_the_tokenizer() -> None:
    import random

    from pipelines.tokenizing import SegmentEncoder

    tok = _sentencepiece_like()
    enc = SegmentEncoder.for_tokenizer(tok)
    assert enc is not None and "<|audio|>" not in enc.added and "<|im_start|>" in enc.added
    rng = random.Random(0)
    parts = ["a", "b", " ", "\n", "<|audio|>", "é", "<|im_end|>", "<|im_start|>", "Hello", "rest"]
    for _ in range(300):
        text = "".join(rng.choice(parts) for _ in range(30))
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False).ids, text


def test_rust_tokenizer_drops_the_truncation_a_tokenizer_json_carries() -> None:
    from transformers import PreTrainedTokenizerFast

    from pipelines.tokenizing import SegmentEncoder, rust_tokenizer

    wrapper = PreTrainedTokenizerFast(tokenizer_object=_sentencepiece_like())
    wrapper.backend_tokenizer.enable_truncation(8)  # as a tokenizer.json saved with truncation loads
    text = "<|im_start|>user Hello world, be brief. rest of the text<|im_end|>"
    fast = rust_tokenizer(wrapper)
    assert wrapper.backend_tokenizer.truncation is not None  # a copy: the wrapper's own is left as it was
    assert len(wrapper.backend_tokenizer.encode(text, add_special_tokens=False).ids) == 8
    want = wrapper(text, add_special_tokens=False)["input_ids"]  # the wrapper's call does not truncate
    assert len(want) > 8 and fast.encode(text, add_special_tokens=False).ids == want
    enc = SegmentEncoder.for_tokenizer(fast)
    assert enc is not None and enc.encode(text) == want


def test_segment_encoder_is_not_used_where_added_tokens_strip_whitespace() -> None:
    from pipelines.tokenizing import SegmentEncoder

    class Added:
        def __init__(self, content: str, lstrip: bool) -> None:
            self.content, self.lstrip, self.rstrip, self.single_word, self.normalized = content, lstrip, False, False, False

    class Fake:
        def get_added_tokens_decoder(self) -> dict[int, Added]:
            return {5: Added("<s>", True)}

    assert SegmentEncoder.for_tokenizer(Fake()) is None


@pytest.mark.integration  # builds every tiny checkpoint
def test_the_text_a_thinker_samples_leaves_out_special_and_added_tokens_wherever_they_are(tiny: dict[str, Path]) -> None:
    """Qwen's and Llama 3's control tokens follow the text; SentencePiece vocabularies
    (Mistral, Gemma, Llama 2, Moshi's) start with <unk>, <s>, </s>: "every id below the
    smallest special one" left those models nothing to sample."""
    from transformers import AutoTokenizer

    from pipelines.voice import text_ranges

    qwen = AutoTokenizer.from_pretrained(str(tiny["omni"]))
    first = min(qwen.all_special_ids)
    assert text_ranges(qwen) == [[0, first]]
    spm = AutoTokenizer.from_pretrained(str(tiny["moshi"]))
    assert spm.convert_ids_to_tokens([0, 1, 2, 3]) == ["<unk>", "<s>", "</s>", "<pad>"]
    assert text_ranges(spm) == [[4, len(spm)]]
