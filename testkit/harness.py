"""Shared test harness: build an orchestrator over fake stage processors in one call."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from omni_rt.connectors.base import Connector
from omni_rt.connectors.inproc import InprocConnector
from omni_rt.engines.fake import FakeArEngine
from omni_rt.orchestrator import Orchestrator
from omni_rt.payloads import Handle, Payload, PayloadKind
from omni_rt.specs import ProfileSpec
from omni_rt.stage import StageContext, StageError, StageProcessor
from omni_rt.stage_pool import Replica, StagePool

# API keys of the shared test server (tests/conftest.py writes its deploy overlay).
ADMIN_KEY = "test-admin-key-0001"
ALICE_KEY = "test-alice-key-0001"
LIMITED_KEY = "test-limited-key-001"  # principal "limited": at most one session at a time
ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN_KEY}"}
SERVER_OVERLAY = {
    "server": {
        "api_keys": [
            {"key": ADMIN_KEY, "principal": "ops", "admin": True},
            {"key": ALICE_KEY, "principal": "alice"},
            {"key": LIMITED_KEY, "principal": "limited"},
        ]
    },
    # short grace so the duplex tests see expiry; a small client queue bound so the
    # slow-consumer test fills it with one long answer
    "sessions": {"principal_caps": {"limited": 1}, "disconnect_grace_s": 4, "reaper_interval_s": 0.5, "max_pending_events": 300},
    # Answers run to their token limit (the stop token is masked until then): the
    # random tiny thinker would otherwise stop at a random point, and tests that need
    # an answer still running (cancel, barge-in, disconnect) would depend on chance.
    "pipelines": {"voice": {"stages": {"thinker": {"processor_args": {"min_tokens": 100000}}}},
                  # The shared server's Moshi tests check that conversations are heard, on a
                  # machine whose step times vary with whatever else the suite runs (a
                  # second conversation was refused at 114 ms predicted against 60): its
                  # frame-budget admission is pinned in process (tests/protocols/test_duplex_model.py).
                  # (A loaded CI machine once measured the tiny model's step alone at 84 ms: its
                  # first conversation is admitted up to two frames too.)
                  "moshi": {"stages": {"moshi": {"processor_args": {"frame_budget_ms": 160.0, "budget_headroom": 1.0}}}}},
}


def http_client(base_url: str, headers: dict[str, str], timeout: float = 120) -> Any:
    """A reusable HTTP client for tests. Idle connections expire quickly (a reused
    connection the server closed meanwhile fails the request)."""
    import httpx

    return httpx.Client(
        base_url=base_url,
        headers=headers,
        timeout=timeout,
        limits=httpx.Limits(keepalive_expiry=2.0),
        transport=httpx.HTTPTransport(retries=1),
    )


class CountingConnector(Connector):
    """Wraps a connector and records which module called put/get (docs/design.md, invariant 1)."""

    def __init__(self, inner: InprocConnector) -> None:
        self.inner = inner
        self.name = inner.name
        self.callers: list[tuple[str, str]] = []
        self.bytes_moved = 0

    def _caller(self, op: str) -> None:
        self.callers.append((op, sys._getframe(2).f_globals.get("__name__", "?")))

    def put(self, request_id: str, key: str, payload: Payload, readers: int = 1) -> Handle:
        self._caller("put")
        self.bytes_moved += payload.nbytes
        return self.inner.put(request_id, key, payload, readers)

    def get(self, handle: Handle) -> Payload:
        self._caller("get")
        return self.inner.get(handle)

    async def aget(self, handle: Handle) -> Payload:
        self._caller("get")
        return self.inner.get(handle)

    def cleanup(self, request_id: str) -> int:
        return self.inner.cleanup(request_id)

    def health(self) -> dict[str, Any]:
        return self.inner.health()


class EmitN(StageProcessor):
    """Entry stage: reads client inputs (each an int count in meta) and emits that many
    TOKENS chunks per input, `delay` seconds apart, through the fake engine."""

    delay = 0.0

    async def run(self, ctx: StageContext) -> None:
        async for p in ctx.input():
            n = int(p.meta.get("n", 3))
            assert isinstance(self.engine, FakeArEngine)
            async for toks in self.engine.generate(
                f"{ctx.request_id}:{self.spec.name}", prompt_token_ids=[n], sampling={"max_tokens": n, "seed": n}
            ):
                await ctx.emit(Payload(PayloadKind.TOKENS, ctx.fence, arrays={"t": np.asarray(toks, np.int64)}))


class Double(StageProcessor):
    """Consumes token chunks, emits them doubled; records when it started."""

    started_after: list[set[str]] = []
    delay = 0.0

    async def run(self, ctx: StageContext) -> None:
        type(self).started_after.append(set(ctx._state.done))
        async for p in ctx.input():
            if self.delay:
                await asyncio.sleep(self.delay)
            await ctx.emit(Payload(PayloadKind.TOKENS, ctx.fence, arrays={"t": p.arrays["t"] * 2}))


class Fail(StageProcessor):
    async def run(self, ctx: StageContext) -> None:
        async for _ in ctx.input():
            raise StageError("boom in stage")


def make_orchestrator(
    profile: ProfileSpec, processors: Mapping[str, type[StageProcessor]], *, step_ms: float = 0.0
) -> tuple[Orchestrator, dict[str, FakeArEngine], CountingConnector]:
    conn = CountingConnector(InprocConnector())
    engines: dict[str, FakeArEngine] = {}
    pools = {}
    for s in profile.stages:
        eng = FakeArEngine(name=s.name, step_ms=step_ms)
        engines[s.name] = eng
        pools[s.name] = StagePool(s, [Replica(0, eng, {}, processors[s.name](s, eng, {}))])
    return Orchestrator({"p": profile}, pools, {"inproc": conn}), engines, conn


def profile(stages: list[tuple[str, str]], edges: list[dict[str, Any]], finals: list[str]) -> ProfileSpec:
    return ProfileSpec.model_validate(
        {
            "entry": stages[0][0],
            "stages": [
                {"name": n, "kind": "ar", "engine": "fake", "processor": f"testkit.harness:{proc}"} for n, proc in stages
            ],
            "edges": [{"payload": "tokens", **e} for e in edges],
            "final_outputs": finals,
        }
    )


class LateEmitter(StageProcessor):
    """Entry stage whose "engine" keeps flushing chunks after it is cancelled, the way
    an engine thread delivers outputs it had already computed. Every chunk carries
    meta {"turn": fence.turn, "i": index}. `late_emits` counts the chunks it tried to
    emit after the cancel; `released` records release_session calls."""

    delay = 0.01
    late = 5
    late_emits = 0
    released: list[str] = []

    async def run(self, ctx: StageContext) -> None:
        i = 0

        def chunk() -> Payload:
            return Payload(PayloadKind.TOKENS, ctx.fence, arrays={"t": np.asarray([i], np.int64)}, meta={"turn": ctx.fence.turn, "i": i})

        try:
            async for p in ctx.input():
                for _ in range(int(p.meta.get("n", 3))):
                    await asyncio.sleep(self.delay)
                    await ctx.emit(chunk())
                    i += 1
        except asyncio.CancelledError:
            async def flush() -> None:
                nonlocal i
                for _ in range(self.late):
                    await asyncio.sleep(0.001)
                    type(self).late_emits += 1
                    await ctx.emit(chunk())
                    i += 1

            asyncio.get_running_loop().create_task(flush())
            raise

    def release_session(self, session_id: str) -> None:
        type(self).released.append(session_id)


async def admitting(base_url: str, kind: str = "realtime", timeout_s: float = 30.0) -> None:
    """Wait until the shared server would admit one more `kind` session
    (`omni_rt_admission_headroom_sessions`, computed from the load it measures now): a
    test that needs a turn answered does not start while the previous tests' answers
    still weigh on load-aware admission (it would be refused `capacity`)."""
    import asyncio
    import re
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    pattern = re.compile(rf'^omni_rt_admission_headroom_sessions{{kind="{kind}"}} (\S+)$', re.M)
    async with httpx.AsyncClient(base_url=base_url, headers=ADMIN_HEADERS, timeout=10) as api:
        while True:
            m = pattern.search((await api.get("/metrics")).text)
            if m is None or float(m.group(1)) >= 1 or time.monotonic() > deadline:
                return
            await asyncio.sleep(0.5)


def speech_pcm16(text: str, rate: int = 24000) -> bytes:
    """Real speech: espeak-ng to WAV, resampled to `rate` PCM16 (required: no skip)."""
    import shutil
    import subprocess
    import tempfile
    import wave

    import soxr

    exe = shutil.which("espeak-ng")
    assert exe, "espeak-ng is required for the server-VAD tests (apt-get install espeak-ng)"
    with tempfile.NamedTemporaryFile(suffix=".wav") as f:
        subprocess.run([exe, "-v", "en-us", "-s", "170", "-w", f.name, text], check=True, capture_output=True)
        w = wave.open(f.name)
        w_rate = w.getframerate()
        pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768.0
    y = soxr.resample(pcm, w_rate, rate)
    return (np.clip(y, -1, 1) * 32767).astype("<i2").tobytes()


def silence(seconds: float, rate: int = 24000) -> bytes:
    return bytes(int(rate * seconds) * 2)


class Merge(StageProcessor):
    """Reads every input to its end, then emits their tokens concatenated, in the order
    of the input names (a stage with several batch inputs)."""

    async def run(self, ctx: StageContext) -> None:
        parts = []
        for name in sorted(ctx.inputs):
            parts += [p.arrays["t"] for p in await ctx.input(name).read_all()]
        await ctx.emit(Payload(PayloadKind.TOKENS, ctx.fence, arrays={"t": np.concatenate(parts)}))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def voice_profile_server(models_dir: Path, tmp: Path, profile: str) -> Iterator[Any]:
    """A real server of its own serving the voice pipeline under `profile` (the other
    pipelines off), for a module-scoped fixture: yields the running `ServerProcess`."""
    import os

    import yaml

    from latency_bench.server import ServerProcess, voice_only_overlay

    deploy = tmp / "deploy.yaml"
    deploy.write_text(yaml.safe_dump(voice_only_overlay(profile)))
    proc = ServerProcess(port=free_port(), deploy=deploy, log_path=tmp / "server.log", cwd=Path(__file__).resolve().parent.parent,
                         env=dict(os.environ, OMNI_RT_MODELS_DIR=str(models_dir)))
    proc.start()
    try:
        proc.wait_ready(timeout_s=300)
    except Exception:
        print((tmp / "server.log").read_text()[-4000:])
        proc.stop()
        raise
    yield proc
    proc.stop()
