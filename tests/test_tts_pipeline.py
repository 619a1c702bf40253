"""The tts pipeline in-process: stream equals batch, fused equals split, chunking.

The talker runs on the fake AR engine (seeded, same contract as vLLM's) so these tests
need no vLLM; code2wav is the real tiny SNAC decoder on the real torch engine.
"""

from __future__ import annotations

import numpy as np
import pytest

import pipelines
from omni_rt.payloads import Fence, Payload, PayloadKind
from omni_rt.runtime import Runtime
from omni_rt.specs import ChunkingSpec, DeployOverlay, apply_overlay, parse_overlay
from pipelines.tts import SAMPLES_PER_FRAME, StreamingDecoder, split_text

# Float tolerance of chunked vs one-shot decoding: the same convolution over a
# different window length may use a different summation order in oneDNN (observed
# differences are ~3e-7; with too little context they reach 1e-4 and more).
ATOL = 1e-5


def _fake_talker(profile):
    stages = [
        s.model_copy(update={"engine": "fake", "engine_args": {"vocab_size": 10}}) if s.engine == "vllm" else s
        for s in profile.stages
    ]
    return profile.model_copy(update={"stages": stages})


async def synth(models_dir, overlay: dict, text: str, seed: int = 7) -> tuple[np.ndarray, list[int]]:
    spec = pipelines.load_builtin("tts")
    ov = parse_overlay(overlay, "test overlay")
    profile = _fake_talker(apply_overlay(spec, ov))
    from pipelines.tiny import build_tiny

    tiny = build_tiny(models_dir)
    rt = Runtime({"tts": profile}, ov.connectors, lambda m, key: str(tiny[m.split(":", 1)[1]]) if m.startswith("tiny:") else m)
    await rt.start()
    try:
        fence = Fence("s")
        stream = rt.orchestrator.submit("tts", fence=fence, params={"voice": "tara", "seed": seed})
        stream.send_input(Payload(PayloadKind.TEXT, fence, text=text))
        stream.end_input()
        chunks = [p.arrays["pcm"].copy() async for _, p, _ in stream.payloads()]
        await stream.close()
        assert stream.done.status == "completed"
        assert stream.done.usage["output_tokens"] > 0
        return np.concatenate(chunks), [len(c) for c in chunks]
    finally:
        await rt.stop()


TEXT = "Hello there, this is a streaming test."


def edge(mode: str, **chunking) -> dict:
    e: dict = {"mode": mode}
    if chunking:
        e["chunking"] = chunking
    return {"pipelines": {"tts": {"profile": "split", "edges": {"talker->code2wav": e}}}}


async def test_stream_equals_batch_default_chunking(models_dir):
    batch, batch_chunks = await synth(models_dir, edge("batch"), TEXT)
    stream, stream_chunks = await synth(models_dir, edge("chunk"), TEXT)
    assert len(batch_chunks) == 1 and len(stream_chunks) > 3
    # first chunk is first_chunk_frames long, later ones chunk_frames (last: the rest)
    c = pipelines.load_builtin("tts").profiles["split"].edges[0].chunking
    assert stream_chunks[0] == c.first_chunk_frames * SAMPLES_PER_FRAME
    assert all(n == c.chunk_frames * SAMPLES_PER_FRAME for n in stream_chunks[1:-1])
    assert stream.shape == batch.shape
    assert len(batch) % SAMPLES_PER_FRAME == 0 and len(batch) > 0
    np.testing.assert_allclose(stream, batch, atol=ATOL, rtol=0)
    assert np.abs(batch).max() > 1e-3  # real signal, not silence


@pytest.mark.parametrize(
    "chunking",
    [
        {"first_chunk_frames": 1, "chunk_frames": 3, "left_context_frames": 3, "lookahead_frames": 3},
        {"first_chunk_frames": 5, "chunk_frames": 1, "left_context_frames": 4, "lookahead_frames": 4},
    ],
)
async def test_stream_equals_batch_other_chunkings(models_dir, chunking):
    batch, _ = await synth(models_dir, edge("batch"), TEXT)
    stream, chunks = await synth(models_dir, edge("chunk", **chunking), TEXT)
    assert chunks[0] == chunking["first_chunk_frames"] * SAMPLES_PER_FRAME
    np.testing.assert_allclose(stream, batch, atol=ATOL, rtol=0)


async def test_without_context_chunk_boundaries_differ(models_dir):
    """The context frames are what makes streaming exact: without them it is not."""
    batch, _ = await synth(models_dir, edge("batch"), TEXT)
    stream, _ = await synth(models_dir, edge("chunk", left_context_frames=0, lookahead_frames=0), TEXT)
    assert np.abs(stream - batch).max() > 1e-3
    stream, _ = await synth(models_dir, edge("chunk", left_context_frames=2, lookahead_frames=2), TEXT)
    assert np.abs(stream - batch).max() > ATOL


async def test_fused_equals_split(models_dir):
    split, _ = await synth(models_dir, edge("chunk"), TEXT)
    fused, chunks = await synth(models_dir, {"pipelines": {"tts": {"profile": "fused"}}}, TEXT)
    assert len(chunks) > 3
    np.testing.assert_allclose(fused, split, atol=ATOL, rtol=0)


async def test_shm_edge_equals_inproc(models_dir):
    inproc, _ = await synth(models_dir, edge("chunk"), TEXT)
    over = edge("chunk")
    over["pipelines"]["tts"]["edges"]["talker->code2wav"]["connector"] = "shm"
    shm, _ = await synth(models_dir, over, TEXT)
    np.testing.assert_array_equal(shm, inproc)


async def test_duration_follows_text_length(models_dir):
    short, _ = await synth(models_dir, edge("chunk"), "Hi.")
    long, _ = await synth(models_dir, edge("chunk"), TEXT * 3)
    assert len(long) > 3 * len(short)


async def test_streaming_decoder_finish_without_chunks():
    calls = []

    async def decode(frames, priority):
        calls.append(len(frames))
        return np.zeros(len(frames) * SAMPLES_PER_FRAME, np.float32)

    dec = StreamingDecoder(decode, ChunkingSpec(first_chunk_frames=4, chunk_frames=4, left_context_frames=1, lookahead_frames=1))
    assert await dec.push(np.zeros((3, 7), np.int32)) == []
    out = await dec.finish()
    assert [len(a) for a in out] == [3 * SAMPLES_PER_FRAME] and calls == [3]
    assert await dec.finish() == []


def test_split_text_keeps_every_word():
    text = ("This is sentence number one. " * 40).strip()
    segs = split_text(text, 100)
    assert all(len(s) <= 100 for s in segs)
    assert " ".join(segs).split() == text.split()
    long_word = "x" * 250
    assert "".join(split_text(long_word, 100)) == long_word
    assert split_text("   ", 10) == []


def test_default_overlay_is_split_chunk():
    p = apply_overlay(pipelines.load_builtin("tts"), DeployOverlay())
    assert [s.name for s in p.stages] == ["talker", "code2wav"]
    assert p.edges[0].mode == "chunk"
