"""The moshi pipeline's batched frame step on the tiny random Moshi + Mimi (transformers'
classes, loaded from the directory `omni-rt models build-tiny` writes)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from omni_rt.stage import StageError
from pipelines.moshi import MoshiProcessor, StepTimes
from pipelines.moshi.steps import DECODE_TOLERANCE, FRAME, MoshiSteps, SlotCache

SAMPLING = {"text_temperature": 0.7, "audio_temperature": 0.8, "text_top_k": 25, "audio_top_k": 250}


@pytest.fixture(scope="module")
def moshi_dir(models_dir: Path) -> str:
    return str(models_dir / "tiny-moshi")


def rows_of(n: int) -> dict[str, torch.Tensor]:
    return {k: torch.full((n,), v) for k, v in SAMPLING.items()}


@pytest.mark.integration
def test_streaming_encode_equals_transformers_streaming_mimi(moshi_dir: str) -> None:
    steps = MoshiSteps.load(moshi_dir).float()  # what the stage computes in on a CPU (the checkpoint: bfloat16)
    mimi = steps.moshi.audio_encoder
    torch.manual_seed(1)
    audio = torch.randn(2, 10 * FRAME) * 0.1
    with torch.inference_mode():
        ref = []
        for i in range(2):
            cache = past = None
            codes = []
            for f in range(10):
                out = mimi.encode(audio[i : i + 1, None, f * FRAME : (f + 1) * FRAME], padding_cache=cache, encoder_past_key_values=past,
                                  use_streaming=True, return_dict=True, num_quantizers=8)
                cache, past = out.padding_cache, out.encoder_past_key_values
                codes.append(out.audio_codes[0, :, 0])
            ref.append(torch.stack(codes))
        # both conversations in one batch; the second joins three frames later, in slot 3
        got: list[list[torch.Tensor]] = [[], []]
        steps._grow(4)
        for t in range(13):
            live = [i for i, start in enumerate((0, 3)) if start <= t < start + 10]
            rows = torch.tensor([(0, 3)[i] for i in live])
            fresh = torch.tensor([t == (0, 3)[i] for i in live])
            if bool(fresh.any()):
                steps._reset(rows[fresh], torch.zeros(int(fresh.sum()), dtype=torch.long))
            pcm = torch.stack([audio[i, (t - (0, 3)[i]) * FRAME : (t - (0, 3)[i] + 1) * FRAME] for i in live])
            codes = steps.encode(rows, pcm, fresh)
            for j, i in enumerate(live):
                got[i].append(codes[j])
    for i in range(2):
        assert torch.equal(torch.stack(got[i]), ref[i])


@pytest.mark.integration
def test_streaming_decode_matches_a_whole_decode_after_the_first_frame(moshi_dir: str) -> None:
    steps = MoshiSteps.load(moshi_dir).float()  # what the stage computes in on a CPU (the checkpoint: bfloat16)
    mimi = steps.moshi.audio_encoder
    torch.manual_seed(2)
    codes = torch.randint(0, 64, (1, 8, 20))
    rows = torch.tensor([0])
    with torch.inference_mode():
        whole = mimi.decode(codes).audio_values[0, 0]
        steps._reset(rows, torch.tensor([0]))
        streamed = torch.cat([steps.decode(rows, codes[:, :, f])[0] for f in range(20)])
    diff = (whole[: streamed.shape[0]] - streamed).abs()
    assert float(diff[FRAME:].max()) < DECODE_TOLERANCE
    assert float(whole.abs().max()) > 100 * DECODE_TOLERANCE  # the comparison is not of silence


@pytest.mark.integration
def test_batched_steps_equal_each_conversation_alone(moshi_dir: str) -> None:
    """Three conversations join and leave at different frames, in slots out of order;
    each one's text tokens and codes equal its run alone, its audio within 1e-5."""
    torch.manual_seed(3)
    frames = 14
    audio = torch.randn(3, frames * FRAME) * 0.1
    joins, slots = (0, 2, 5), (2, 0, 1)
    seeds = (11, 12, 13)

    def alone(i: int) -> list[dict[str, torch.Tensor]]:
        s = MoshiSteps.load(moshi_dir).float()  # what the stage computes in on a CPU (the checkpoint: bfloat16)
        out = []
        with torch.inference_mode():
            for f in range(frames):
                o = s.step(torch.tensor([0]), audio[i : i + 1, f * FRAME : (f + 1) * FRAME], torch.tensor([f == 0]), torch.tensor([seeds[i]]), **rows_of(1))
                out.append({k: v[0] for k, v in o.items()})
        return out

    ref = [alone(i) for i in range(3)]
    s = MoshiSteps.load(moshi_dir).float()  # what the stage computes in on a CPU (the checkpoint: bfloat16)
    got: list[list[dict[str, torch.Tensor]]] = [[], [], []]
    sizes = set()
    with torch.inference_mode():
        for t in range(joins[-1] + frames):
            live = [i for i in range(3) if joins[i] <= t < joins[i] + frames]
            sizes.add(len(live))
            o = s.step(
                torch.tensor([slots[i] for i in live]),
                torch.stack([audio[i, (t - joins[i]) * FRAME : (t - joins[i] + 1) * FRAME] for i in live]),
                torch.tensor([t == joins[i] for i in live]),
                torch.tensor([seeds[i] for i in live]),
                **rows_of(len(live)),
            )
            for j, i in enumerate(live):
                got[i].append({k: v[j] for k, v in o.items()})
    assert sizes == {1, 2, 3}
    for i in range(3):
        assert [int(x["text"]) for x in got[i]] == [int(x["text"]) for x in ref[i]]
        assert all(torch.equal(a["codes"], b["codes"]) and torch.equal(a["user_codes"], b["user_codes"]) for a, b in zip(got[i], ref[i], strict=True))
        assert max(float((a["pcm"] - b["pcm"]).abs().max()) for a, b in zip(got[i], ref[i], strict=True)) < 1e-5
        assert float(got[i][0]["pcm"].abs().max()) == 0.0  # the first frame: the model's voice starts one frame behind
        assert float(got[i][1]["pcm"].abs().max()) > 0.0
    # different seeds, different conversations: the rows are not copies of each other
    assert [int(x["text"]) for x in got[0]] != [int(x["text"]) for x in got[1]]


