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
from pipelines.codec import SAMPLES_PER_FRAME
from pipelines.streaming import DecodeTimes, StreamingDecoder
from pipelines.tts import split_text

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


@pytest.mark.integration
async def test_stream_equals_batch_default_chunking(models_dir):
    batch, batch_chunks = await synth(models_dir, edge("batch"), TEXT)
    stream, stream_chunks = await synth(models_dir, edge("chunk"), TEXT)
    assert len(batch_chunks) == 1 and len(stream_chunks) > 3
    # first chunk is first_chunk_frames long, later ones at most chunk_frames (shorter
    # while the emitted audio would run out: refill_ms; last: the rest)
    c = pipelines.load_builtin("tts").profiles["split"].edges[0].chunking
    assert stream_chunks[0] == c.first_chunk_frames * SAMPLES_PER_FRAME
    assert all(0 < n <= c.chunk_frames * SAMPLES_PER_FRAME and n % SAMPLES_PER_FRAME == 0 for n in stream_chunks[1:-1])
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
@pytest.mark.integration
async def test_stream_equals_batch_other_chunkings(models_dir, chunking):
    batch, _ = await synth(models_dir, edge("batch"), TEXT)
    stream, chunks = await synth(models_dir, edge("chunk", **chunking), TEXT)
    assert chunks[0] == chunking["first_chunk_frames"] * SAMPLES_PER_FRAME
    np.testing.assert_allclose(stream, batch, atol=ATOL, rtol=0)


@pytest.mark.integration
async def test_without_context_chunk_boundaries_differ(models_dir):
    """The context frames are what makes streaming exact: without them it is not."""
    batch, _ = await synth(models_dir, edge("batch"), TEXT)
    stream, _ = await synth(models_dir, edge("chunk", left_context_frames=0, lookahead_frames=0), TEXT)
    assert np.abs(stream - batch).max() > 1e-3
    stream, _ = await synth(models_dir, edge("chunk", left_context_frames=2, lookahead_frames=2), TEXT)
    assert np.abs(stream - batch).max() > ATOL


@pytest.mark.integration
async def test_fused_equals_split(models_dir):
    split, _ = await synth(models_dir, edge("chunk"), TEXT)
    fused, chunks = await synth(models_dir, {"pipelines": {"tts": {"profile": "fused"}}}, TEXT)
    assert len(chunks) > 3
    np.testing.assert_allclose(fused, split, atol=ATOL, rtol=0)


@pytest.mark.integration
async def test_duration_follows_text_length(models_dir):
    short, _ = await synth(models_dir, edge("chunk"), "Hi.")
    long, _ = await synth(models_dir, edge("chunk"), TEXT * 3)
    assert len(long) > 3 * len(short)


async def test_streaming_decoder_finish_without_chunks():
    calls = []

    async def decode(frames, deadline):
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


async def _zeros(frames, deadline):
    return np.zeros(len(frames) * SAMPLES_PER_FRAME, np.float32)


