"""The omni3 profile's talker and code2wav against transformers' own Qwen3-Omni.

The stages run in-process on the real torch engine (`Runtime`), entered with what the
thinker would send them (its prompt's ids and audio, then its reply's token ids), and
are compared with `Qwen3OmniMoeForConditionalGeneration.generate(..., return_audio=True)`
on the same tiny checkpoint, as transformers ships it:

* the talker's frames (all codebooks: the talker's first, the code predictor's others)
  equal the reference's (greedy), with the user's audio, an image, and text only, for an answer that
  ends at the thinker's end token and for one cut at its budget;
* code2wav decoding every frame in one window equals the reference's waveform;
* code2wav streamed (chunk by chunk as the talker makes frames) equals the same chunks
  decoded from all the frames at once, its first audio comes after three frames (a
  chunk of two and one to complete its last samples), and it matches the one-window
  decode within the bound below.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pipelines
from omni_rt.payloads import TALKER_PROMPT, Fence, Payload, PayloadKind
from omni_rt.runtime import Runtime
from omni_rt.specs import ProfileSpec, parse_overlay
from omni_rt.specs import apply_overlay as apply
from testkit.harness import speech_pcm16

pytestmark = [pytest.mark.integration]

SEED = 3
PROMPT = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
AUDIO_PART = "<|audio_start|><|audio_pad|><|audio_end|>"
IMAGE_PART = "<|vision_start|><|image_pad|><|vision_end|>"
TEXT = "Hello there, how are you today?"
THINKER_TOKENS = 10
TALKER_TOKENS = 40  # the reference's budget: it completes all but the last frame it starts
# streamed (2 frames, then 12, each window with 25 before it and 1 after) against one
# window over the whole answer: relative L2 difference of the waveforms. Measured 8e-4 on
# the tiny checkpoint: the causal decoder's windows differ only where their 25 frames of
# context (the reference's own chunked_decode) fall short of what it attends to (a
# sliding window of 72 frames) and its convolutions' receptive field
CHUNKED_REL_L2 = 5e-3


def _speech() -> np.ndarray:
    pcm = np.frombuffer(speech_pcm16("Tell me something nice.", rate=16000), "<i2")
    return pcm.astype(np.float32) / 32768.0


@pytest.fixture(scope="module", params=["tiny", "Qwen3-Omni-30B-A3B-Instruct"])
def omni3_dir(request, models_dir, tmp_path_factory):
    """The tiny checkpoint, and one laid out as the hub's Qwen3-Omni (tests.hub)."""
    from pipelines.tiny import build_tiny
    from tests import hub

    if request.param == "tiny":
        return build_tiny(models_dir)["omni3"]
    return hub.build(request.param, tmp_path_factory.mktemp("hub"))


@pytest.fixture(scope="module")
def reference(omni3_dir):
    from transformers import AutoProcessor, Qwen3OmniMoeForConditionalGeneration

    from omni_rt.vllm_plugin import register

    register()
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(omni3_dir)).float().eval()  # float32, as the stages on a CPU
    return model, AutoProcessor.from_pretrained(str(omni3_dir))


def _image():
    """A small picture (the talker reads the thinker's states at its rows)."""
    from PIL import Image

    rng = np.random.default_rng(5)
    return Image.fromarray((rng.random((96, 128, 3)) * 255).astype(np.uint8))


