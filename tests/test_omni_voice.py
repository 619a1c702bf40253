"""The omni profile's talker and token2wav against transformers' own Qwen2.5-Omni.

The stages run in-process on the real torch engine (`Runtime`), entered with what the
thinker would send them (its prompt's ids and audio, then its reply's token ids), and
are compared with `Qwen2_5OmniForConditionalGeneration.generate(..., return_audio=True)`
on the same checkpoint (the tiny one, and one laid out as the hub's 7B: `tests.hub`):

* the talker's codes equal the reference's (greedy), with the user's audio, an image, and text only;
* token2wav decoding all codes at once equals the reference's waveform for the same seed;
* token2wav streamed (chunk by chunk as the talker produces codes) equals the same chunks
  decoded from all the codes at once; against the one-window decode it differs by the
  DiT's chunking only, within the bound stated below.

About the reference: transformers 5.19's `generate` drops the attention mask it builds
for the talker before the talker's `forward` sees it, and that forward then skips what
it does with a mask: the thinker prompt's M-RoPE positions and the codec start / pad
rows it adds to the prompt's last two positions. The checkpoints were trained with both
(Qwen's own inference code, and this forward given its mask). The reference here is
therefore `generate` with the mask restored by a forward pre-hook; everything else is
transformers' code as it ships.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pipelines
from omni_rt.payloads import TALKER_PROMPT, Fence, Payload, PayloadKind
from omni_rt.runtime import Runtime
from omni_rt.specs import ChunkingSpec, ProfileSpec, parse_overlay
from omni_rt.specs import apply_overlay as apply
from testkit.harness import speech_pcm16

pytestmark = [pytest.mark.integration]

SEED = 3
PROMPT = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
AUDIO_PART = "<|audio_bos|><|AUDIO|><|audio_eos|>"
IMAGE_PART = "<|vision_bos|><|IMAGE|><|vision_eos|>"
MAX_CODES = 80
# streamed (chunks of 12, then 50 codes, with 24 codes before and 12 after each) against
# the whole answer in one DiT window: relative L2 difference of the waveforms. Measured
# 3e-7 on the tiny checkpoint, whose random DiT carries little across its 24-frame
# blocks; a trained one's look-back / look-ahead layers make chunk edges audible only
# where the context falls short (the profile's 0.5 s / 0.24 s cover both).
CHUNKED_REL_L2 = 1e-4


def _speech() -> np.ndarray:
    pcm = np.frombuffer(speech_pcm16("Tell me something nice.", rate=16000), "<i2")
    return pcm.astype(np.float32) / 32768.0


@pytest.fixture(scope="module", params=["tiny", "Qwen2.5-Omni-7B"])
def omni_dir(request, models_dir, tmp_path_factory):
    """The tiny checkpoint, and one laid out as the hub's Qwen2.5-Omni-7B (tests.hub)."""
    from pipelines.tiny import build_tiny
    from tests import hub

    if request.param == "tiny":
        return build_tiny(models_dir)["omni"]
    return hub.build(request.param, tmp_path_factory.mktemp("hub"))


@pytest.fixture(scope="module")
def reference(omni_dir):
    """transformers' model and processor on the checkpoint, with the talker's mask restored."""
    from transformers import AutoProcessor, Qwen2_5OmniForConditionalGeneration

    from omni_rt.vllm_plugin import register

    register()
    # float32 throughout (what the stages compute in on a CPU): from_pretrained(dtype=float32) leaves
    # a sub-model whose own config names bfloat16 (the hub's talker) in bfloat16
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(str(omni_dir)).float().eval()

    def with_mask(_module, args, kwargs):
        if kwargs.get("attention_mask") is None:
            past = kwargs.get("past_key_values")
            x = kwargs["inputs_embeds"] if kwargs.get("inputs_embeds") is not None else kwargs["input_ids"]
            kwargs["attention_mask"] = torch.ones(x.shape[0], (past.get_seq_length() if past is not None else 0) + x.shape[1], dtype=torch.long)
        return args, kwargs

    model.talker.register_forward_pre_hook(with_mask, with_kwargs=True, prepend=True)
    return model, AutoProcessor.from_pretrained(str(omni_dir))


def _image():
    """A small picture (the talker recomputes the thinker's states over its rows too)."""
    from PIL import Image

    rng = np.random.default_rng(5)
    return Image.fromarray((rng.random((84, 112, 3)) * 255).astype(np.uint8))


