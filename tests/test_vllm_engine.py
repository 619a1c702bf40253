"""VllmEngine on the tiny talker: streaming deltas, constraints, seeds, cancel, embeds.

One engine for the whole module (start costs ~20-40 s and ~2 GB on a CPU box).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import torch

from omni_rt.engines.base import EngineError
from omni_rt.engines.vllm import VllmEngine
from pipelines.codec import CodecLayout
from pipelines.tiny import build_tiny

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]


@pytest.fixture(scope="module")
def talker_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny(tmp_path_factory.mktemp("tiny"))["talker"])


@pytest.fixture(scope="module")
def layout(talker_dir: str) -> CodecLayout:
    return CodecLayout.load(talker_dir)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(talker_dir: str) -> AsyncIterator[VllmEngine]:
    eng = VllmEngine(talker_dir, {"enable_prompt_embeds": True}, name="talker")
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


def _prompt(layout: CodecLayout) -> list[int]:
    # [SOH] BOS some text [EOT EOH SOA SOS], ids below the audio range
    return [layout.start_of_human, 0, 40, 41, 42, layout.end_of_text, layout.end_of_human,
            layout.start_of_ai, layout.start_of_speech]


async def _collect(engine: VllmEngine, rid: str, **kw: object) -> list[list[int]]:
    return [delta async for delta in engine.generate(rid, **kw)]  # type: ignore[arg-type]


async def _wait_idle(engine: VllmEngine, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while engine.engine_unfinished_requests() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)


async def test_streams_deltas_within_allowed_tokens(engine: VllmEngine, layout: CodecLayout) -> None:
    allowed = layout.audio_token_ids()  # excludes every EOS / stop id
    sampling = {"max_tokens": 40, "allowed_token_ids": allowed, "seed": 1, "temperature": 1.0}
    deltas = await _collect(engine, "allowed", prompt_token_ids=_prompt(layout), sampling=sampling)
    tokens = [t for d in deltas for t in d]
    assert len(tokens) == 40
    assert len(deltas) > 1  # streamed, not one final blob
    assert all(layout.audio_token_offset <= t < layout.audio_token_end for t in tokens)
    assert engine.load() == 0


async def test_matches_transformers_greedy(engine: VllmEngine, layout: CodecLayout, talker_dir: str) -> None:
    # vLLM loads the tiny checkpoint exactly as transformers does (tied embeddings,
    # rope, GQA): greedy continuations agree.
    from transformers import LlamaForCausalLM

    prompts = [[layout.start_of_human, 0, t, layout.end_of_text, layout.start_of_speech] for t in (40, 300, 700)]
    hf = LlamaForCausalLM.from_pretrained(talker_dir, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            # explicit mask: otherwise generate() infers one from pad_token_id and
            # would mask any prompt token equal to it
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                              eos_token_id=None, pad_token_id=layout.end_of_speech)
            expected.append(out[0, len(p):].tolist())
    sampling = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    got = await asyncio.gather(*[_collect(engine, f"greedy-{i}", prompt_token_ids=p, sampling=sampling)
                                 for i, p in enumerate(prompts)])
    assert [[t for d in run for t in d] for run in got] == expected
    assert len({tuple(e) for e in expected}) > 1  # the prompts matter (not a constant model)


async def test_allowed_token_ranges(engine: VllmEngine, layout: CodecLayout) -> None:
    # Our logits processor: same constraint as allowed_token_ids, O(1) per request.
    lo, cb = layout.audio_token_offset, layout.codebook_size
    ranges = [[lo, lo + cb], [lo + 6 * cb, layout.audio_token_end]]  # slots 0 and 6
    sampling = {"max_tokens": 40, "allowed_token_ranges": ranges, "seed": 2}
    # An unconstrained request that strongly prefers text token 5 runs in the same
    # batch: if a constrained row's mask leaked onto it, it would emit audio tokens.
    free_sampling = {"max_tokens": 40, "ignore_eos": True, "logit_bias": {5: 100.0}}
    # Requests of different lengths finish at different steps, so vLLM compacts the
    # batch and moves rows around under the processor.
    runs = await asyncio.gather(
        _collect(engine, "free-short", prompt_token_ids=_prompt(layout)[:3], sampling={**free_sampling, "max_tokens": 3}),
        _collect(engine, "ranges", prompt_token_ids=_prompt(layout), sampling=sampling),
        _collect(engine, "ranges-short", prompt_token_ids=_prompt(layout), sampling={**sampling, "max_tokens": 9}),
        _collect(engine, "free", prompt_token_ids=_prompt(layout)[:4], sampling=free_sampling),
    )
    short, constrained, constrained_short, free = ([t for d in run for t in d] for run in runs)
    assert short == [5] * 3 and free == [5] * 40
    assert len(constrained) == 40 and len(constrained_short) == 9
    for tokens in (constrained, constrained_short):
        assert all(lo <= t < lo + cb or lo + 6 * cb <= t < layout.audio_token_end for t in tokens)
    assert any(t >= lo + 6 * cb for t in constrained) and any(t < lo + cb for t in constrained)
    with pytest.raises(EngineError, match="allowed_token_ranges"):
        await _collect(engine, "ranges-bad", prompt_token_ids=_prompt(layout),
                       sampling={"max_tokens": 2, "allowed_token_ranges": [[5, 5]]})


async def test_same_seed_same_tokens(engine: VllmEngine, layout: CodecLayout) -> None:
    sampling = {"max_tokens": 30, "seed": 1234, "temperature": 1.0, "top_p": 0.95,
                "allowed_token_ids": layout.audio_token_ids()}
    runs = await asyncio.gather(
        *[_collect(engine, f"seed-{i}", prompt_token_ids=_prompt(layout), sampling=sampling) for i in range(2)]
    )
    a, b = ([t for d in run for t in d] for run in runs)
    assert a == b and len(a) == 30
    other = await _collect(engine, "seed-x", prompt_token_ids=_prompt(layout), sampling={**sampling, "seed": 99})
    assert [t for d in other for t in d] != a


async def test_seeded_burst_of_long_prompts_keeps_the_engine_alive(engine: VllmEngine, layout: CodecLayout) -> None:
    """More prompt tokens at once than one step takes: with chunked prefill a seeded
    prompt split over steps killed the CPU engine (its generator has no offset to
    rewind). Every request completes, and seeds still reproduce."""
    audio = layout.audio_token_ids()
    base = _prompt(layout)

    def prompt(i: int) -> list[int]:
        return (base + [audio[(i * 31 + k) % len(audio)] for k in range(300)])[:300]

    async def run(i: int, seed: int) -> list[int]:
        deltas = await _collect(engine, f"burst-{i}-{seed}", prompt_token_ids=prompt(i),
                                sampling={"max_tokens": 4, "seed": seed, "temperature": 1.0, "ignore_eos": True})
        return [t for d in deltas for t in d]

    first = await asyncio.gather(*(run(i, 100 + i) for i in range(40)))
    assert all(len(x) == 4 for x in first)
    again = await run(7, 107)
    assert again == first[7]


async def test_cancel_consumer_aborts_request(engine: VllmEngine, layout: CodecLayout) -> None:
    sampling = {"max_tokens": 2000, "ignore_eos": True}
    # 1) consumer breaks out and closes the stream
    gen = engine.generate("brk", prompt_token_ids=_prompt(layout), sampling=sampling)
    async for _ in gen:
        assert engine.load() == 1 and engine.running_requests() == {"brk"}
        break
    await gen.aclose()  # type: ignore[attr-defined]
    assert engine.load() == 0
    await _wait_idle(engine)
    assert engine.engine_unfinished_requests() == 0

    # 2) the consuming task is cancelled mid-stream
    got: list[int] = []

    async def consume() -> None:
        async for delta in engine.generate("cnl", prompt_token_ids=_prompt(layout), sampling=sampling):
            got.extend(delta)

    task = asyncio.create_task(consume())
    while len(got) < 5:
        await asyncio.sleep(0.01)
    assert engine.running_requests() == {"cnl"}
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.load() == 0
    await _wait_idle(engine)
    assert engine.engine_unfinished_requests() == 0
    assert len(got) < 2000


async def test_abort_ends_stream(engine: VllmEngine, layout: CodecLayout) -> None:
    got: list[int] = []

    async def consume() -> None:
        async for delta in engine.generate("ab", prompt_token_ids=_prompt(layout),
                                           sampling={"max_tokens": 2000, "ignore_eos": True}):
            got.extend(delta)

    task = asyncio.create_task(consume())
    while len(got) < 3:
        await asyncio.sleep(0.01)
    await engine.abort("ab")
    await asyncio.wait_for(task, 10)  # ends normally, no exception
    assert engine.load() == 0 and len(got) < 2000
    await _wait_idle(engine)
    assert engine.engine_unfinished_requests() == 0
    await engine.abort("never-existed")  # ignored


async def test_prompt_embeds(engine: VllmEngine, layout: CodecLayout) -> None:
    emb = torch.randn(6, engine.hidden_size, generator=torch.Generator().manual_seed(0))
    sampling = {"max_tokens": 12, "allowed_token_ids": layout.audio_token_ids(), "seed": 5}
    tokens = [t for d in await _collect(engine, "emb", prompt_embeds=emb, sampling=sampling) for t in d]
    assert len(tokens) == 12
    assert all(layout.is_audio(t) for t in tokens)
    with pytest.raises(EngineError):
        await _collect(engine, "emb-bad", prompt_embeds=torch.randn(3, engine.hidden_size + 1), sampling=sampling)


async def test_bad_requests_are_clear_errors(engine: VllmEngine, layout: CodecLayout) -> None:
    with pytest.raises(EngineError, match="sampling"):
        await _collect(engine, "bad1", prompt_token_ids=_prompt(layout), sampling={"n": 2})
    with pytest.raises(EngineError, match="vocabulary"):
        await _collect(engine, "bad2", prompt_token_ids=[10**7], sampling={"max_tokens": 2})
    with pytest.raises(EngineError, match="exactly one"):
        await _collect(engine, "bad3", sampling={"max_tokens": 2})
    assert engine.load() == 0
    assert engine.health()["ok"]


def _worker_cores(engine_children_before: set[int]) -> list[set[int]]:
    """The cores of the Workers of this process's own engines (a Worker's parent is its
    EngineCore, a child of the process that built the engine; servers the suite started
    in processes of their own have theirs one level further down)."""
    import psutil

    me = psutil.Process()
    return [set(c.cpu_affinity()) for c in me.children(recursive=True)
            if c.name().startswith("VLLM::Worker") and c.pid not in engine_children_before and (p := c.parent()) is not None and p.ppid() == me.pid]


async def test_a_later_engine_binds_its_worker_where_the_first_did_not_on_the_frontends_core(engine: VllmEngine, talker_dir: str) -> None:
    """The first engine moved this process off its Worker's core. A second engine is
    spawned from all of the server's cores again, so vLLM binds its Worker where it
    bound the first's, never onto the frontend's core (on 2 cores that put the
    thinker's prefill beside every audio decode)."""
    import psutil

    first = _worker_cores(set())
    assert len(first) == 1
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    frontend = set(os.sched_getaffinity(0))
    second = VllmEngine(talker_dir, name="second")
    await second.start()
    try:
        [cores] = _worker_cores(before)
        assert cores == first[0], (cores, first[0])
        if engine.isolated_cores is not None:  # the frontend was moved: it shares no core with a Worker
            assert not (frontend & cores) and not (set(os.sched_getaffinity(0)) & cores)
        assert set(os.sched_getaffinity(0)) == frontend  # the spawning thread got its own cores back
    finally:
        await second.stop()


def test_a_gpu_overlays_memory_settings_give_way_on_a_cpu(caplog):
    """An overlay written for a GPU (`gpu_memory_utilization: 0.9`, `kv_cache_memory_bytes:
    null`) served on vLLM's CPU backend: there the first reserves 0.9 of the host's
    memory (the engine failed to start beside any other) and the second asks for the
    profiling that misreads a CPU host; both give way to the CPU KV budget, said once."""
    import logging

    from omni_rt.engines.vllm import CPU_DEFAULT_ENGINE_ARGS

    gpu = VllmEngine("/models/x", {"kv_cache_memory_bytes": None, "gpu_memory_utilization": 0.9, "max_model_len": 8192}, name="thinker")
    with caplog.at_level(logging.WARNING, "omni_rt.engines.vllm"):
        args = gpu.resolved_engine_args()
    assert "gpu_memory_utilization" not in args and args["max_model_len"] == 8192
    assert args["kv_cache_memory_bytes"] == CPU_DEFAULT_ENGINE_ARGS["kv_cache_memory_bytes"]
    assert "engine thinker on a CPU: gpu_memory_utilization=0.9, kv_cache_memory_bytes=None are GPU memory settings" in caplog.text
    sized = VllmEngine("/models/x", {"kv_cache_memory_bytes": 1 << 28}, name="talker").resolved_engine_args()
    assert sized["kv_cache_memory_bytes"] == 1 << 28
