"""The voice pipeline's thinker stage on its real tokenizer (the tiny checkpoint),
with a fake AR engine: prompt building and streamed text."""

from __future__ import annotations

import numpy as np
import pytest

from omni_rt.connectors.inproc import InprocConnector
from omni_rt.orchestrator import Orchestrator
from omni_rt.payloads import Fence
from omni_rt.specs import ProfileSpec, load_pipeline
from omni_rt.stage_pool import Replica, StagePool
from pipelines import PIPELINE_DIR
from pipelines.voice import ThinkerProcessor
from testkit import FakeArEngine

pytestmark = pytest.mark.integration  # the thinker's real processor and tokenizer on the tiny checkpoint


class Recording(FakeArEngine):
    """Remembers every token it produced."""

    def __init__(self) -> None:
        super().__init__(name="thinker", vocab_size=900)
        self.produced: list[int] = []

    async def generate(self, request_id, **kw):
        async for toks in super().generate(request_id, **kw):
            self.produced.extend(toks)
            yield toks


async def thinker(models_dir) -> tuple[Orchestrator, ThinkerProcessor, Recording]:
    spec = next(s for s in load_pipeline(PIPELINE_DIR / "voice.yaml").profiles["default"].stages if s.name == "thinker")
    spec = spec.model_copy(update={"model": str(models_dir / "tiny-qwen2-thinker"), "engine": "fake", "engine_args": {}})
    engine = Recording()
    proc = ThinkerProcessor(spec, engine, {})
    await proc.start()
    profile = ProfileSpec(entry="thinker", stages=[spec], edges=[], final_outputs=["thinker"])
    pool = StagePool(spec, [Replica(0, engine, {}, proc)])
    return Orchestrator({"voice": profile}, {"thinker": pool}, {"inproc": InprocConnector()}), proc, engine


async def test_the_thinker_decodes_its_output_incrementally(models_dir, monkeypatch):
    """Each new token is decoded once: a response of n tokens costs O(n) decoding,
    not a decode of the whole output per token (O(n^2))."""
    orch, proc, engine = await thinker(models_dir)
    decoded: list[int] = []
    whole = proc.decode

    def counting(ids):
        decoded.append(len(ids))
        return whole(ids)

    monkeypatch.setattr(proc, "decode", counting)
    n = 300
    stream = orch.submit("voice", fence=Fence("s"), params={"messages": [{"role": "user", "content": "Hi"}], "max_output_tokens": n, "seed": 7})
    stream.end_input()
    text = "".join([p.text or "" async for _, p, _ in stream.payloads()])
    await stream.close()
    assert len(engine.produced) == n
    assert sum(decoded) <= 2 * n, f"decoded {sum(decoded)} token ids for {n} tokens"
    # the same text a whole decode gives, up to an incomplete UTF-8 sequence at the end
    full = whole([t for t in engine.produced if t not in proc.stop_ids])
    assert full.rstrip("\ufffd") == text or full == text


async def test_incremental_text_equals_the_whole_decode_across_many_outputs(models_dir):
    _, proc, _ = await thinker(models_dir)
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = [int(t) for t in rng.integers(0, proc.text_vocab, int(rng.integers(1, 60)))]
        step = proc.detokenizer()
        streamed = "".join(step([t]) for t in ids)
        full = proc.decode(ids)
        assert streamed == full or (full.endswith("\ufffd") and full.startswith(streamed)), (streamed, full)