def _generate(reference, audio: np.ndarray | None, image=None) -> dict:
    """The reference's thinker tokens, talker codes and waveform (greedy, seeded)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    model, processor = reference
    tc = model.config.talker_config
    n_codes = model.config.token2wav_config.dit_config.num_embeds
    text = PROMPT.format("Hello there, how are you today?")
    if audio is not None:
        pad = -(-(len(audio) + 400) // 160) * 160
        text = PROMPT.format(AUDIO_PART)
        inputs = processor(text=text, audio=[audio], return_tensors="pt", audio_kwargs={"max_length": pad})
    elif image is not None:
        text = PROMPT.format(IMAGE_PART + "What is this?")
        inputs = processor(text=text, images=[image], return_tensors="pt")
    else:
        inputs = processor(text=text, return_tensors="pt")

    class CodesOnly(LogitsProcessor):  # what the stage samples from: codes the vocoder embeds, and the stops
        def __call__(self, ids, scores):
            keep = torch.full_like(scores, float("-inf"))
            keep[:, : n_codes + 1] = 0
            keep[:, [tc.tts_codec_pad_token_id, tc.tts_codec_end_token_id]] = 0
            return scores + keep

    got: dict = {}
    decode = model.token2wav.forward

    def capture(code, conditioning, reference_mel, **kw):
        got["codes"] = code[0].tolist()
        torch.manual_seed(SEED)  # the DiT's initial noise
        return decode(code, conditioning, reference_mel, **kw)

    model.token2wav.forward = capture
    if image is not None:
        # the pixels to the thinker alone (as a shared kwarg transformers' generate also
        # hands them to the talker, whose generate refuses them); the grid to both
        inputs = {**inputs, "thinker_pixel_values": inputs["pixel_values"]}
        del inputs["pixel_values"]
    try:
        seq, wav = model.generate(**inputs, speaker="Ethan", thinker_max_new_tokens=10, thinker_do_sample=False, talker_do_sample=False,
                                  talker_max_new_tokens=MAX_CODES, talker_logits_processor=LogitsProcessorList([CodesOnly()]))
    finally:
        model.token2wav.forward = decode
    stops = {model.config.thinker_config.text_config.eos_token_id}
    reply = [int(t) for t in seq[0, inputs["input_ids"].shape[1] :] if int(t) not in stops]
    if len(reply) == 10:  # ended at the budget: the reference never feeds its last token back
        reply = reply[:-1]
    out = {"prompt_ids": processor.tokenizer(text)["input_ids"], "reply": reply, "codes": got["codes"], "wav": wav.numpy()}
    if image is not None:  # what the thinker stage sends: its processor's pixels and grid
        out["pixel_values"] = inputs["thinker_pixel_values"].numpy()
        out["image_grid_thw"] = inputs["image_grid_thw"].numpy()
    return out


def _stages(mode: str, entry: str) -> ProfileSpec:
    """The omni profile's talker and token2wav on their own, entered at `entry`."""
    spec = pipelines.load_builtin("voice")
    prof = apply(spec, parse_overlay({"pipelines": {"voice": {
        "profile": "omni",
        "stages": {"omni_talker": {"processor_args": {"greedy": True, "max_codes": MAX_CODES}}},
        "edges": {"omni_talker->token2wav": {"mode": mode}},
    }}}, "test"))
    keep = {"omni_talker", "token2wav"} if entry == "omni_talker" else {"token2wav"}
    stages = [s.model_copy(update={"input": "text"}) if s.name == entry else s for s in prof.stages if s.name in keep]
    edges = [e for e in prof.edges if e.src in keep and e.dst in keep]
    return ProfileSpec(entry=entry, stages=stages, edges=edges, final_outputs=sorted(keep))


async def _run(omni_dir, profile: ProfileSpec, inputs: list[Payload]) -> tuple[list[int], np.ndarray, list[int]]:
    rt = Runtime({"voice": profile}, {}, lambda m, key: str(omni_dir))
    await rt.start()
    try:
        fence = inputs[0].fence
        stream = rt.orchestrator.submit("voice", fence=fence, params={"voice": "Ethan", "seed": SEED})
        for p in inputs:
            stream.send_input(p)
        stream.end_input()
        codes: list[int] = []
        pcm: list[np.ndarray] = []
        async for stage, p, _ in stream.payloads():
            if stage == "omni_talker":
                codes.extend(int(c) for c in p.arrays["frames"].reshape(-1))
            else:
                pcm.append(p.arrays["pcm"].copy())
        await stream.close()
        assert stream.done.status == "completed", stream.done
        return codes, np.concatenate(pcm), [len(c) for c in pcm]
    finally:
        await rt.stop()