@pytest.mark.integration
def test_placing_the_model_moves_every_slots_state_with_it(moshi_dir: str) -> None:
    """The torch engine places the module with `.to(device)` then `.to(dtype)` (cuda,
    bfloat16 on a GPU): the slots' rings, Mimi's stream caches and the last codes go with
    it, so a step after placement runs (here: float64 on the CPU, then more slots)."""
    s = MoshiSteps.load(moshi_dir).to(torch.float64)
    assert s.dtype == torch.float64 and s.lm_cache.k[0].dtype == torch.float64 and s.enc_pad[0].dtype == torch.float64
    assert s.text_prev.dtype == torch.long and s.lm_cache.held.dtype == torch.long  # ids stay ids
    torch.manual_seed(5)
    pcm = torch.randn(3, FRAME) * 0.1
    with torch.inference_mode():
        for f in range(3):
            o = s.step(torch.tensor([0, 2, 1]), pcm, torch.tensor([f == 0] * 3), torch.tensor([1, 2, 3]), **rows_of(3))
    assert o["pcm"].shape == (3, FRAME) and bool(torch.isfinite(o["pcm"]).all()) and float(o["pcm"].abs().max()) > 0
    assert s.dec_cache.k[0].dtype == torch.float64 and s.slots == 3


def test_slot_cache_attends_to_each_rows_own_window() -> None:
    """Ring entries of one slot are what its row attends to: the last `window` positions
    of that slot, newest included, whatever the other slots hold."""
    torch.manual_seed(4)
    cache = SlotCache(layers=1, kv_heads=1, head_dim=4, window=5, step_tokens=1, dtype=torch.float32)
    cache.grow(2)
    keys: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for t in range(12):
        rows = torch.tensor([0, 1]) if t >= 4 else torch.tensor([0])
        pos, mask = cache.begin(rows, 1)
        k = torch.randn(len(rows), 1, 1, 4)
        ks, _ = cache.update(k, k, 0)
        for j, r in enumerate(rows.tolist()):
            keys[r].append(k[j, 0, 0])
            assert int(pos[j, 0]) == len(keys[r]) - 1
            visible = mask[j, 0, 0] == 0
            seen = ks[j, 0][visible]
            want = torch.stack(keys[r][-5:])
            assert seen.shape == want.shape
            # the same set of keys (ring order differs from time order)
            assert all(any(torch.equal(a, b) for b in seen) for a in want)


def test_step_times_predict_from_what_was_measured() -> None:
    t = StepTimes()
    assert t.predict(3) is None
    t.add(1, 0.02)
    assert math.isclose(t.predict(4) or 0, 0.08)  # one size measured: proportional
    t.add(2, 0.03)
    assert math.isclose(t.predict(4) or 0, 0.05)  # the line through both
    assert t.predict(2) == 0.03
    # a size whose steps vary is predicted by its spread, not only its average
    for x in (0.03, 0.05, 0.03, 0.05):
        t.add(2, x)
    assert (t.predict(2) or 0) > max(t.by_size[2], 0.04)
    # a size measured long ago gives way to the line through the sizes measured lately
    t = StepTimes(stale_s=30.0)
    t.seed(4, [0.05, 0.02, 0.021, 0.019, 0.02], now=0.0)  # one slow step among five
    assert math.isclose(t.predict(4, now=1.0) or 0, 0.02 + 3 * 0.001)
    t.seed(4, [0.053] * 5, now=0.0)  # start-up on a busy machine
    for now in range(60):
        t.add(3, 0.018, now=float(now))
    assert t.predict(4, now=10.0) == t.upper(4)  # fresh: as measured
    assert math.isclose(t.predict(4, now=59.0) or 0, 0.018 * 4 / 3)  # stale: from size 3, proportional


