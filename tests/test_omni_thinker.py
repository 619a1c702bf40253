"""The voice thinkers are real Qwen2.5-Omni and Qwen3-Omni: each tiny checkpoint loads
unchanged in transformers (`Qwen2_5OmniForConditionalGeneration` /
`Qwen3OmniMoeForConditionalGeneration.from_pretrained`) and in vLLM through the stage's
own code (a `VllmEngine` given only a directory, the engine args of its profile,
`ThinkerProcessor` rendering the prompt with the checkpoint's processor and chat
template), and both compute the same next-token distribution for the same speech: the
audio goes through the model's own feature extractor and audio tower in vLLM exactly as
in transformers (and Qwen3-Omni's MoE layers through vLLM's CPU experts).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import pytest_asyncio

from omni_rt.engines.vllm import VllmEngine
from omni_rt.specs import load_pipeline
from pipelines import PIPELINE_DIR
from pipelines.chat_templates import OMNI3_SPANS, OMNI25_SPANS
from pipelines.voice import NATIVE_RATE, ThinkerProcessor
from testkit.harness import speech_pcm16

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Listen: <|audio|>"}]


def _speech() -> np.ndarray:
    pcm = np.frombuffer(speech_pcm16("The quick brown fox jumps over the lazy dog.", rate=NATIVE_RATE), "<i2")
    return pcm.astype(np.float32) / 32768.0


# per family: the tiny checkpoint, the profile serving it, transformers' class, the audio span
FAMILIES = {
    "qwen2.5-omni": ("tiny-qwen2.5-omni", "default", "Qwen2_5OmniForConditionalGeneration", OMNI25_SPANS["audio"]),
    "qwen3-omni": ("tiny-qwen3-omni", "omni3", "Qwen3OmniMoeForConditionalGeneration", OMNI3_SPANS["audio"]),
}


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=list(FAMILIES))
async def engine_and_thinker(request, models_dir, tmp_path_factory):
    tiny, profile, _, _ = FAMILIES[request.param]
    # a copy under a name of its own: the loader is given a directory and nothing else
    ckpt = tmp_path_factory.mktemp("ckpt") / f"some-{request.param}"
    shutil.copytree(models_dir / tiny, ckpt)
    spec = load_pipeline(PIPELINE_DIR / "voice.yaml").profiles[profile].stage("thinker")
    # float32 on both sides: the comparison is of the computation, not of bf16 rounding
    spec = spec.model_copy(update={"model": str(ckpt), "engine_args": {**spec.engine_args, "dtype": "float32"}})
    engine = VllmEngine(str(ckpt), spec.engine_args, name="thinker")
    await engine.start()
    thinker = ThinkerProcessor(spec, engine, {})
    await thinker.start()
    yield engine, thinker, (ckpt, request.param)
    await engine.stop()


IMAGE_MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is in <|image|> this picture?"}]


def _image_url(h: int = 300, w: int = 400) -> str:
    import base64
    import io

    from PIL import Image

    img = Image.fromarray((np.random.default_rng(1).random((h, w, 3)) * 255).astype(np.uint8))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _reference(ckpt, thinker: ThinkerProcessor, audio: np.ndarray | None, image_url: str | None = None) -> np.ndarray:
    """transformers' own thinker on the processor's own inputs: next-token log-probs."""
    import torch
    import transformers

    from media.images import open_data_url

    path, family = ckpt
    model = getattr(transformers, FAMILIES[family][2]).from_pretrained(str(path), dtype=torch.float32).eval()
    if image_url is not None:
        text = thinker.render(IMAGE_MESSAGES)
        inputs = thinker.processor(text=text, images=[open_data_url(image_url)], return_tensors="pt",
                                   images_kwargs=dict(thinker.mm_kwargs))
        with torch.no_grad():
            logits = model.thinker(**inputs).logits[0, -1]
        return logits.log_softmax(-1).numpy()
    text = thinker.render(MESSAGES, with_audio=audio is not None)
    inputs = thinker.processor(text=text, audio=[audio] if audio is not None else None, return_tensors="pt")
    with torch.no_grad():
        logits = model.thinker(**inputs).logits[0, -1]
    return logits.log_softmax(-1).numpy()


async def _vllm_logprobs(engine: VllmEngine, thinker: ThinkerProcessor, audio: np.ndarray | None, rid: str) -> dict[int, float]:
    from vllm import SamplingParams

    ids = thinker.prompt_ids(MESSAGES, with_audio=audio is not None)
    if audio is not None:
        mm = thinker.audio_prompt(audio)
        prompt = await engine._mm_prompt(ids, mm["multi_modal_data"], mm["mm_processor_kwargs"])
        # vLLM's processor expanded the one placeholder to as many audio tokens as the
        # stage counts for usage
        assert len(prompt["prompt_token_ids"]) == len(ids) - 1 + thinker.audio_tokens(len(audio))
    else:
        prompt = engine._prompt(ids, None)
    outs = [o async for o in engine.llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=20), rid)]
    out = outs[-1]
    return {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}


@pytest.mark.parametrize("with_audio", [True, False])
async def test_vllm_path_computes_what_transformers_computes(engine_and_thinker, with_audio):
    engine, thinker, ckpt = engine_and_thinker
    audio = _speech() if with_audio else None
    ref = _reference(ckpt, thinker, audio)
    got = await _vllm_logprobs(engine, thinker, audio, f"cmp-{with_audio}")
    top = sorted(got, key=lambda t: -got[t])
    assert top[0] == int(ref.argmax())
    for t, lp in got.items():
        assert abs(lp - float(ref[t])) < 2e-3, (t, lp, float(ref[t]))


async def test_an_image_reaches_vllm_as_transformers_sees_it(engine_and_thinker):
    """An image in the conversation: the stage's prompt (the template's vision span, the
    image beside the ids), sized by the profile's mm_processor_kwargs on both sides,
    gives vLLM's next-token distribution transformers' own; the stage counts the
    image's tokens as vLLM's processor expands them."""
    from vllm import SamplingParams

    engine, thinker, ckpt = engine_and_thinker
    url = _image_url(900, 1200)  # past the profile's longest edge: resized to it
    pil, n, arrays = thinker.images([url], True)
    assert 0 < n <= 512 and arrays["image_grid_thw"].shape == (1, 3)
    ids = thinker.prompt_ids(IMAGE_MESSAGES)
    prompt = await engine._mm_prompt(ids, {"image": pil}, None)
    assert len(prompt["prompt_token_ids"]) == len(ids) - 1 + n
    outs = [o async for o in engine.llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=20), "img")]
    got = {t: lp.logprob for t, lp in outs[-1].outputs[0].logprobs[0].items()}
    ref = _reference(ckpt, thinker, None, url)
    assert max(got, key=lambda t: got[t]) == int(ref.argmax())
    for t, lp in got.items():
        assert abs(lp - float(ref[t])) < 2e-3, (t, lp, float(ref[t]))


async def test_the_audio_changes_the_answer(engine_and_thinker):
    """The speech reaches the model: another utterance, another distribution."""
    engine, thinker, _ = engine_and_thinker
    a = await _vllm_logprobs(engine, thinker, _speech(), "a")
    silence = np.zeros(NATIVE_RATE, np.float32)
    b = await _vllm_logprobs(engine, thinker, silence, "b")
    shared = set(a) & set(b)
    assert set(a) != set(b) or any(abs(a[t] - b[t]) > 1e-3 for t in shared)


async def test_the_processor_renders_the_prompt(engine_and_thinker):
    """The prompt is the chat template's, with the family's audio span where the
    utterance is (no hand-built strings)."""
    _, thinker, (_, family) = engine_and_thinker
    text = thinker.render(MESSAGES, with_audio=True)
    assert text == thinker.processor.apply_chat_template(
        [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "Listen:"}, {"type": "audio"}]}],
        add_generation_prompt=True, tokenize=False)
    assert FAMILIES[family][3] in text and text.endswith("<|im_start|>assistant\n")


def test_the_omni_profile_speaks_with_qwens_system_prompt(models_dir):
    """Qwen2.5-Omni's model card: speech output needs its own system prompt. A
    conversation without a system turn gets it (the template's default, "You are a
    helpful assistant.", no more); one with its own instructions keeps them."""
    from omni_rt.engines.fake import FakeArEngine
    from omni_rt.specs import StageSpec

    voice = load_pipeline(PIPELINE_DIR / "voice.yaml")
    thinker = next(s for s in voice.profiles["omni"].stages if s.name == "thinker")
    card = "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving auditory and visual inputs, as well as generating text and speech."
    assert thinker.processor_args["system_prompt"] == card
    spec = StageSpec.model_validate({**thinker.model_dump(), "engine": "fake", "engine_args": {}, "model": str(models_dir / "tiny-qwen2.5-omni")})
    proc = ThinkerProcessor(spec, FakeArEngine(), {})
    proc._load()
    prompt = proc.render(proc.conversation({"messages": [{"role": "user", "content": "Hi"}]}))
    assert prompt.startswith(f"<|im_start|>system\n{card}<|im_end|>") and "helpful assistant" not in prompt
    assert card in proc.render(proc.conversation({}))  # an empty conversation (a greeting)
    own = proc.render(proc.conversation({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}))
    assert "Be brief." in own and card not in own