async def _decode_at_once(omni_dir, codes: list[int], chunking: ChunkingSpec) -> list[np.ndarray]:
    from omni_rt.engines.torch_engine import TorchEngine
    from pipelines.omni import Token2WavProcessor
    from pipelines.streaming import StreamingDecoder

    spec = _stages("chunk", "token2wav").stage("token2wav").model_copy(update={"model": str(omni_dir)})
    engine = TorchEngine(Token2WavProcessor.torch_module(str(omni_dir), "main"), name="token2wav")
    await engine.start()
    try:
        proc = Token2WavProcessor(spec, engine, {})
        await proc.start()
        dec = StreamingDecoder(proc.decoder({"voice": "Ethan", "seed": SEED}), chunking, samples_per_frame=proc.samples_per_code, width=2)
        frames = np.stack([np.asarray(codes, np.int32), np.arange(len(codes), dtype=np.int32)], 1)
        return [*(await dec.push(frames)), *(await dec.finish())]
    finally:
        await engine.stop()


def _thinker_payloads(ref: dict, audio: np.ndarray | None) -> list[Payload]:
    fence = Fence("s")
    arrays = {"prompt_ids": np.asarray(ref["prompt_ids"], np.int64)}
    if audio is not None:
        arrays["audio"] = audio
    if "pixel_values" in ref:
        arrays.update(pixel_values=ref["pixel_values"], image_grid_thw=ref["image_grid_thw"])
    out = [Payload(PayloadKind.TEXT, fence, arrays=arrays, meta={TALKER_PROMPT: True})]
    # the reply in pieces, as the thinker streams it
    for i in range(0, len(ref["reply"]), 3):
        out.append(Payload(PayloadKind.TEXT, fence, text="x", arrays={"token_ids": np.asarray(ref["reply"][i : i + 3], np.int64)}))
    return out


@pytest.mark.parametrize("given", ["speech", "text", "image"])
async def test_codes_and_waveform_equal_the_reference(omni_dir, reference, given):
    audio = _speech() if given == "speech" else None
    ref = _generate(reference, audio, _image() if given == "image" else None)
    assert len(ref["codes"]) > 20
    codes, pcm, _ = await _run(omni_dir, _stages("batch", "omni_talker"), _thinker_payloads(ref, audio))
    assert codes == ref["codes"]
    # one window over every code (batch edge), the same noise: the reference's waveform
    assert pcm.shape == ref["wav"].shape
    np.testing.assert_allclose(pcm, ref["wav"], atol=1e-4)


async def test_streamed_token2wav_equals_its_chunks_decoded_at_once(omni_dir, reference):
    ref = _generate(reference, None)
    payloads = _thinker_payloads(ref, None)
    codes, streamed, sizes = await _run(omni_dir, _stages("chunk", "omni_talker"), payloads)
    assert codes == ref["codes"]
    c = ChunkingSpec(first_chunk_frames=12, chunk_frames=50)
    spc = 480  # samples a code: 2 mel frames x 240
    assert sizes[0] == c.first_chunk_frames * spc  # first audio after 12 codes, not the whole answer
    assert len(sizes) > 1
    # the same codes given to token2wav's decoder at once: the same chunks, the same samples
    at_once = await _decode_at_once(omni_dir, codes, _stages("chunk", "omni_talker").edges[0].chunking)
    assert [len(a) for a in at_once] == sizes
    np.testing.assert_allclose(streamed, np.concatenate(at_once), atol=1e-5)
    # against the one-window decode only the DiT's chunking differs
    rel = float(np.linalg.norm(streamed - ref["wav"]) / np.linalg.norm(ref["wav"]))
    print(f"chunked vs one window: relative L2 {rel:.2e}")
    assert rel < CHUNKED_REL_L2, rel


