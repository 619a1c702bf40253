"""Every torch / diffusers stage at its public checkpoint's shapes, in process.

Each family is built from its configuration (`latency_bench.shape_configs`: the public
checkpoint's at ``--shapes real``, the tiny checkpoint's at ``--shapes tiny``) with
random weights — a step's time depends on the shapes, not the values — and driven
through the engine the server runs it in (`TorchEngine` / `DiffusersEngine`), calling
the stage's own batched op at batch sizes 1…N:

* ``moshi``: `MoshiSteps.step` (Mimi encode, the temporal transformer, the depth
  decoder, Mimi decode) for N conversations: the step just after they start and the
  step of conversations whose attention windows are full (3,000 frames along: the
  steady state), against the 80 ms frame; the sessions that fit a frame, and the
  admission budget's share of it (`frame_budget_ms` × `budget_headroom`);
* ``pi0``: one action chunk for N robots in lockstep (`Pi0Steps.encode`, then
  `num_inference_steps` × `Pi0Steps.denoise`), per camera count; robots within 50 ms;
* ``omni``: Qwen2.5-Omni's talker step (`OmniTalkerModule.talk_step`, a codec token
  every 20 ms) and token2wav's window (`Token2WavModule.mel` + `vocode`, the voice
  profile's chunking and ODE): step time, real-time factor, codes a second;
* ``omni3``: Qwen3-Omni's talker frame (`Omni3TalkerModule.frame`: talker + code
  predictor, a frame every 80 ms) and code2wav's window;
* ``wan``: one denoising step of N Wan 2.1 clips (480p, 81 frames at real shapes) and
  their VAE decode;
* ``skyreels``: live video — one chunk (diffusion forcing over the history's latent
  frames, every step of it, and its decode) for N sessions: frames a second per session;
* ``flux``: one denoising step of N 1024² images: steps a second.

The text encoders are not built (their conditioning is random tensors of their
shapes, put in the engine's prompt cache), nor the thinkers that the talker stages
hold for prompts (decode steps never touch them). With ``--device cuda`` each level
reports the peak GPU memory. ``--budget-s`` bounds the whole run (the levels past a
family's share are reported as skipped). JSON out with the machine, the GPU, and the
torch / transformers / diffusers versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from latency_bench import finish, machine_info, utc_now, write_json
from latency_bench import shape_configs as sc

SCHEMA = "omni-rt.latency_bench.shapes/1"
log = logging.getLogger("latency_bench.shapes")
MOSHI_FRAME_MS = 80.0
ROBOT_BUDGET_MS = 50.0  # a chunk inside one 20 Hz control period at 2.5x headroom (openpi's published latencies are 20-75 ms)
LEVELS = {
    "real": {"moshi": [1, 4, 8, 16, 24, 32], "pi0": [1, 4, 8, 16, 32], "omni": [1, 4, 8, 16], "omni3": [1, 4, 8, 16],
             "wan": [1, 2, 4], "skyreels": [1, 2, 4], "flux": [1, 2, 4]},
    "tiny": {f: [1, 2] for f in sc.FAMILIES},
}
CODEC_LEVELS = {"real": [1, 2, 4], "tiny": [1, 2]}
# per-shape sizes: the talkers' prompt positions, π0's camera counts, the video and image frames
# (the video stages' steps, guidance, history and frame rate are their processor_args: the example
# overlay's at real shapes, the pipeline's own at tiny ones; the sizes are the model cards')
SIZES: dict[str, dict[str, Any]] = {
    "real": {"talker_prompt": 512, "pi0_views": [1, 3], "video": (480, 832), "video_frames": 81, "live_video": (544, 960),
             "live_chunk_frames": 4, "image": 1024, "text_tokens": 512},
    "tiny": {"talker_prompt": 16, "pi0_views": [1, 2], "video": (32, 32), "video_frames": 5, "live_video": (32, 32),
             "live_chunk_frames": 4, "image": 32, "text_tokens": 8},
}
# where each video stage's processor_args are read: (example overlay, its pipeline, stage) at real shapes,
# (pipeline file, stage) at tiny ones
STAGE_ARGS = {"wan": (("wan2.1-t2v.yaml", "video", "t2v"), ("video.yaml", "t2v")),
              "skyreels": (("skyreels-v2-df.yaml", "video_edit", "video_dit"), ("video_edit.yaml", "video_dit"))}


# ---- timing helpers ------------------------------------------------------------------------------------------


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def _median_ms(fn: Callable[[], Awaitable[Any]], device: Any, repeat: int, warm: int = 1) -> float:
    for _ in range(warm):
        await fn()
    ts = []
    for _ in range(repeat):
        _sync(device)
        t = time.perf_counter()
        await fn()
        _sync(device)
        ts.append(time.perf_counter() - t)
    return round(statistics.median(ts) * 1000, 3)


def _reset_peak(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: Any, reserved: bool = False) -> float | None:
    """The level's peak GPU memory: allocated by tensors, or held by the allocator (`reserved`: what runs out)."""
    import torch

    if device.type != "cuda":
        return None
    return round((torch.cuda.max_memory_reserved(device) if reserved else torch.cuda.max_memory_allocated(device)) / 2**30, 2)


def _free(device: Any) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _building(device: Any, dtype: Any) -> Iterator[None]:
    """Modules made here are made on `device` in `dtype` (random init where the weights live)."""
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(before)


