"""Start-up calibration of load-aware admission (`sessions.admission`).

A server that has served nobody yet knows nothing of what a session costs, and a burst
of callers at a cold server would be refused (or over-admitted) on a guess. Before the
server takes its first caller, each real-time voice pipeline it serves (one with a
thinker and a speech stage, served on a voice wire) answers a short synthetic prompt:
once to warm the stages up (not counted), alone three times (the median is kept: one
answer slowed by something else on the machine does not size admission), then
`calibrate_sessions` times together, their starts spread over one answer's time (callers do not finish speaking
in step: one's prompt is prefilled while the others are answered, which holds their
answers on an engine that does not chunk its prefills), then (where the line through
those two says more fit) as many together as it says fit: generation slows gently until the cores saturate and then steeply, and the
burst admission would admit is what must be measured. The generation real-time factor of those answers, as the stages' own streams
measure it (the server's generation meter, the same figure admission reads live), gives
the pipeline's `Cost`: the RTF of one answer alone and what each more answer at the same
time adds. A cost the deploy states (`pipeline_costs`) is not measured.

On a GPU or a bigger CPU box the same measurement sizes admission to that machine; on
a loaded one it measures the load as it is then (outside load later stretches it).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from omni_rt.errors import OmniError
from omni_rt.payloads import AUDIO_PLACEHOLDER, SPEECH_STAGES, Fence, Payload, PayloadKind

if TYPE_CHECKING:
    from collections.abc import Mapping

    from omni_rt.specs import PipelineSpec
    from sessions.manager import SessionManager

__all__ = ["VOICE_WIRES", "calibrate", "calibrated_pipelines"]

log = logging.getLogger("sessions.calibration")

VOICE_WIRES = frozenset({"realtime", "duplex", "webrtc"})
PROMPT = "Tell me about the weather today in a few sentences."
CALIBRATION_AUDIO_S = 3.0  # a caller's turn
AUDIO_RATE = 16000


@functools.cache
def _utterance() -> np.ndarray:
    """A voiced-sounding signal of a caller's turn (tones under noise; the audio tower's
    cost does not depend on what is said)."""
    t = np.arange(int(CALIBRATION_AUDIO_S * AUDIO_RATE)) / AUDIO_RATE
    rng = np.random.default_rng(0)
    x = 0.2 * np.sin(2 * np.pi * 180 * t) * (1 + np.sin(2 * np.pi * 3 * t)) + 0.02 * rng.standard_normal(len(t))
    return x.astype(np.float32)
TIMEOUT_S = 120.0
ALONE_RUNS = 3  # answers alone, after the warm-up: their median is the base


def calibrated_pipelines(manager: SessionManager, specs: Mapping[str, PipelineSpec]) -> list[str]:
    """The served pipelines calibration measures: voice wires, a thinker and a speech
    stage, no cost stated in the deploy."""
    orch = manager.orchestrator
    if orch is None:
        return []
    out = []
    for name, spec in specs.items():
        profile = orch.pipelines.get(name)
        if profile is None or not set(spec.wires) & VOICE_WIRES:
            continue
        if "thinker" not in {s.name for s in profile.stages} or not set(profile.final_outputs) & SPEECH_STAGES:
            continue
        if name in manager.admission.spec.pipeline_costs:
            continue
        out.append(name)
    return out


async def _answer(manager: SessionManager, pipeline: str, speech: set[str], voice: str | None, tokens: int, tag: str, audio: bool) -> None:
    assert manager.orchestrator is not None
    fence = Fence(f"calibration-{tag}")
    content = f"{AUDIO_PLACEHOLDER} {PROMPT}" if audio else PROMPT
    params: dict[str, Any] = {"messages": [{"role": "user", "content": content}], "max_output_tokens": tokens, "temperature": 0.0}
    if voice is not None:
        params["voice"] = voice
    stream = manager.orchestrator.submit(pipeline, fence=fence, params=params, outputs={"thinker", *speech},
                                         entry="thinker", request_id=f"calibration-{pipeline}-{tag}-{time.monotonic_ns():x}")
    if audio:
        stream.send_input(Payload(PayloadKind.AUDIO, fence, arrays={"pcm": _utterance()}, meta={"sample_rate": AUDIO_RATE}))
    stream.end_input()
    try:
        async for _ in stream.payloads():  # (the utterance is made once, before the levels)
            pass
    finally:
        await stream.close()


async def _level(manager: SessionManager, pipeline: str, speech: set[str], voice: str | None, tokens: int, n: int,
                 audio: bool, spread_s: float = 0.0) -> tuple[float | None, float]:
    """The worst generation RTF of `n` answers generated together, their starts spread
    evenly over `spread_s` (callers do not finish speaking in step: one's prompt is
    prefilled while the others are answered, and on an engine that does not chunk its
    prefills, that holds their answers), and the level's wall time."""
    meter = manager.meters.generation
    meter.clear()
    t0 = time.monotonic()

    async def one(i: int) -> None:
        await asyncio.sleep(spread_s * i / n)
        await _answer(manager, pipeline, speech, voice, tokens, f"{n}-{i}", audio)

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), TIMEOUT_S)
    wall = time.monotonic() - t0
    worst = meter.worst()
    meter.clear()
    return worst, wall