@pytest.mark.parametrize("layout", ["tiny", "Qwen2.5-Omni-7B", "Qwen2.5-Omni-3B"])
async def test_the_stages_run_in_the_checkpoints_own_dtypes(models_dir, layout, tmp_path, monkeypatch):
    """Off the CPU's real-time cast (as on a GPU), the talker runs in the checkpoint's
    bfloat16 (its thinker's and talker's configs say so) and token2wav in float32 as
    the reference runs it: the talker's results leave the engine as float32 arrays
    (numpy has no bfloat16: the engine died at start-up on `.numpy()`), and the
    speakers of the hub's spk_dict.pt ((1, 192) / (1, 400, 80)) condition the DiT."""
    from pipelines.omni import OmniTalkerProcessor, Token2WavProcessor
    from pipelines.omni.models import OmniTalkerModule, load_speakers
    from tests import hub

    monkeypatch.setattr(OmniTalkerProcessor, "REALTIME", False)
    monkeypatch.setattr(Token2WavProcessor, "REALTIME", False)
    d = models_dir / "tiny-qwen2.5-omni" if layout == "tiny" else hub.build(layout, tmp_path / "hub")
    assert {sp["cond"].shape[-1] for sp in torch.load(str(d / "spk_dict.pt")).values()} == {192}
    assert all(sp["cond"].shape == (192,) and sp["ref_mel"].shape == (400, 80) for sp in load_speakers(str(d)).values())
    module = OmniTalkerModule(str(d))
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    del module
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(d))
    ref = {"prompt_ids": tok(PROMPT.format(AUDIO_PART))["input_ids"], "reply": tok("It is sunny today", add_special_tokens=False)["input_ids"]}
    codes, pcm, _ = await _run(d, _stages("chunk", "omni_talker"), _thinker_payloads(ref, _speech()))
    assert codes and np.isfinite(pcm).all() and pcm.dtype == np.float32 and len(pcm) == 480 * len(codes)


def test_the_talker_loads_a_thinker_whose_head_is_tied(tmp_path):
    """The talker reads the thinker's states, never its logits: a checkpoint whose thinker
    ties its head to the embeddings (no `thinker.lm_head.weight` stored) loads as one
    that stores it (Qwen2.5-Omni-3B and -7B store theirs; a tied fine-tune need not)."""
    import json

    from safetensors.torch import load_file, save_file

    from pipelines.omni.models import OmniTalkerModule
    from tests import hub

    d = hub.build("Qwen2.5-Omni-3B", tmp_path / "hub")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = index["weight_map"].pop("thinker.lm_head.weight")
    tensors = load_file(str(d / shard))
    del tensors["thinker.lm_head.weight"]
    save_file(tensors, str(d / shard), metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((d / "config.json").read_text())
    cfg["thinker_config"]["text_config"]["tie_word_embeddings"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    module = OmniTalkerModule(str(d))
    assert hasattr(module.thinker, "visual")  # kept: images in the prompt are states the talker reads too
    ids = torch.tensor([[151644, 872, 198, 9707, 151645]])
    out = module.think_prompt(torch.tensor([0]), ids)
    assert out["hidden"].shape == (1, 5, 128) and bool(torch.isfinite(out["hidden"].float()).all())


@pytest.mark.parametrize("greedy", [True, False])
def test_the_talkers_sampler_keeps_its_history_incrementally_and_samples_as_the_whole_history_would(greedy: bool) -> None:
    """The repetition penalty over the prompt's codes and every code so far: the sampler
    grows its set of distinct codes as the answer goes instead of rebuilding the whole
    history each step, and picks what transformers' processors over the whole history pick."""
    from types import SimpleNamespace

    import torch
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from pipelines.omni import OmniTalkerArgs, TalkerBase

    vocab = 64
    args = OmniTalkerArgs(greedy=greedy, repetition_penalty=1.5, temperature=0.9, top_k=20, top_p=0.8)
    fake = SimpleNamespace(args=args, allowed=torch.zeros(vocab))
    ctx = SimpleNamespace(params={"seed": 7})
    prompt = [5, 5, 9, 11]
    sample = TalkerBase._sampler(fake, ctx, prompt)  # type: ignore[arg-type]
    procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5)])
    if not greedy:
        procs += [TemperatureLogitsWarper(0.9), TopKLogitsWarper(20), TopPLogitsWarper(0.8)]
    gen = torch.Generator()
    gen.manual_seed(7)
    rng = np.random.default_rng(0)
    out: list[int] = []
    for _ in range(40):
        logits = rng.normal(size=vocab).astype(np.float32) * 3
        scores = procs(torch.tensor([prompt + out]), torch.from_numpy(logits).view(1, -1))
        want = int(scores.argmax(-1)) if greedy else int(torch.multinomial(torch.softmax(scores, -1), 1, generator=gen))
        got = sample(logits, out)
        assert got == want
        out.append(got)
    assert len(set(out)) > 5