@pytest.mark.integration
def test_a_directory_of_another_architecture_is_refused(tmp_path: Path, moshi_dir: str) -> None:
    MoshiProcessor.check_model(moshi_dir)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(StageError, match="MoshiForConditionalGeneration"):
        MoshiProcessor.check_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MoshiForConditionalGeneration"], "audio_encoder_config": {"sampling_rate": 16000}}))
    with pytest.raises(StageError, match="24 kHz"):
        MoshiProcessor.check_model(str(tmp_path))


def test_the_text_stream_reads_as_kyutais_servers_render_it(tmp_path: Path) -> None:
    """The hub's tokenizer (kmhf/hf-moshiko: Kyutai's SentencePiece converted, only <unk>
    named special): Moshi writes padding (3) between words and an end of padding (0)
    before one; the stream renders the words with their spaces, as Kyutai's servers do
    (decoding one token at a time with the tokenizer dropped them: "hellothere…"), and
    never prints <s>, </s>, <pad> or <unk>."""
    from pipelines.moshi import TextStreams
    from tests.hub.files import sentencepiece_tokenizer

    tok = sentencepiece_tokenizer(tmp_path, 32000)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MoshiForConditionalGeneration"], "vocab_size": 32000}))
    text = TextStreams.load(str(tmp_path), pad_id=3, epad_id=0)
    words = tok.encode("hello there, how are you today?", add_special_tokens=False)
    frames = [32000, 3, 3, 0, *[t for w in words for t in (w, 3)], 1, 2, 3, 0, 3]
    piece = text.stream()
    assert "".join(piece(t) for t in frames) == "hello there, how are you today?"
    assert "".join(tok.decode([w]) for w in words) != "hello there, how are you today?"  # what the per-token decode gave
    # byte-fallback pieces (an emoji the vocabulary lacks) come out whole, once complete
    emoji = tok.encode(" 🙂", add_special_tokens=False)
    assert len(emoji) > 1 and "".join(piece(t) for t in emoji) == " 🙂"
    # byte pieces that never make a character (a model writes any token): the stream
    # goes on (tokenizers' stream decoder raised, and the conversation failed)
    bad = [4 + 0xF0, 4 + 0x9F, *words, 4 + 0xC3, 4 + 0xC3, *words]
    out = "".join(piece(t) for t in bad)
    assert out.endswith("how are you today?"), out
    fresh = text.stream()
    assert "".join(fresh(t) for t in words) == "hello there, how are you today?"


def test_sampling_filters_each_row_by_its_own_settings() -> None:
    """The rows' temperatures and top-k are applied together, each row by its own: greedy rows
    take the argmax, a top-k row draws only among its k best, a row without a filter may
    draw anything; each from its slot's generator (the same seed, the same draws)."""
    from pipelines.moshi.steps import MoshiSteps

    class Bare(MoshiSteps):
        def __init__(self) -> None:  # only the generators `_sample` reads
            torch.nn.Module.__init__(self)
            self.gens = [torch.Generator().manual_seed(i) for i in range(4)]

    logits = torch.randn(4, 50)
    rows = [3, 0, 2, 1]

    def draw(seed_offset: int = 0) -> list[torch.Tensor]:
        s = Bare()
        for i, g in enumerate(s.gens):
            g.manual_seed(i + seed_offset)
        return [s._sample(logits, rows, torch.tensor([0.0, 1.0, 1.0, 2.0]), torch.tensor([5, 3, 50, 0])) for _ in range(200)]

    a = torch.stack(draw())
    assert (a[:, 0] == logits[0].argmax()).all()  # greedy
    assert set(a[:, 1].tolist()) <= set(torch.topk(logits[1], 3).indices.tolist()) and len(set(a[:, 1].tolist())) > 1
    assert len(set(a[:, 2].tolist())) > 10 and len(set(a[:, 3].tolist())) > 10  # k = vocab and k = 0: no filter
    assert torch.equal(a, torch.stack(draw()))  # seeded
    assert not torch.equal(a, torch.stack(draw(seed_offset=7)))