def _generate(reference, audio: np.ndarray | None, end_at: int | None, image=None) -> dict:
    """The reference's thinker tokens, talker frames and waveform (greedy); `end_at`: the
    thinker's end token forced at that step (None: the answer runs to its budget)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    model, processor = reference
    eos = model.config.im_end_token_id
    user = AUDIO_PART if audio is not None else IMAGE_PART + TEXT if image is not None else TEXT
    if audio is not None:
        pad = -(-(len(audio) + 400) // 160) * 160
        inputs = processor(text=PROMPT.format(user), audio=[audio], return_tensors="pt", audio_kwargs={"max_length": pad})
    elif image is not None:
        inputs = processor(text=PROMPT.format(user), images=[image], return_tensors="pt")
    else:
        inputs = processor(text=PROMPT.format(user), return_tensors="pt")
    n_prompt = inputs["input_ids"].shape[1]

    class EndAt(LogitsProcessor):
        def __call__(self, ids, scores):
            if end_at is not None and ids.shape[1] - n_prompt == end_at:
                forced = torch.full_like(scores, float("-inf"))
                forced[:, eos] = 0
                return forced
            return scores

    got: dict = {}
    decode = model.code2wav.chunked_decode

    def capture(codes, **kw):
        got["frames"] = codes[0].T.tolist()
        return decode(codes, **kw)

    model.code2wav.chunked_decode = capture
    try:
        seq, wav = model.generate(**inputs, speaker="Ethan", thinker_max_new_tokens=THINKER_TOKENS, thinker_eos_token_id=eos,
                                  thinker_do_sample=False, thinker_logits_processor=LogitsProcessorList([EndAt()]),
                                  talker_do_sample=False, talker_max_new_tokens=TALKER_TOKENS)
    finally:
        model.code2wav.chunked_decode = decode
    out = [int(t) for t in seq[0, n_prompt:]]
    if end_at is not None:
        assert out[end_at] == eos and len(out) == end_at + 1
        reply = out[:end_at]
    else:
        assert eos not in out
        reply = out[:-1]  # ended at the budget: the reference never feeds its last token back
    plain = processor.tokenizer(PROMPT.format(user))["input_ids"]
    res = {"prompt_ids": plain, "reply": reply, "frames": got["frames"], "wav": wav[0, 0].numpy()}
    if image is not None:  # what the thinker stage sends: its processor's pixels and grid
        res.update(pixel_values=inputs["pixel_values"].numpy(), image_grid_thw=inputs["image_grid_thw"].numpy())
    return res


def _stages(mode: str) -> ProfileSpec:
    """The omni3 profile's talker and code2wav on their own, entered at the talker."""
    spec = pipelines.load_builtin("voice")
    prof = apply(spec, parse_overlay({"pipelines": {"voice": {
        "profile": "omni3",
        "stages": {"omni_talker": {"processor_args": {"greedy": True, "max_codes": TALKER_TOKENS - 1, "base_codes": TALKER_TOKENS}}},
        "edges": {"omni_talker->omni_code2wav": {"mode": mode}},
    }}}, "test"))
    keep = {"omni_talker", "omni_code2wav"}
    stages = [s.model_copy(update={"input": "text"}) if s.name == "omni_talker" else s for s in prof.stages if s.name in keep]
    edges = [e for e in prof.edges if e.src in keep and e.dst in keep]
    return ProfileSpec(entry="omni_talker", stages=stages, edges=edges, final_outputs=sorted(keep))


def _thinker_payloads(ref: dict, audio: np.ndarray | None) -> list[Payload]:
    fence = Fence("s")
    arrays = {"prompt_ids": np.asarray(ref["prompt_ids"], np.int64)}
    if audio is not None:
        arrays["audio"] = audio
    if "pixel_values" in ref:
        arrays.update(pixel_values=ref["pixel_values"], image_grid_thw=ref["image_grid_thw"])
    out = [Payload(PayloadKind.TEXT, fence, arrays=arrays, meta={TALKER_PROMPT: True})]
    for i in range(0, len(ref["reply"]), 3):  # the reply in pieces, as the thinker streams it
        out.append(Payload(PayloadKind.TEXT, fence, text="x", arrays={"token_ids": np.asarray(ref["reply"][i : i + 3], np.int64)}))
    return out


async def _run(omni3_dir, profile: ProfileSpec, inputs: list[Payload]) -> tuple[list[list[int]], np.ndarray, list[int]]:
    rt = Runtime({"voice": profile}, {}, lambda m, key: str(omni3_dir))
    await rt.start()
    try:
        stream = rt.orchestrator.submit("voice", fence=inputs[0].fence, params={"voice": "ethan", "seed": SEED})
        for p in inputs:
            stream.send_input(p)
        stream.end_input()
        frames: list[list[int]] = []
        pcm: list[np.ndarray] = []
        async for stage, p, _ in stream.payloads():
            if stage == "omni_talker":
                frames.extend(p.arrays["frames"].tolist())
            else:
                pcm.append(p.arrays["pcm"].copy())
        await stream.close()
        assert stream.done.status == "completed", stream.done
        return frames, np.concatenate(pcm), [len(c) for c in pcm]
    finally:
        await rt.stop()


@pytest.mark.parametrize(("given", "end_at"), [("speech", 6), ("text", 6), ("speech", None), ("image", 6)],
                         ids=["speech-ended", "text-ended", "speech-cut", "image-ended"])
