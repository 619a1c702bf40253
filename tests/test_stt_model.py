"""The stt stage's model, Kyutai STT in transformers' format (the tiny random one, built
as kyutai/stt-1b-en_fr-trfs is laid out): the streamed transcript is the one
transformers' own `generate` writes for the same audio; the stage streams it as deltas."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipelines.stt import FRAME, SttProcessor, SttSteps

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from pipelines.tiny.kyutai_stt import fill

    out = tmp_path_factory.mktemp("tiny-kyutai-stt")
    fill(out)
    SttProcessor.check_model(str(out))
    return out


def test_frame_by_frame_steps_write_what_generate_writes(model_dir):
    steps = SttSteps.load(str(model_dir))
    audio = (0.1 * np.random.default_rng(0).standard_normal(FRAME * 24)).astype(np.float32)
    with torch.inference_mode():
        whole = steps.model.generate(input_values=torch.from_numpy(audio)[None, None], max_new_tokens=24, do_sample=False)[0].tolist()
    # two requests interleaved frame by frame in one step (slots 0 and 5): each is its own stream
    other = (0.1 * np.random.default_rng(1).standard_normal(FRAME * 24)).astype(np.float32)
    mine: list[int] = []
    for i in range(24):
        pcm = torch.from_numpy(np.stack([audio[i * FRAME : (i + 1) * FRAME], other[i * FRAME : (i + 1) * FRAME]]))
        out = steps.step(torch.tensor([0, 5]), pcm, torch.tensor([i == 0, i == 0]))["tokens"]
        mine += [t for t in out[0].tolist() if t >= 0]
    assert whole[0] == steps.bos and mine[: len(whole) - 1] == whole[1:]
    steps.release(torch.tensor([0, 5]))
    assert steps.slots == {}


def test_a_model_directory_of_another_architecture_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["WhisperForConditionalGeneration"]}')
    with pytest.raises(Exception, match="KyutaiSpeechToTextForConditionalGeneration"):
        SttProcessor.check_model(str(tmp_path))