async def _play_without_running_dry(dec: StreamingDecoder, now: list[float], frames: int, speed: float) -> list[int]:
    """A talker making a frame every frame period / `speed` on the virtual clock `now`
    (a decode that moves the clock delays the next frame): audio played in real time
    from the first chunk must never wait for the next one. The chunks' sizes."""
    frame_s = SAMPLES_PER_FRAME / 24000
    played_to: float | None = None
    sizes: list[int] = []
    for k in range(frames):
        now[0] = max(now[0], (k + 1) * frame_s / speed)  # frame k is out of the talker
        for audio in await dec.push(np.zeros((1, 7), np.int32)):
            if played_to is None:
                played_to = now[0]
            assert now[0] <= played_to + 1e-9, f"playback ran dry for {(now[0] - played_to) * 1000:.0f} ms before chunk {len(sizes)}"
            played_to += len(audio) / 24000
            sizes.append(len(audio) // SAMPLES_PER_FRAME)
    return sizes


@pytest.mark.parametrize("speed", [1.1, 1.25, 1.5, 2.3, 8.0])
async def test_streaming_decoder_never_lets_real_time_playback_run_dry(speed):
    """A talker faster than real time by `speed`, on a virtual clock: audio played in
    real time from the first chunk never waits for the next one, and chunks grow back
    to chunk_frames once there is room (few decodes in the steady state)."""
    frame_s = SAMPLES_PER_FRAME / 24000
    now = [0.0]
    c = ChunkingSpec()  # the pipelines' chunking: 1, then 16, 3 + 3 context frames
    dec = StreamingDecoder(_zeros, c, clock=lambda: now[0])
    sizes = await _play_without_running_dry(dec, now, 200, speed)
    assert sizes[0] == _first_chunk(frame_s / speed, 0.0, c) and max(sizes) <= c.chunk_frames
    if speed >= 1.5:
        assert sizes[-1] == c.chunk_frames


@pytest.mark.parametrize("speed", [0.5, 0.9])
async def test_a_talker_slower_than_real_time_gets_short_chunks_only_before_a_hole(speed):
    """Playback cannot keep up: a short chunk goes out only while some audio is still
    left to play (it shortens the hole); once playback is dry the decoder waits for a
    full chunk, so an overloaded stage does not also decode frame by frame."""
    frame_s = SAMPLES_PER_FRAME / 24000
    now = [0.0]
    dec = StreamingDecoder(_zeros, ChunkingSpec(), clock=lambda: now[0])
    played_to = 0.0
    sizes: list[int] = []
    for k in range(120):
        now[0] = (k + 1) * frame_s / speed
        for a in await dec.push(np.zeros((1, 7), np.int32)):
            n = len(a) // SAMPLES_PER_FRAME
            if sizes and n < 16:
                assert now[0] < played_to, f"a short chunk ({n}) after the audio ran out"
            played_to = max(played_to, now[0]) + n * frame_s
            sizes.append(n)
    assert sizes[0] == _first_chunk(frame_s / speed, 0.0, ChunkingSpec()) and 16 in sizes
    assert len(sizes) <= 120 // 4  # at least 4 frames per decode on average


def _first_chunk(period_s: float, decode_s: float, c: ChunkingSpec) -> int:
    """The fewest frames (at least first_chunk_frames) whose audio outlasts the next
    frame's making and decoding plus the jitter margin."""
    frame_s = SAMPLES_PER_FRAME / 24000
    n = c.first_chunk_frames
    while n * frame_s < period_s + decode_s + c.jitter_ms / 1000 - 1e-9 and n < c.chunk_frames:
        n += 1
    return n


@pytest.mark.parametrize(("speed", "decode_ms", "first"), [(8.0, 5, 1), (1.3, 40, 2), (1.1, 120, 3)])
async def test_a_first_chunk_outlasts_the_making_and_decoding_of_the_next_frame(speed, decode_ms, first):
    """Decoding takes time too (on a virtual clock each decode advances it): with a
    talker barely faster than real time and slow decodes, as on a busy stage, a
    one-frame first chunk (85 ms) runs out before the second is decoded. The first
    chunk grows to what the stream's frame period and the stage's recent decode time
    need, and playback never runs dry; an idle stage keeps its one-frame first chunk."""
    frame_s = SAMPLES_PER_FRAME / 24000
    now = [0.0]

    async def slow(frames, deadline):
        now[0] += decode_ms / 1000
        return np.zeros(len(frames) * SAMPLES_PER_FRAME, np.float32)

    c = ChunkingSpec()
    times = DecodeTimes()
    times.add(decode_ms / 1000)  # the stage decoded before: the new stream knows its pace
    dec = StreamingDecoder(slow, c, clock=lambda: now[0], decode_times=times)
    sizes = await _play_without_running_dry(dec, now, 60, speed)
    assert sizes[0] == first == _first_chunk(frame_s / speed, decode_ms / 1000, c)


async def test_refill_off_keeps_fixed_chunks():
    now = [0.0]
    dec = StreamingDecoder(_zeros, ChunkingSpec(refill_ms=0), clock=lambda: now[0])
    sizes = []
    for k in range(40):
        now[0] = k * 0.01  # far ahead of real time: refill would apply, but it is off
        sizes += [len(a) // SAMPLES_PER_FRAME for a in await dec.push(np.zeros((1, 7), np.int32))]
    assert sizes == [1, 16, 16]
