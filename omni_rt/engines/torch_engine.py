"""Torch generation engine: a batched step loop over an `nn.Module`.

Requests submit one item each (an array without the batch dimension, or a dict of
them for a module method with several inputs: `op` names the method) with the time
its result is due: earliest deadline first. A streaming decoder gives each chunk the
moment its stream's playback runs dry, and a stream's first chunk the moment it was
ready plus a bounded budget, so a chunk about to leave a listener in silence runs
before one whose listener still has a second of audio buffered, and a new stream's
first chunk waits only behind chunks due sooner. An item without a deadline is due
`priority × default_slack_ms` after it was queued (priority 0: at once). The loop
takes whatever is queued, most urgent first (up to `max_batch`, waiting at most
`max_wait_ms` for more once the first item is there), stacks items of the same op,
shapes and dtypes into one batch,
runs the module on a dedicated thread (never on the event loop), and hands each
request its slice of the result. New requests join at the next step: continuous
batching across concurrent streams.

Arrays are numpy arrays or torch tensors, and what goes in comes out: an item of numpy
arrays gets numpy back (host memory; half-precision results as float32, which numpy
and the connectors take), an item holding a torch tensor gets tensors back, left on
the engine's device in the module's dtype. A multi-step request (a denoising loop, a KV cache it
keeps) therefore pays one host -> device copy when it starts and one device -> host
copy when it ends, not one per step; items that are consecutive rows of one earlier
batch output are passed on as that batch without being copied again.

Dtypes (`omni_rt.dtypes`): `dtype` (the overlay's engine_args) casts the whole module;
without it the module keeps the dtypes it was built in (each sub-model its
checkpoint's). A `realtime` stage on a CPU computes in float32 whatever it was asked.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omni_rt import metrics
from omni_rt.dtypes import module_dtypes, parse_dtype, realtime_dtype, to_host
from omni_rt.engines.base import Engine, EngineError, EngineRequestError

log = logging.getLogger("omni_rt.engines.torch")


@dataclass(order=True)
class _Item:
    due: float  # time.monotonic() by which the result is needed (earliest first)
    seq: int
    x: Any = field(compare=False)  # an array, or named arrays for a module method (`op`)
    future: asyncio.Future[Any] = field(compare=False)
    op: str | None = field(default=None, compare=False)

    def signature(self) -> tuple[Any, ...]:
        if isinstance(self.x, dict):
            return (self.op, tuple((k, *_sig(v)) for k, v in sorted(self.x.items())))
        return (self.op, *_sig(self.x))

    def on_device(self) -> bool:
        """Whether the caller handed tensors (and so gets tensors back, not numpy)."""
        if isinstance(self.x, dict):
            return any(isinstance(v, torch.Tensor) for v in self.x.values())
        return isinstance(self.x, torch.Tensor)


def _sig(v: Any) -> tuple[Any, ...]:
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), str(v.dtype), str(v.device))
    return ("numpy", v.shape, v.dtype.str)


def _stack(vals: list[Any], device: torch.device) -> torch.Tensor:
    """One batch tensor on `device` from per-item arrays. Tensors that are exactly the
    consecutive rows of one earlier batch output, in order, are read in place."""
    if not isinstance(vals[0], torch.Tensor):
        return torch.from_numpy(np.stack(vals)).to(device)
    v0 = vals[0]
    if v0.device == device and v0.is_contiguous():
        row = v0.numel() * v0.element_size()
        base = v0.untyped_storage().data_ptr()
        if all(
            v.shape == v0.shape and v.dtype == v0.dtype and v.is_contiguous()
            and v.untyped_storage().data_ptr() == base and v.data_ptr() == v0.data_ptr() + i * row
            for i, v in enumerate(vals)
        ):
            return torch.as_strided(v0, (len(vals), *v0.shape), (v0.numel(), *v0.stride()), v0.storage_offset())
    return torch.stack(vals).to(device)


class TorchEngine(Engine):
    def __init__(
        self,
        module_factory: Callable[[], torch.nn.Module],
        *,
        name: str = "torch",
        max_batch: int = 32,
        max_wait_ms: float = 2.0,
        threads: int | None = None,
        device: str = "cpu",
        dtype: str | None = None,
        default_slack_ms: float = 250.0,
        realtime: bool = False,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.name = name
        self._factory = module_factory
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000.0
        self.default_slack = default_slack_ms / 1000.0
        self.threads = threads
        self.device = torch.device(device)
        self.dtype = parse_dtype(dtype)
        self.realtime = realtime  # keeps pace with playback / a frame clock: float32 on a CPU
        self.module: torch.nn.Module | None = None
        self._queue: asyncio.PriorityQueue[_Item] | None = None
        self._seq = itertools.count()
        self._loop_task: asyncio.Task[None] | None = None
        # One thread: the module runs serially, batches are the unit of parallelism.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"torch-{name}")
        self._running = 0
        self.steps = 0
        self.items = 0
        self.late = 0  # items that started after they were due

    async def start(self) -> None:
        loop = asyncio.get_running_loop()

        def _load() -> torch.nn.Module:
            if self.threads is not None:
                torch.set_num_threads(self.threads)
            m = self._factory()
            m.to(self.device).eval()
            dtype = realtime_dtype(self.name, self.device, self.dtype, module_dtypes(m)) if self.realtime else self.dtype
            if dtype is not None:
                m.to(dtype)
            self.dtype = dtype
            return m

        self.module = await loop.run_in_executor(self._executor, _load)
        self._queue = asyncio.PriorityQueue()
        self._loop_task = loop.create_task(self._step_loop(), name=f"torch-engine-{self.name}")
        self._loop_task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        """The step loop never returns: if it ended by itself, the engine is dead."""
        if not task.cancelled() and task.exception() is not None:
            log.error("engine %s: the step loop died", self.name, exc_info=task.exception())
            self.mark_dead(f"step loop died: {type(task.exception()).__name__}")

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None
        if self._queue is not None:
            while not self._queue.empty():
                item = self._queue.get_nowait()
                if not item.future.done():
                    item.future.set_exception(EngineError(f"engine {self.name} stopped"))
        self._executor.shutdown(wait=True, cancel_futures=True)

    def load(self) -> int:
        return (self._queue.qsize() if self._queue is not None else 0) + self._running

    def queue_depth(self) -> int:
        return self._queue.qsize() if self._queue is not None else 0

    async def run(self, x: Any, priority: int = 1, op: str | None = None, deadline: float | None = None) -> Any:
        """Run one item through the module (batched with concurrent callers).

        `x` is an array (the module is called on the stacked batch) or a dict of arrays
        (`module.<op>(**stacked)` is called; `op` None means `forward`). The result is
        the item's slice of the module's output: an array, or a dict of arrays when the
        module returns a dict. `deadline` (on `time.monotonic()`) is when the result
        is due; items run earliest-due first, equal ones in arrival order. Without one
        the item is due `priority × default_slack_ms` from now. Cancelling the awaiting
        task drops the item if it has not started yet.
        """
        self.require_alive()
        if self._queue is None or self._loop_task is None or self._loop_task.done():
            raise EngineError(f"engine {self.name} is not running")
        if not isinstance(x, (np.ndarray, torch.Tensor, dict)):
            raise EngineRequestError(f"engine {self.name} takes an array or a dict of arrays, not {type(x).__name__}")
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        due = deadline if deadline is not None else time.monotonic() + priority * self.default_slack
        self._queue.put_nowait(_Item(due, next(self._seq), x, fut, op))
        return await fut

    async def _step_loop(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            # Let the callers of the last batch run first: each computes its next item
            # (the next chunk, the next denoising step) and queues it, so streams that
            # are in flight together stay in the same batch instead of alternating.
            await asyncio.sleep(0)
            first = await self._queue.get()
            batch = [first]
            deadline = time.monotonic() + self.max_wait
            while len(batch) < self.max_batch:
                try:
                    batch.append(self._queue.get_nowait())
                    continue
                except asyncio.QueueEmpty:
                    pass
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), remaining))
                except asyncio.TimeoutError:
                    break
            live = [it for it in batch if not it.future.done()]  # cancelled callers drop out
            groups: dict[tuple[Any, ...], list[_Item]] = {}
            for it in live:
                groups.setdefault(it.signature(), []).append(it)
            # most urgent group first (items arrive sorted, so a group's first is its best)
            for items in sorted(groups.values(), key=lambda g: g[0]):
                self._running = len(items)
                started = time.monotonic()
                late = sum(1 for it in items if it.due < started)
                if late:
                    self.late += late
                    metrics.ENGINE_LATE.labels(engine=self.name).inc(late)
                try:
                    out = await loop.run_in_executor(
                        self._executor, self._forward, items[0].op, [it.x for it in items], items[0].on_device()
                    )
                except Exception as exc:  # noqa: BLE001 - reported to every caller of the batch
                    log.exception("engine %s step failed", self.name)
                    for it in items:
                        if not it.future.done():
                            it.future.set_exception(EngineError(f"engine {self.name} failed: {exc}"))
                    continue
                finally:
                    self._running = 0
                self.steps += 1
                self.items += len(items)
                metrics.ENGINE_BATCH.labels(engine=self.name).observe(len(items))
                metrics.ENGINE_STEP_SECONDS.labels(engine=self.name).observe(time.monotonic() - started)
                for it, y in zip(items, out, strict=False):
                    if not it.future.done():
                        it.future.set_result(y)
                for it in items[len(out) :]:  # the module returned fewer rows than it got
                    if not it.future.done():
                        it.future.set_exception(EngineError(f"engine {self.name} returned {len(out)} rows for {len(items)} items"))

    def _forward(self, op: str | None, xs: list[Any], on_device: bool) -> list[Any]:
        assert self.module is not None
        fn = self.module if op is None else getattr(self.module, op)
        with torch.inference_mode():
            if isinstance(xs[0], dict):
                y = fn(**{k: _stack([x[k] for x in xs], self.device) for k in xs[0]})
            else:
                y = fn(_stack(xs, self.device))
            if isinstance(y, dict):
                outs = {k: v.detach() if on_device else to_host(v) for k, v in y.items()}
                return [{k: v[i] for k, v in outs.items()} for i in range(len(xs))]
            out = y.detach() if on_device else to_host(y)
        return [out[i] for i in range(len(xs))]