async def test_frames_and_waveform_equal_the_reference(omni3_dir, reference, given, end_at):
    audio = _speech() if given == "speech" else None
    ref = _generate(reference, audio, end_at, _image() if given == "image" else None)
    assert len(ref["frames"]) == TALKER_TOKENS - 1
    frames, pcm, _ = await _run(omni3_dir, _stages("batch"), _thinker_payloads(ref, audio))
    assert frames == ref["frames"]
    assert pcm.shape == ref["wav"].shape
    np.testing.assert_allclose(pcm, ref["wav"], atol=1e-5)


async def test_streamed_code2wav_equals_its_chunks_decoded_at_once(omni3_dir, reference):
    from omni_rt.engines.torch_engine import TorchEngine
    from pipelines.omni3 import Omni3Code2WavProcessor
    from pipelines.streaming import StreamingDecoder

    ref = _generate(reference, None, 6)
    profile = _stages("chunk")
    frames, streamed, sizes = await _run(omni3_dir, profile, _thinker_payloads(ref, None))
    assert frames == ref["frames"]
    chunking = profile.edges[0].chunking
    assert chunking is not None
    spf = 1920  # 24 kHz / 12.5 Hz
    assert sizes[0] == chunking.first_chunk_frames * spf  # first audio after three frames, not the whole answer
    assert len(sizes) > 2
    spec = profile.stage("omni_code2wav").model_copy(update={"model": str(omni3_dir)})
    engine = TorchEngine(Omni3Code2WavProcessor.torch_module(str(omni3_dir), "main"), name="omni_code2wav")
    await engine.start()
    try:
        proc = Omni3Code2WavProcessor(spec, engine, {})
        await proc.start()
        dec = StreamingDecoder(proc.decode, chunking, samples_per_frame=proc.samples_per_frame, width=proc.groups)
        at_once = [*(await dec.push(np.asarray(frames, np.int32))), *(await dec.finish())]
    finally:
        await engine.stop()
    assert [len(a) for a in at_once] == sizes
    np.testing.assert_allclose(streamed, np.concatenate(at_once), atol=1e-6)
    assert streamed.shape == ref["wav"].shape
    rel = float(np.linalg.norm(streamed - ref["wav"]) / np.linalg.norm(ref["wav"]))
    print(f"streamed vs one window: relative L2 {rel:.2e}")
    assert rel < CHUNKED_REL_L2, rel


@pytest.mark.parametrize("layout", ["tiny", "hub", "mixed"])
async def test_the_stages_run_in_the_checkpoints_own_dtypes(models_dir, layout, tmp_path, monkeypatch):
    """Off the CPU's real-time cast (as on a GPU), the talker and code2wav run in the
    dtypes the checkpoint's config gives each sub-model: the tiny one's and the
    hub-shaped one's (bfloat16 at the top level and in the thinker's config, none in
    the talker's: transformers builds the talker in bfloat16 too; built from its own
    sub-config alone it was float32 and the talker's first matmul with the thinker's
    bfloat16 rows failed), and a config whose thinker alone is bfloat16 (float32 at
    the top: the rows crossing from the thinker are cast to the talker's dtype)."""
    import json
    import shutil

    from pipelines.omni3 import Omni3Code2WavProcessor, Omni3TalkerProcessor
    from tests import hub

    monkeypatch.setattr(Omni3TalkerProcessor, "REALTIME", False)
    monkeypatch.setattr(Omni3Code2WavProcessor, "REALTIME", False)
    tiny = models_dir / "tiny-qwen3-omni"
    d = tiny
    if layout != "tiny":
        d = hub.build("Qwen3-Omni-30B-A3B-Instruct", tmp_path / "hub")
    if layout == "mixed":
        mixed = tmp_path / "mixed"
        shutil.copytree(tiny, mixed)
        cfg = json.loads((mixed / "config.json").read_text())
        cfg["dtype"] = "float32"
        (mixed / "config.json").write_text(json.dumps(cfg))
        d = mixed
    from pipelines.omni3.models import Omni3TalkerModule

    module = Omni3TalkerModule(str(d))
    thinker, talker = next(module.thinker.parameters()).dtype, next(module.talker.parameters()).dtype
    assert (thinker, talker) == ((torch.bfloat16, torch.float32) if layout == "mixed" else (torch.bfloat16, torch.bfloat16))
    del module
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(d))
    prompt = tok(PROMPT.format(AUDIO_PART))["input_ids"]
    reply = tok("It is sunny today", add_special_tokens=False)["input_ids"]
    payloads = _thinker_payloads({"prompt_ids": prompt, "reply": reply}, _speech())
    frames, pcm, _ = await _run(d, _stages("chunk"), payloads)
    assert frames and np.isfinite(pcm).all() and pcm.dtype == np.float32 and len(pcm) > 0