async def calibrate(manager: SessionManager, specs: Mapping[str, PipelineSpec]) -> dict[str, Any]:
    """Measure every real-time voice pipeline's cost (see the module docstring) into
    `manager.admission`; what was measured, per pipeline. A pipeline whose answers fail
    or measure nothing keeps the prior, with a warning: the server still starts."""
    adm = manager.admission
    spec = adm.spec
    out: dict[str, Any] = {}
    if not spec.enabled or not spec.calibrate:
        return out
    assert manager.orchestrator is not None
    for name in calibrated_pipelines(manager, specs):
        profile = manager.orchestrator.pipelines[name]
        speech = set(profile.final_outputs) & SPEECH_STAGES
        voices = specs[name].voices
        voice = next(iter(voices.values()), None) if voices else None
        k, tokens = spec.calibrate_sessions, spec.calibrate_tokens
        thinker = next(s for s in profile.stages if s.name == "thinker")
        audio = thinker.input == PayloadKind.AUDIO and profile.entry == "thinker"  # the thinker hears the caller itself
        if audio:
            await asyncio.to_thread(_utterance)
        t0 = time.monotonic()
        levels: dict[int, float] = {}
        try:
            await _level(manager, name, speech, voice, tokens, 1, audio)  # warm-up: first requests pay for lazy set-up
            # one answer alone, ALONE_RUNS times: the median (one answer slowed by
            # something else on the machine does not decide what every burst is weighed by)
            alone = [await _level(manager, name, speech, voice, tokens, 1, audio) for _ in range(ALONE_RUNS)]
            rtfs = [r for r, _ in alone if r is not None]
            base = float(np.median(rtfs)) if rtfs else None
            wall1 = float(np.median([w for _, w in alone]))
            at_k, wallk = await _level(manager, name, speech, voice, tokens, k, audio, wall1)
            if base is not None and at_k is not None:
                levels = {1: base, k: at_k}
                # A straight line from 1 and k answers misses the cliff where the cores
                # saturate: the burst it would admit is measured too, and the steeper
                # line kept (one more level, at most calibrate_max_sessions).
                n = min(adm.cost_of_levels(levels).sessions_under(spec.target_rtf), spec.calibrate_max_sessions)
                if n > k:
                    at_n, _ = await _level(manager, name, speech, voice, tokens, n, audio, wall1)
                    if at_n is not None:
                        levels[n] = at_n
        except Exception as exc:  # noqa: BLE001 - the server still serves; the failure is logged with its cause
            log.warning("admission calibration of pipeline %s failed (%s: %s); its sessions are weighed with the prior "
                        "session_cost_rtf %.3f", name, type(exc).__name__, exc, spec.session_cost_rtf,
                        exc_info=not isinstance(exc, (OmniError, asyncio.TimeoutError)))
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        if not levels:
            log.warning("admission calibration of pipeline %s measured no audio stream; its sessions are weighed with the prior", name)
            out[name] = {"error": "no audio measured"}
            continue
        details = {"answers_at_once": sorted(levels), "max_output_tokens": tokens, "audio_s": CALIBRATION_AUDIO_S if audio else 0.0,
                   "rtf_alone_runs": [None if r is None else round(r, 4) for r, _ in alone],
                   "wall_s_alone": round(wall1, 3), f"wall_s_at_{k}": round(wallk, 3), "took_s": round(time.monotonic() - t0, 3)}
        cost = adm.calibrated(name, levels, details)
        out[name] = adm.calibration[name]
        log.info("admission calibrated pipeline %s: one answer alone generates at %.3fx real time, each more at once adds %.3f "
                 "(measured at once: %s); a burst of up to %d sessions is admitted at target %.2f", name, cost.base, cost.per_session,
                 ", ".join(f"{n}: {r:.3f}" for n, r in sorted(levels.items())), cost.sessions_under(spec.target_rtf), spec.target_rtf)
    return out
