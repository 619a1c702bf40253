"""What every stage engine offers the stage workers and StagePool, and the contracts
processors program against.

`Engine` is the lifecycle and load/health part every engine shares. What a processor
calls is one of three contracts, written as `typing.Protocol`s so that a processor
states which one it needs (`StageProcessor.engine_as`) and a fake engine in tests is
checked against the same contract as the real one:

- `ArEngine`: autoregressive generation (vLLM; `omni_rt.engines.fake` scripts it), streamed
  token deltas, abort.
- `StepEngine`: a batched step loop over a torch module (`TorchEngine`).
- `DiffusionEngine`: a denoising loop with step-level batching (`DiffusersEngine`).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol, runtime_checkable

from omni_rt.errors import ContextLengthExceeded, EngineDead, EngineError, EngineRequestError

__all__ = ["ArEngine", "DiffusionEngine", "Engine", "EngineDead", "EngineError", "EngineRequestError", "StepEngine"]


class Engine(abc.ABC):
    """One engine per stage replica. Engines never block the event loop."""

    name: str = "engine"
    # Why the engine is gone (None while it is usable). Set by `mark_dead`; a dead
    # engine's replica takes no new work and `/health` reports it.
    dead: str | None = None
    # The longest prompt + output the engine takes (AR engines; None: no limit).
    max_model_len: int | None = None

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Load weights / spawn processes. Called once before use."""

    async def stop(self) -> None:  # noqa: B027 - optional hook
        """Free everything. Called once at shutdown."""

    @abc.abstractmethod
    def load(self) -> int:
        """Requests currently queued or running (least-queue routing, metrics, tests)."""

    def queue_depth(self) -> int | None:
        """Work items waiting to run (not yet started); None where the engine does not say."""
        return None

    @property
    def alive(self) -> bool:
        return self.dead is None

    def mark_dead(self, reason: str) -> EngineDead:
        """Record that the engine is gone; returns the error its callers get."""
        if self.dead is None:
            self.dead = reason
        return EngineDead(f"engine {self.name} is not available ({self.dead}); retry later")

    def require_alive(self) -> None:
        """Refuse new work on a dead engine (EngineDead: 503, retry later)."""
        if self.dead is not None:
            raise self.mark_dead(self.dead)

    def check_prompt_length(self, tokens: int) -> None:
        """Refuse a prompt that leaves no room for one output token: the caller's
        error (400 context_length_exceeded), not the engine's."""
        if self.max_model_len is not None and tokens >= self.max_model_len:
            raise ContextLengthExceeded(tokens, self.max_model_len)

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": self.alive, "load": self.load()}
        if self.dead is not None:
            out["dead"] = self.dead
        return out


@runtime_checkable
class ArEngine(Protocol):
    """Autoregressive generation: an async generator of the new token ids of each
    engine step, until max_tokens, a stop token or `abort`. A consumer that stops
    iterating aborts the request inside the engine."""

    name: str

    def generate(
        self,
        request_id: str,
        *,
        prompt_token_ids: list[int] | None = None,
        prompt_embeds: Any = None,
        encoder_audio: tuple[Any, int] | None = None,
        multi_modal_data: Mapping[str, Any] | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
        sampling: dict[str, Any],
    ) -> AsyncIterator[list[int]]: ...

    async def abort(self, request_id: str) -> None: ...


@runtime_checkable
class StepEngine(Protocol):
    """A batched step loop: `run` one item (an array, or named arrays for a module
    method `op`) and get its slice of the batched result; `deadline` (time.monotonic)
    orders the queue, earliest first."""

    name: str

    async def run(self, x: Any, priority: int = 1, op: str | None = None, deadline: float | None = None) -> Any: ...


@runtime_checkable
class DiffusionEngine(Protocol):
    """Denoising with step-level batching: `generate(job)` yields progress, previews
    and finally the image; leaving the iteration cancels the job between steps."""

    name: str

    def generate(self, job: Any) -> AsyncIterator[dict[str, Any]]: ...

    def prompt_tokens(self, prompt: str) -> int: ...

    @property
    def size_multiple(self) -> int: ...