def _params(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


def _weights_gib(module: Any) -> float:
    return round(sum(p.numel() * p.element_size() for p in module.parameters()) / 2**30, 3)


def _largest(levels: dict[str, dict[str, Any]], ok: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The largest measured batch that `ok` accepts, and what bounds it: `time` (a larger one was
    measured and missed the budget), `memory` (a larger one ran out of it), or None (the levels,
    or the run's time, ran out first: the limit is at least that)."""
    best, bound = 0, None
    for n, r in levels.items():
        if "oom" in r:
            bound = bound or "memory"
        if "skipped" in r or "oom" in r or "error" in r:
            continue
        if ok(r):
            best = max(best, int(n))
        else:
            bound = "time"
    return {"batch": best, "bounded_by": bound}


def _failure(exc: BaseException, where: str) -> dict[str, str]:
    """`{"oom": ...}` when `exc` is running out of GPU memory (the engine reports it wrapped), else
    `{"error": ...}` (logged with its traceback)."""
    import torch

    oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
    if not oom:
        log.error("shapes: %s failed", where, exc_info=exc)
    return {"oom" if oom else "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}


class Run:
    """One bench run: the device, dtype, levels, the clock each family's share of the budget is read from."""

    def __init__(self, shapes: str, device: Any, dtype: Any, repeat: int, budget_s: float, batches: list[int] | None,
                 models: dict[str, Path] | None, layers: int | None = None) -> None:
        self.shapes, self.device, self.dtype, self.repeat = shapes, device, dtype, repeat
        self.budget_s, self.batches, self.models, self.layers = budget_s, batches, models, layers
        self.started = time.monotonic()
        self.family_deadline = self.started + budget_s
        self.sizes = SIZES["tiny" if layers else shapes]  # cut stacks: a check of the code paths, at the tiny sizes

    def levels(self, family: str) -> list[int]:
        return list(self.batches or LEVELS[self.shapes][family])

    def codec_levels(self) -> list[int]:
        return list(self.batches or CODEC_LEVELS[self.shapes])

    def config(self, family: str) -> dict[str, Any]:
        conf = sc.configuration(family, self.shapes, self.models)
        return sc.shallow(conf, self.layers) if self.layers else conf

    def out_of_time(self) -> bool:
        return time.monotonic() > self.family_deadline

    async def over(self, levels: list[int], one: Callable[[int], Awaitable[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
        """`one(n)` at each level, in order, with the peak memory of each; past the family's
        share of the budget the rest are skipped, and after running out of memory too."""

        out: dict[str, dict[str, Any]] = {}
        last: tuple[int, float] | None = None  # the last level's batch and seconds: the next one's forecast
        for i, n in enumerate(levels):
            forecast = last[1] * n / last[0] if last else 0.0
            if self.out_of_time() or time.monotonic() + forecast > self.family_deadline:
                for m in levels[i:]:
                    out[str(m)] = {"skipped": "time budget" + (f" (the next level would take ~{forecast:.0f} s)" if forecast else "")}
                break
            _free(self.device)
            _reset_peak(self.device)
            t = time.monotonic()
            try:
                r = await one(n)
            except Exception as exc:  # noqa: BLE001 - out of memory ends the family's levels; anything else is reported
                out[str(n)] = _failure(exc, f"level {n}")
                oom = "oom" in out[str(n)]
                for m in levels[i + 1 :]:
                    out[str(m)] = {"skipped": "out of memory at a smaller batch" if oom else "an error at a smaller batch"}
                _free(self.device)
                break
            r["peak_memory_gib"], r["peak_reserved_gib"] = _peak_gib(self.device), _peak_gib(self.device, reserved=True)
            out[str(n)] = r
            last = (n, time.monotonic() - t)
        return out

    def torch_engine(self, module: Any, name: str, realtime: bool, max_batch: int, as_built: bool = False) -> Any:
        """The engine the stage runs in, in the run's dtype (`as_built`: the module's own, as the
        example overlays leave the codecs: float32)."""
        from omni_rt.engines.torch_engine import TorchEngine

        dtype = None if as_built else str(self.dtype).removeprefix("torch.")
        return TorchEngine(lambda: module, name=name, realtime=realtime, device=str(self.device), dtype=dtype,
                           max_batch=max(1, max_batch), max_wait_ms=0.0)


async def _gather(engine: Any, items: list[Any], op: str | None) -> list[Any]:
    """The items submitted at once, as a stage's concurrent sessions do: the engine steps them as one batch."""
    return list(await asyncio.gather(*(engine.run(it, op=op) for it in items)))


async def _engine_steps(engine: Any, call: Callable[[], Awaitable[Any]]) -> int:
    """The engine steps one call took (1: every row in one batched step)."""
    before = engine.steps
    await call()
    return int(engine.steps - before)


# ---- Moshi ---------------------------------------------------------------------------------------------------


async def bench_moshi(run: Run) -> dict[str, Any]:
    import torch
    from transformers import MoshiForConditionalGeneration

    from pipelines.moshi import FrameClock, MoshiArgs
    from pipelines.moshi.steps import FRAME, MoshiSteps

    cfg = sc.transformers_config("moshi", run.config("moshi"))
    t0 = time.perf_counter()
    with _building(run.device, run.dtype):
        model = MoshiForConditionalGeneration._from_config(cfg, dtype=run.dtype, attn_implementation="sdpa").eval()
    build_s = time.perf_counter() - t0
    args = MoshiArgs()
    sampling = {"text_temperature": args.text_temperature, "audio_temperature": args.audio_temperature,
                "text_top_k": args.text_top_k, "audio_top_k": args.audio_top_k}
    levels = run.levels("moshi")
    engine = run.torch_engine(MoshiSteps(model), "moshi", realtime=True, max_batch=max(levels))
    await engine.start()
    clock = FrameClock(engine, sampling, "moshi")  # the server's per-conversation step item
    window = int(cfg.sliding_window or cfg.max_position_embeddings)
    rng = np.random.default_rng(0)

    async def one(n: int) -> dict[str, Any]:
        engine.module = None
        _free(run.device)
        steps = MoshiSteps(model).to(run.device)  # fresh slots at every level (no state of the last one held)
        steps._grow(n)
        engine.module = steps
        convs = [_Conv(slot=i, seed=i) for i in range(n)]

        def items() -> list[dict[str, np.ndarray]]:
            out = [clock.item(c, (rng.standard_normal(FRAME) * 0.1).astype(np.float32)) for c in convs]  # type: ignore[arg-type]
            for c in convs:
                c.fresh = False
            return out

        first = await _median_ms(lambda: _gather(engine, items(), "step"), run.device, 1, warm=0)
        start = await _median_ms(lambda: _gather(engine, items(), "step"), run.device, run.repeat, warm=1)
        steps.age(torch.arange(n, device=run.device), window)
        full = await _median_ms(lambda: _gather(engine, items(), "step"), run.device, run.repeat, warm=1)
        return {"first_step_ms": first, "step_ms": start, "step_ms_full_window": full, "rtf": round(full / MOSHI_FRAME_MS, 3),
                "late": full > MOSHI_FRAME_MS, "engine_steps_per_frame": await _engine_steps(engine, lambda: _gather(engine, items(), "step"))}

    try:
        result = await run.over(levels, one)
    finally:
        await engine.stop()
    budget = args.frame_budget_ms * args.budget_headroom
    return {"parameters": _params(model), "weights_gib": _weights_gib(model), "build_s": round(build_s, 1),
            "frame_ms": MOSHI_FRAME_MS, "context_frames": window, "sampling": sampling, "levels": result,
            "summary": {"sessions_within_frame": _largest(result, lambda r: r["step_ms_full_window"] <= MOSHI_FRAME_MS),
                        "sessions_within_admission_budget": _largest(result, lambda r: r["step_ms_full_window"] <= budget),
                        "admission_budget_ms": budget}}


class _Conv:
    """What `FrameClock.item` reads of a conversation."""

    def __init__(self, slot: int, seed: int) -> None:
        self.slot, self.seed, self.fresh = slot, seed, True


# ---- π0 --------------------------------------------------------------------------------------------------------


async def bench_pi0(run: Run) -> dict[str, Any]:
    import torch
    from transformers import PI0ForConditionalGeneration

    from pipelines.robot import DEFAULT_PROMPT_TOKENS, Pi0Steps

    cfg = sc.transformers_config("pi0", run.config("pi0"))
    t0 = time.perf_counter()
    with _building(run.device, run.dtype):
        model = PI0ForConditionalGeneration._from_config(cfg, dtype=run.dtype).eval()
    build_s = time.perf_counter() - t0
    vision = cfg.vlm_config.vision_config
    image_tokens = (int(vision.image_size) // int(vision.patch_size)) ** 2
    image_token = int(cfg.vlm_config.image_token_index)
    prompt = DEFAULT_PROMPT_TOKENS if run.shapes == "real" else 8
    steps = int(cfg.num_inference_steps)
    levels = run.levels("pi0")
    engine = run.torch_engine(Pi0Steps(model), "policy", realtime=False, max_batch=max(levels))
    await engine.start()
    gen = torch.Generator().manual_seed(0)

    def observation(views: int) -> dict[str, torch.Tensor]:
        # what PolicyProcessor.prepare hands the engine: the prompt padded to its length, the images' tokens first
        p = views * image_tokens + prompt
        ids = torch.randint(3, 1000, (p,), generator=gen)
        ids[: views * image_tokens] = image_token
        return {"input_ids": ids, "attention_mask": torch.ones(p, dtype=torch.long),
                "pixel_values": torch.randn(views, 3, int(vision.image_size), int(vision.image_size), generator=gen),
                "pixel_attention_mask": torch.ones(views, dtype=torch.bool), "state": torch.randn(int(cfg.max_state_dim), generator=gen),
                "noise": torch.randn(int(cfg.chunk_size), int(cfg.max_action_dim), generator=gen)}

    async def chunk(obs: list[dict[str, torch.Tensor]]) -> None:
        # PolicyProcessor.run: one encode, then the denoising steps on the device-resident prefix
        enc = await _gather(engine, obs, "encode")
        xs = [e["x"] for e in enc]
        dt = -1.0 / steps
        for k in range(steps):
            xs = await _gather(engine, [{"kv": e["kv"], "attention_mask": e["attention_mask"], "state": e["state"], "x": x,
                                         "t": np.asarray(1.0 + k * dt, np.float32), "dt": np.asarray(dt, np.float32)}
                                        for e, x in zip(enc, xs, strict=True)], "denoise")
        for x in xs:
            x.float().cpu()

    out: dict[str, Any] = {}
    try:
        for views in run.sizes["pi0_views"]:
            async def one(n: int, views: int = views) -> dict[str, Any]:
                obs = [observation(views) for _ in range(n)]
                enc_ms = await _median_ms(lambda: _gather(engine, obs, "encode"), run.device, run.repeat)
                ms = await _median_ms(lambda: chunk(obs), run.device, run.repeat)
                return {"chunk_ms": ms, "encode_ms": enc_ms, "prefix_tokens": views * image_tokens + prompt,
                        "actions_per_s": round(n * int(cfg.chunk_size) * 1000 / ms, 1)}

            out[str(views)] = await run.over(levels, one)
    finally:
        await engine.stop()
    return {"parameters": _params(model), "weights_gib": _weights_gib(model), "build_s": round(build_s, 1), "denoise_steps": steps,
            "chunk_size": int(cfg.chunk_size), "views": out,
            "summary": {"robots_within_budget": {v: _largest(r, lambda x: x["chunk_ms"] <= ROBOT_BUDGET_MS) for v, r in out.items()},
                        "chunk_budget_ms": ROBOT_BUDGET_MS}}


# ---- Qwen2.5-Omni / Qwen3-Omni: the talkers and their codecs ---------------------------------------------------------


def _voice_chunking(profile: str, edge_dst: str) -> dict[str, int]:
    """The voice pipeline's chunking of the codes going into `edge_dst` in `profile` (pipelines/voice.yaml)."""
    import yaml

    spec = yaml.safe_load((Path(__file__).resolve().parents[1] / "pipelines" / "voice.yaml").read_text())
    for edge in spec["profiles"][profile]["edges"]:
        if edge["dst"] == edge_dst:
            return {k: int(v) for k, v in edge["chunking"].items() if k.endswith("_frames")}
    raise KeyError(f"voice.yaml profile {profile}: no edge into {edge_dst}")


def _plain_id(cfg: Any) -> int:
    """A token id that is none of the config's special (audio, image, video, vision) ids: M-RoPE positions of plain text."""
    special = {int(v) for k, v in cfg.to_dict().items() if k.endswith(("token_id", "token_index")) and isinstance(v, int)}
    return next(i for i in range(1000) if i not in special)


async def _codec(run: Run, engine: Any, windows: Callable[[int], list[Any]], decode: Callable[[list[Any]], Awaitable[Any]],
                 chunk_s: float) -> dict[str, Any]:
    async def one(n: int) -> dict[str, Any]:
        xs = windows(n)
        ms = await _median_ms(lambda: decode(xs), run.device, run.repeat)
        return {"window_ms": ms, "rtf": round(ms / 1000 / chunk_s, 3), "audio_s_per_s": round(n * chunk_s * 1000 / ms, 2)}

    return await run.over(run.codec_levels(), one)


async def bench_omni(run: Run) -> dict[str, Any]:
    cfg = sc.transformers_config("omni", run.config("omni"))
    talker = await _omni_talker(run, cfg)
    _free(run.device)  # the talker's memory is back before the codec is built
    codec = await _omni_token2wav(run, cfg)
    return _talker_and_codec(talker, codec, "token2wav")


def _talker_max_len(run: Run) -> int:
    """Positions a talker slot needs: the prompt, then a level's steps (a warm-up, the timed ones, the batching check)."""
    return int(run.sizes["talker_prompt"]) + 4 * run.repeat + 16


async def _talker_levels(run: Run, levels: list[int], talker: Any, prefill: tuple[str, Callable[[int], dict[str, np.ndarray]]],
                         step: tuple[str, Callable[[int], dict[str, np.ndarray]]], period_s: float, rate: str) -> dict[str, dict[str, Any]]:
    """A talker's levels: N answers' prompts in (op and item of slot s: `prefill`), then one step of all N
    timed (`step`), against the `period_s` of audio each step makes (`rate`: the figure's name a second)."""
    engine = run.torch_engine(talker, "omni_talker", realtime=True, max_batch=max(levels))
    await engine.start()

    async def one(n: int) -> dict[str, Any]:
        talker.lengths.zero_()
        await _gather(engine, [prefill[1](s) for s in range(n)], prefill[0])

        def once() -> Awaitable[Any]:
            return _gather(engine, [step[1](s) for s in range(n)], step[0])

        ms = await _median_ms(once, run.device, run.repeat)
        return {"step_ms": ms, "rtf": round(ms / 1000 / period_s, 3), rate: round(n * 1000 / ms, 1),
                "engine_steps_per_step": await _engine_steps(engine, once)}

    try:
        return await run.over(levels, one)
    finally:
        await engine.stop()


async def _omni_talker(run: Run, cfg: Any) -> dict[str, Any]:
    from pipelines.omni.models import OmniTalkerModule

    tc = cfg.talker_config
    levels = run.levels("omni")
    prompt = int(run.sizes["talker_prompt"])
    t0 = time.perf_counter()
    with _building(run.device, run.dtype):
        talker = OmniTalkerModule(None, slots=max(levels), max_len=_talker_max_len(run), config=cfg, thinker=False)
    build_s = time.perf_counter() - t0
    e, vocab, plain = int(tc.embedding_size), int(tc.vocab_size), _plain_id(tc)
    rng = np.random.default_rng(0)
    code_s = _omni_code_s(cfg)
    levels_out = await _talker_levels(
        run, levels, talker,
        ("talk_prefill", lambda s: {"slot": np.asarray(s, np.int64), "embeds": rng.standard_normal((prompt, e), np.float32) * 0.02,
                                    "text_ids": np.full(prompt, plain, np.int64)}),
        ("talk_step", lambda s: {"slot": np.asarray(s, np.int64), "code": np.asarray(rng.integers(vocab), np.int64),
                                 "reply": rng.standard_normal(e, np.float32) * 0.02}),
        code_s, "codes_per_s")
    return {"parameters": _params(talker.talker), "weights_gib": _weights_gib(talker.talker), "build_s": round(build_s, 1),
            "talker_prompt_positions": prompt, "code_ms": round(code_s * 1000, 3), "talker": levels_out}


def _talker_and_codec(talker: dict[str, Any], codec: dict[str, Any], name: str) -> dict[str, Any]:
    """A voice family's result: its talker's and its codec's, and the summary of both."""
    return {**talker, **codec, "summary": {"talker_sessions_realtime": _largest(talker["talker"], lambda r: r["rtf"] <= 1.0),
                                           f"{name}_rtf": {n: r.get("rtf") for n, r in codec[name]["levels"].items()}}}


def _omni_code_s(cfg: Any) -> float:
    """A Qwen2.5-Omni codec token's audio: the DiT's mel frames a code x BigVGAN's samples a frame, at 24 kHz (20 ms)."""
    t = cfg.token2wav_config
    return int(t.dit_config.repeats) * int(np.prod(t.bigvgan_config.upsample_rates)) / 24000


async def _omni_token2wav(run: Run, cfg: Any) -> dict[str, Any]:
    import torch

    from pipelines.omni import Token2WavArgs
    from pipelines.omni.models import Token2WavModule

    dit = cfg.token2wav_config.dit_config
    ch = _voice_chunking("omni", "token2wav")  # the voice profile's windows, with its ODE settings
    window = ch["left_context_frames"] + ch["chunk_frames"] + ch["lookahead_frames"]
    ode = Token2WavArgs()
    with _building(run.device, torch.float32):  # token2wav runs in float32 (as the reference and the example overlays run it)
        t2w = Token2WavModule(None, config=cfg)
    codec = run.torch_engine(t2w, "token2wav", realtime=True, max_batch=max(run.codec_levels()), as_built=True)
    await codec.start()
    mel_dim, repeats = int(dit.mel_dim), int(dit.repeats)
    rng = np.random.default_rng(1)

    def windows(n: int) -> list[dict[str, np.ndarray]]:
        return [{"codes": rng.integers(int(dit.num_embeds) - 1, size=window).astype(np.int64),
                 "noise": rng.standard_normal((window * repeats, mel_dim), np.float32),
                 "cond": rng.standard_normal(int(dit.enc_emb_dim), np.float32),
                 "ref_mel": rng.standard_normal((sc.OMNI_SPEAKER_MEL_FRAMES, mel_dim), np.float32),
                 "steps": np.asarray(ode.steps), "guidance": np.asarray(ode.guidance, np.float32), "sway": np.asarray(ode.sway, np.float32)}
                for _ in range(n)]

    async def decode(xs: list[Any]) -> None:
        mels = await _gather(codec, xs, "mel")
        await _gather(codec, [{"mel": m} for m in mels], "vocode")

    try:
        levels_out = await _codec(run, codec, windows, decode, ch["chunk_frames"] * _omni_code_s(cfg))
    finally:
        await codec.stop()
    return {"token2wav_parameters": _params(t2w),
            "token2wav": {"window_codes": window, "chunk_codes": ch["chunk_frames"], "ode_steps": ode.steps, "levels": levels_out}}


async def bench_omni3(run: Run) -> dict[str, Any]:
    cfg = sc.transformers_config("omni3", run.config("omni3"))
    talker = await _omni3_talker(run, cfg)
    _free(run.device)
    codec = await _omni3_code2wav(run, cfg)
    return _talker_and_codec(talker, codec, "code2wav")


def _omni3_frame_s(cfg: Any) -> float:
    c2 = cfg.code2wav_config
    return int(np.prod([*c2.upsample_rates, *c2.upsampling_ratios])) / 24000  # 80 ms


async def _omni3_talker(run: Run, cfg: Any) -> dict[str, Any]:
    from pipelines.omni3.models import Omni3TalkerModule

    tc = cfg.talker_config
    levels = run.levels("omni3")
    prompt = int(run.sizes["talker_prompt"])
    t0 = time.perf_counter()
    with _building(run.device, run.dtype):
        talker = Omni3TalkerModule(None, slots=max(levels), max_len=_talker_max_len(run), config=cfg, thinker=False)
        _init_moe(talker.talker, float(tc.text_config.initializer_range))
    build_s = time.perf_counter() - t0
    h, vocab = int(tc.text_config.hidden_size), int(tc.code_predictor_config.vocab_size)
    rng = np.random.default_rng(0)
    frame_s = _omni3_frame_s(cfg)
    levels_out = await _talker_levels(
        run, levels, talker,
        ("prefill", lambda s: {"slot": np.asarray(s, np.int64), "embeds": rng.standard_normal((prompt, h), np.float32) * 0.02,
                               "talker_ids": np.zeros(prompt, np.int64), "seed": np.asarray(s, np.int64)}),
        ("frame", lambda s: {"slot": np.asarray(s, np.int64), "code": np.asarray(rng.integers(vocab), np.int64),
                             "text": rng.standard_normal(h, np.float32) * 0.02, "greedy": np.asarray(False)}),
        frame_s, "frames_per_s")
    return {"parameters": _params(talker.talker), "code_predictor_parameters": _params(talker.talker.code_predictor),
            "weights_gib": _weights_gib(talker.talker), "build_s": round(build_s, 1), "talker_prompt_positions": prompt,
            "frame_ms": round(frame_s * 1000, 3), "code_groups": int(tc.num_code_groups), "talker": levels_out}


async def _omni3_code2wav(run: Run, cfg: Any) -> dict[str, Any]:
    import torch

    from pipelines.omni3.models import Omni3Code2WavModule

    c2 = cfg.code2wav_config
    ch = _voice_chunking("omni3", "omni_code2wav")
    window = ch["left_context_frames"] + ch["chunk_frames"] + ch["lookahead_frames"]
    with _building(run.device, torch.float32):  # code2wav runs in float32
        c2w = Omni3Code2WavModule(None, config=cfg)
    codec = run.torch_engine(c2w, "omni_code2wav", realtime=True, max_batch=max(run.codec_levels()), as_built=True)
    await codec.start()
    rng = np.random.default_rng(1)

    def windows(n: int) -> list[np.ndarray]:
        return [rng.integers(int(c2.codebook_size), size=(window, int(c2.num_quantizers))).astype(np.int64) for _ in range(n)]

    try:
        levels_out = await _codec(run, codec, windows, lambda xs: _gather(codec, xs, None), ch["chunk_frames"] * _omni3_frame_s(cfg))
    finally:
        await codec.stop()
    return {"code2wav_parameters": _params(c2w), "code2wav": {"window_frames": window, "chunk_frames": ch["chunk_frames"], "levels": levels_out}}


def _init_moe(talker: Any, std: float) -> None:
    """transformers leaves the talker's experts and router uninitialised (`torch.empty`):
    drawn here as the other weights are, so routing spreads tokens as a trained router would."""
    import torch

    with torch.no_grad():
        for module in talker.modules():
            if type(module).__name__ in ("Qwen3OmniMoeTalkerTextExperts", "Qwen3OmniMoeTalkerTextTopKRouter"):
                for p in module.parameters(recurse=False):
                    p.normal_(0.0, std)


# ---- the diffusers families ------------------------------------------------------------------------------------


def _pipeline(conf: dict[str, Any], device: Any, dtype: Any) -> Any:
    """The family's diffusers pipeline with random weights: its transformer (in `dtype`)
    and VAE (float32) from their configs, its scheduler; no text encoders."""
    import diffusers

    with _building(device, dtype):
        transformer = getattr(diffusers, conf["transformer"]).from_config(conf["transformer_config"])
    import torch

    with _building(device, torch.float32):
        vae = getattr(diffusers, conf["vae"]).from_config(conf["vae_config"])
    scheduler = getattr(diffusers, conf["scheduler"]).from_config(conf["scheduler_config"])
    parts: dict[str, Any] = {"transformer": transformer, "vae": vae, "scheduler": scheduler, "tokenizer": None, "text_encoder": None}
    if conf["pipeline"] == "FluxPipeline":
        parts.update(text_encoder_2=None, tokenizer_2=None)
    return getattr(diffusers, conf["pipeline"])(**parts)


async def _diffusers_engine(run: Run, family: str, max_rows: int) -> tuple[Any, dict[str, Any]]:
    from omni_rt.engines.diffusers_engine import DiffusersEngine

    conf = run.config(family)
    t0 = time.perf_counter()
    pipe = _pipeline(conf, run.device, run.dtype)
    engine = DiffusersEngine(f"<{family}: built in process>", name=family, max_batch=max_rows, device=str(run.device),
                             dtype=str(run.dtype).removeprefix("torch."), max_sequence_length=int(run.sizes["text_tokens"]), pipeline=pipe)
    await engine.start()
    info = {"parameters": _params(pipe.transformer), "weights_gib": _weights_gib(pipe.transformer), "vae_parameters": _params(pipe.vae),
            "build_s": round(time.perf_counter() - t0, 1)}
    return engine, info


def _decode_one(engine: Any, jobs: list[Any], device: Any) -> dict[str, Any]:
    """The jobs' decode, timed; running out of memory there is reported beside the step's figures."""
    import torch

    t = time.perf_counter()
    try:
        engine._decode(jobs)
        _sync(device)
    except torch.OutOfMemoryError as exc:
        _free(device)
        return {"decode_oom": str(exc).splitlines()[0][:200]}
    return {"decode_ms": round((time.perf_counter() - t) * 1000, 1)}


def _stage_args(run: Run, family: str) -> dict[str, Any]:
    """The stage's processor_args as the server is configured to run it (see STAGE_ARGS)."""
    import yaml

    root = Path(__file__).resolve().parents[1]
    (overlay, pipeline, stage), (spec, name) = STAGE_ARGS[family]
    if run.shapes == "real":
        doc = yaml.safe_load((root / "examples" / "deploy" / overlay).read_text())
        return dict(doc["pipelines"][pipeline]["stages"][stage].get("processor_args") or {})
    doc = yaml.safe_load((root / "pipelines" / spec).read_text())
    for st in doc["profiles"][doc["default_profile"]]["stages"]:
        if st["name"] == name:
            return dict(st.get("processor_args") or {})
    raise KeyError(f"pipelines/{spec}: no stage {name}")


def _prompt(engine: Any, family: str, run: Run) -> str:
    """A prompt whose conditioning (random tensors of the text encoders' shapes) sits in the engine's prompt cache."""
    import torch

    tf = engine.pipe.transformer.config
    n = int(run.sizes["text_tokens"])
    with torch.device(run.device):
        if family == "flux":
            cond: tuple[torch.Tensor, ...] = (torch.randn(n, int(tf.joint_attention_dim), dtype=run.dtype) * 0.1,
                                              torch.randn(int(tf.pooled_projection_dim), dtype=run.dtype) * 0.1)
        else:
            cond = (torch.randn(n, int(tf.text_dim), dtype=run.dtype) * 0.1,)
    engine._prompts["shapes"] = engine._prompts[""] = cond  # the prompt, and the negative prompt of guided rows
    return "shapes"


async def bench_wan(run: Run) -> dict[str, Any]:
    from omni_rt.engines.diffusers_engine import DiffusionJob

    levels = run.levels("wan")
    guidance = float(_stage_args(run, "wan").get("guidance_scale", 1.0))  # > 1: each clip is a guided and an unguided row
    engine, info = await _diffusers_engine(run, "wan", 2 * max(levels))
    prompt = _prompt(engine, "wan", run)
    height, width = run.sizes["video"]
    frames = int(run.sizes["video_frames"])
    ids = iter(range(1, 1 << 30))

    async def one(n: int) -> dict[str, Any]:
        jobs = [DiffusionJob(prompt, height, width, steps=run.repeat + 2, seed=i, frames=frames, guidance_scale=guidance) for i in range(n)]
        for j in jobs:
            j.id = next(ids)
        engine._prepare(jobs)

        async def step() -> None:
            engine._step(jobs)

        ms = await _median_ms(step, run.device, run.repeat)
        out: dict[str, Any] = {"step_ms": ms, "clips_steps_per_s": round(n * 1000 / ms, 3)}
        if n == levels[0]:  # the VAE decodes a clip at a time (a clip's own cost, cold: once a run)
            out.update(_decode_one(engine, jobs[:1], run.device))
        return out

    try:
        result = await run.over(levels, one)
    finally:
        await engine.stop()
    return {**info, "size": f"{width}x{height}", "frames": frames, "guidance_scale": guidance, "levels": result}


async def bench_skyreels(run: Run) -> dict[str, Any]:
    import torch

    from omni_rt.engines.diffusers_engine import DiffusionJob
    from pipelines.forcing import ForcingArgs

    levels = run.levels("skyreels")
    args = ForcingArgs(**_stage_args(run, "skyreels"))
    engine, info = await _diffusers_engine(run, "skyreels", 2 * max(levels))
    prompt = _prompt(engine, "skyreels", run)
    height, width = run.sizes["live_video"]
    chunk, steps = int(run.sizes["live_chunk_frames"]), int(args.default_steps)
    s = int(engine.pipe.vae_scale_factor_spatial)
    channels = int(engine.pipe.transformer.config.in_channels)
    ids = iter(range(1, 1 << 30))
    repeat = min(run.repeat, 2)  # a chunk is every step of it: long enough that two say what five would

    async def one(n: int) -> dict[str, Any]:
        # a live session's chunk after the first (ForcingProcessor.render): `chunk` new frames after
        # the history's `history_latent_frames` clean latent frames, every denoising step, then decoded
        def jobs() -> list[Any]:
            out = [DiffusionJob(prompt, height, width, steps=steps, seed=i, frames=chunk, fps=float(args.fps), guidance_scale=args.guidance_scale,
                                prefix=torch.randn(channels, args.history_latent_frames, height // s, width // s)) for i in range(n)]
            for j in out:
                j.id = next(ids)
            return out

        async def whole() -> None:
            js = jobs()
            engine._prepare(js)
            while any(j.step < j.steps for j in js):
                engine._step(js)
            engine._decode(js)

        ms = await _median_ms(whole, run.device, repeat, warm=1 if n == levels[0] else 0)
        js = jobs()
        engine._prepare(js)
        return {"chunk_ms": ms, "forwards_per_chunk": js[0].steps, "rows_per_forward": sum(j.rows for j in js),
                "fps_per_session": round(chunk * 1000 / ms, 2)}

    try:
        result = await run.over(levels, one)
    finally:
        await engine.stop()
    return {**info, "size": f"{width}x{height}", "chunk_frames": chunk, "history_latent_frames": args.history_latent_frames, "steps": steps,
            "guidance_scale": args.guidance_scale, "video_fps": args.fps, "levels": result,
            "summary": {"sessions_at_video_fps": _largest(result, lambda r: r["fps_per_session"] >= args.fps)}}


async def bench_flux(run: Run) -> dict[str, Any]:
    from omni_rt.engines.diffusers_engine import DiffusionJob

    levels = run.levels("flux")
    engine, info = await _diffusers_engine(run, "flux", max(levels))
    prompt = _prompt(engine, "flux", run)
    size = int(run.sizes["image"])
    ids = iter(range(1, 1 << 30))

    async def one(n: int) -> dict[str, Any]:
        jobs = [DiffusionJob(prompt, size, size, steps=run.repeat + 2, seed=i) for i in range(n)]
        for j in jobs:
            j.id = next(ids)
        engine._prepare(jobs)

        async def step() -> None:
            engine._step(jobs)

        ms = await _median_ms(step, run.device, run.repeat)
        if n == levels[0]:
            _decode_one(engine, jobs[:1], run.device)  # warm (the first decode loads its kernels)
        return {"step_ms": ms, "image_steps_per_s": round(n * 1000 / ms, 3), **_decode_one(engine, jobs, run.device)}

    try:
        result = await run.over(levels, one)
    finally:
        await engine.stop()
    return {**info, "size": f"{size}x{size}", "levels": result}


BENCHES: dict[str, Callable[[Run], Awaitable[dict[str, Any]]]] = {
    "moshi": bench_moshi, "pi0": bench_pi0, "omni": bench_omni, "omni3": bench_omni3, "wan": bench_wan, "skyreels": bench_skyreels, "flux": bench_flux,
}


# ---- the run ------------------------------------------------------------------------------------------------------------


def versions(device: Any) -> dict[str, Any]:
    import diffusers
    import torch
    import transformers

    out: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__, "diffusers": diffusers.__version__,
                           "cuda": torch.version.cuda}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        out["gpu"] = {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "capability": f"{p.major}.{p.minor}",
                      "count": torch.cuda.device_count()}
    return out


MIN_FAMILY_S = 15.0  # a family is not started with less of the budget left
CHILD_GRACE_S = 90.0  # an isolated family's process: its share of the budget, plus imports, the GPU's start and its build


async def run_shapes(shapes: str, device: str, dtype: str, families: list[str], repeat: int, budget_s: float,
                     batches: list[int] | None = None, layers: int | None = None, isolate: bool = False,
                     progress: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Each family in turn (`isolate`: each in its own process, so that a GPU fault or a hang ends
    only that family), each given an equal share of what is left of `budget_s`; `progress(family,
    result so far)` after each."""
    import torch

    dev = torch.device(device)
    dt = getattr(torch, dtype)
    models = None
    if shapes == "tiny":
        from omni_rt.specs import DeployOverlay
        from omni_server.app import models_dir
        from pipelines.tiny import build_tiny

        models = build_tiny(models_dir(DeployOverlay()))
    run = Run(shapes, dev, dt, repeat, budget_s, batches, models, layers)
    out: dict[str, Any] = {}
    vers: dict[str, Any] = {} if isolate else versions(dev)  # (isolated: the children's; the parent leaves the GPU alone)

    def result() -> dict[str, Any]:
        return {"schema": SCHEMA, "created": utc_now(), "machine": machine_info(), "versions": vers,
                "config": {"shapes": shapes, "device": device, "dtype": dtype, "families": families, "repeat": repeat, "budget_s": budget_s,
                           "batches": batches or {f: LEVELS[shapes][f] for f in families}, "sizes": run.sizes, "layers": layers,
                           "isolated": isolate,
                           "timings": "the checkpoints' shapes" if not layers else f"stacks cut to {layers} layers: code paths only, not the checkpoints' timings"},
                "elapsed_s": round(time.monotonic() - run.started, 1), "families": out}

    for i, fam in enumerate(families):
        left = run.started + budget_s - time.monotonic()
        share = max(0.0, left) / (len(families) - i)  # what is left of the budget over the families left
        run.family_deadline = time.monotonic() + share
        t = time.perf_counter()
        if left < MIN_FAMILY_S:
            out[fam] = {"skipped": "time budget"}
        elif isolate:
            child = await _in_child(fam, share, shapes, device, dtype, repeat, batches, layers)
            out[fam] = child.get("families", {}).get(fam) or {"error": child.get("error", "no result")}
            vers = vers or child.get("versions") or {}
        else:
            try:
                out[fam] = {"checkpoint": sc.CHECKPOINTS[fam] if shapes == "real" else f"tiny:{sc.TINY[fam]}", **await BENCHES[fam](run)}
            except Exception as exc:  # noqa: BLE001 - one family's failure is reported; the others still run
                out[fam] = _failure(exc, fam)
            _free(dev)
        out[fam]["seconds"] = round(time.perf_counter() - t, 1)
        if progress is not None:
            progress(fam, result())
    return result()


async def _in_child(fam: str, share: float, shapes: str, device: str, dtype: str, repeat: int, batches: list[int] | None,
                    layers: int | None) -> dict[str, Any]:
    """One family in a process of its own (its output goes to this one's), killed past its share and a grace."""
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "family.json"
        cmd = [sys.executable, "-m", "latency_bench", "shapes", "--shapes", shapes, "--device", device, "--dtype", dtype, "--families", fam,
               "--repeat", str(repeat), "--budget-s", f"{share:.1f}", "--json", str(path)]
        cmd += ["--batches", ",".join(map(str, batches))] if batches else []
        cmd += ["--layers", str(layers)] if layers else []
        proc = await asyncio.create_subprocess_exec(*cmd)
        limit = share + CHILD_GRACE_S
        try:
            rc = await asyncio.wait_for(proc.wait(), limit)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            return {"error": f"killed: still running {limit:.0f} s after it started (its share {share:.0f} s + {CHILD_GRACE_S:.0f} s)"}
        if not path.is_file():
            return {"error": f"its process ended with status {rc} and no result"}
        data: dict[str, Any] = json.loads(path.read_text())
        return data


def _cell(x: dict[str, Any], key: str) -> Any:
    """A level's figure, or what stopped it."""
    return x.get(key, "skipped" if "skipped" in x else "oom" if "oom" in x else "error")


def errors(result: dict[str, Any]) -> list[str]:
    """Every family and level that failed (other than running out of memory or time)."""
    out = []
    for fam, r in result["families"].items():
        if "error" in r:
            out.append(f"{fam}: {r['error']}")
        for where, levels in _all_levels(r):
            out += [f"{fam} {where} {n}: {x['error']}" for n, x in levels.items() if "error" in x]
    return out


def _all_levels(r: dict[str, Any]) -> list[tuple[str, dict[str, dict[str, Any]]]]:
    found = [("batch", r["levels"])] if "levels" in r else []
    found += [(f"views={v} robots", lv) for v, lv in (r.get("views") or {}).items()]
    found += [("talker sessions", r["talker"])] if "talker" in r else []
    found += [(f"{k} windows", r[k]["levels"]) for k in ("token2wav", "code2wav") if k in r]
    return found


def _line(fam: str, r: dict[str, Any]) -> str:
    if "skipped" in r or "oom" in r or "error" in r:
        return f"{fam:>9}: {r.get('skipped') or ('out of memory: ' + str(r['oom']) if 'oom' in r else 'error: ' + str(r.get('error')))}"
    s = r.get("summary") or {}
    if fam == "moshi":
        steps = {n: _cell(x, "step_ms_full_window") for n, x in r["levels"].items()}
        return f"{fam:>9}: step ms (full window) by sessions {steps}; within the frame {s['sessions_within_frame']}"
    if fam == "pi0":
        chunks = {v: {n: _cell(x, "chunk_ms") for n, x in lv.items()} for v, lv in r["views"].items()}
        return f"{fam:>9}: chunk ms by views and robots {chunks}; within {ROBOT_BUDGET_MS:g} ms {s['robots_within_budget']}"
    if fam in ("omni", "omni3"):
        tk = {n: _cell(x, "rtf") for n, x in r["talker"].items()}
        codec = r.get("token2wav") or r.get("code2wav") or {}
        cd = {n: _cell(x, "rtf") for n, x in codec.get("levels", {}).items()}
        return f"{fam:>9}: talker RTF by sessions {tk}; codec RTF by windows {cd}"
    key = {"wan": "step_ms", "flux": "step_ms", "skyreels": "fps_per_session"}[fam]
    vals = {n: _cell(x, key) for n, x in r["levels"].items()}
    return f"{fam:>9}: {key} by batch {vals}"


def main_shapes(args: Any) -> int:
    import torch

    families = [f.strip() for f in str(args.families).split(",") if f.strip()] if args.families else list(sc.FAMILIES)
    unknown = [f for f in families if f not in sc.FAMILIES]
    if unknown:
        print(f"error: unknown families {unknown}; known: {', '.join(sc.FAMILIES)}")
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    batches = [int(x) for x in str(args.batches).split(",") if x.strip()] if args.batches else None
    if batches is not None and (not batches or min(batches) < 1):
        print("error: --batches are positive integers")
        return 2
    if args.repeat < 1 or args.budget_s <= 0:
        print("error: --repeat must be >= 1 and --budget-s > 0")
        return 2
    if args.layers is not None and args.layers < 1:
        print("error: --layers must be >= 1")
        return 2
    print(f"shapes={args.shapes} device={device} dtype={dtype} families={','.join(families)} budget {args.budget_s:g} s", flush=True)

    def progress(fam: str, so_far: dict[str, Any]) -> None:  # a line, and the JSON so far, as each family ends
        print(_line(fam, so_far["families"][fam]), flush=True)
        write_json(args.json, so_far)

    result = asyncio.run(run_shapes(args.shapes, device, dtype, families, args.repeat, float(args.budget_s), batches, args.layers,
                                    isolate=bool(args.isolate), progress=progress))
    v = result["versions"]
    print(f"{(v.get('gpu') or {}).get('name', 'cpu')}: torch {v.get('torch')} transformers {v.get('transformers')} "
          f"diffusers {v.get('diffusers')}; {result['elapsed_s']} s")
    finish(args.json, result)
    failed = errors(result)
    for e in failed:
        print(f"error: {e}")
    return 1 if failed else 0
