"""The vLLM engine's token-range logits processor: a request may restrict sampling to
``[lo, hi)`` ranges of the vocabulary (``sampling["allowed_token_ranges"]``, shipped
to the engine processes in ``SamplingParams.extra_args``), which vLLM applies in its
worker through this processor (registered by `omni_rt.engines.vllm.VllmEngine` under
`TOKEN_RANGE_PROCESSOR`). Why not ``allowed_token_ids``: see
`_token_range_processor_class`.
"""

from __future__ import annotations

import functools
from typing import Any

from omni_rt.engines.base import EngineError, EngineRequestError

ALLOWED_TOKEN_RANGES = "allowed_token_ranges"


def check_ranges(ranges: Any, vocab_size: int | None = None) -> list[list[int]]:
    """Validate ``[[lo, hi), ...]`` (ints, lo < hi, inside the vocabulary)."""
    try:
        out = [[int(lo), int(hi)] for lo, hi in ranges]
    except (TypeError, ValueError) as e:
        raise EngineRequestError(f"{ALLOWED_TOKEN_RANGES} must be a list of [lo, hi) pairs: {e}") from e
    if not out:
        raise EngineRequestError(f"{ALLOWED_TOKEN_RANGES} is empty")
    for lo, hi in out:
        if not 0 <= lo < hi or (vocab_size is not None and hi > vocab_size):
            raise EngineRequestError(f"{ALLOWED_TOKEN_RANGES}: bad range [{lo}, {hi}) for vocabulary {vocab_size}")
    return out


@functools.cache
def _token_range_processor_class() -> type:
    """Build the vLLM logits processor class (vllm is imported only when needed).

    Why not SamplingParams.allowed_token_ids: with Orpheus's 28,672 audio tokens it
    costs ~28 ms per request at admission on a CPU box (measured): SamplingParams.clone
    deep-copies the list (~9 ms, on the event loop) and the worker fills its mask with
    ``mask[row][list_of_ids] = False`` (~18 ms, stalling every running stream); 32
    requests admitted together took TTFT from ~85 ms to ~280-650 ms. A range is O(1)
    to ship and a few slice fills to apply.
    """
    import torch
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    def ranges_of(params: Any, _prompt: Any = None, _out: Any = None) -> tuple[tuple[int, int], ...] | None:
        extra = params.extra_args or {}
        ranges = extra.get(ALLOWED_TOKEN_RANGES)
        return None if ranges is None else tuple((int(lo), int(hi)) for lo, hi in ranges)

    class TokenRangeLogitsProcessor(LogitsProcessor):
        """Masks every token outside ``extra_args["allowed_token_ranges"]`` (``[lo, hi)`` pairs)."""

        def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
            self.vocab_size = vllm_config.model_config.get_vocab_size()
            max_rows = vllm_config.scheduler_config.max_num_seqs
            self.ranges: dict[int, tuple[tuple[int, int], ...]] = {}
            # True = masked. Rebuilt on CPU when the batch changes, then copied over.
            self.mask_cpu = torch.zeros((max_rows, self.vocab_size), dtype=torch.bool)
            self.mask = (
                self.mask_cpu
                if torch.device(device).type == "cpu"
                else torch.zeros((max_rows, self.vocab_size), dtype=torch.bool, device=device)
            )
            self.rows = 0

        @classmethod
        def validate_params(cls, sampling_params: Any) -> None:
            extra = sampling_params.extra_args or {}
            if ALLOWED_TOKEN_RANGES in extra:
                try:
                    check_ranges(extra[ALLOWED_TOKEN_RANGES])
                except EngineError as e:
                    raise ValueError(str(e)) from e  # vLLM turns it into a validation error

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            if not process_dict_updates(self.ranges, batch_update, ranges_of):
                return
            rows = max(self.ranges) + 1 if self.ranges else 0
            self.mask_cpu[: max(rows, self.rows)].fill_(False)
            for index, ranges in self.ranges.items():
                row = self.mask_cpu[index]
                row.fill_(True)
                for lo, hi in ranges:
                    row[lo:hi] = False
            if self.mask is not self.mask_cpu and rows:
                self.mask[:rows].copy_(self.mask_cpu[:rows], non_blocking=True)
            self.rows = rows

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            if not self.ranges:
                return logits
            n = min(self.rows, logits.shape[0])
            logits[:n].masked_fill_(self.mask[:n, : logits.shape[1]], float("-inf"))
            return logits

    TokenRangeLogitsProcessor.__module__ = __name__
    TokenRangeLogitsProcessor.__qualname__ = "TokenRangeLogitsProcessor"
    return TokenRangeLogitsProcessor


def __getattr__(name: str) -> Any:
    # PEP 562: vLLM loads "omni_rt.engines.vllm_token_ranges:TokenRangeLogitsProcessor"
    # by getattr, in every engine process; building it lazily keeps importing this
    # module (and omni_rt.engines.vllm) free of the vllm import.
    if name == "TokenRangeLogitsProcessor":
        return _token_range_processor_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
