"""OpenTelemetry tracing (the OTel SDK and its OTLP/HTTP exporter), off by default.

On when the deploy key `server.tracing.exporter` names an exporter (`otlp`, `console`),
or when it is unset and the standard `OTEL_TRACES_EXPORTER` variable names one; the
OTLP endpoint is `server.tracing.endpoint`, else the standard
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT` (the exporter's
own default: http://localhost:4318/v1/traces); the service name `OTEL_SERVICE_NAME`,
else `omni-rt`.

Spans: `session` (a session's life: its id, kind, pipeline and principal), as the child
of the W3C `traceparent` the HTTP request or WebSocket upgrade carried; `request
{pipeline}` per turn / response / call under its session, with events `first_token` (the
thinker's first output), `first_audio` (a speech stage's) and `first_output` (any other
final stage's); `stage {name}` per stage of it (thinker, talker, code2wav, a DiT, a
policy), with the replica it ran on and its error when it failed.

One SDK `TracerProvider` per process, made the global one the first time tracing is
turned on; each server adds its exporter through `Exporters`, a processor that fans out
to the exporters of the servers running now (a stopped server's exporter is flushed and
removed: tests start many servers in one process).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract

log = logging.getLogger("omni_rt.tracing")

TRACER_NAME = "omni_rt"
EXPORTERS = ("otlp", "console")


class Exporters:
    """A span processor over the processors of the running servers (added and removed
    as they start and stop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.processors: list[Any] = []

    def add(self, p: Any) -> None:
        with self._lock:
            self.processors.append(p)

    def remove(self, p: Any) -> None:
        with self._lock:
            if p in self.processors:
                self.processors.remove(p)
        p.shutdown()

    def _each(self) -> list[Any]:
        with self._lock:
            return list(self.processors)

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        for p in self._each():
            p.on_start(span, parent_context=parent_context)

    def _on_ending(self, span: Any) -> None:
        for p in self._each():
            hook = getattr(p, "_on_ending", None)
            if hook is not None:
                hook(span)

    def on_end(self, span: Any) -> None:
        for p in self._each():
            p.on_end(span)

    def shutdown(self) -> None:
        for p in self._each():
            p.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return all(p.force_flush(timeout_millis) for p in self._each())


_EXPORTERS = Exporters()
_provider: Any = None
_on = 0  # servers with tracing on in this process


def _ensure_provider() -> None:
    global _provider
    if _provider is not None:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or "omni-rt"})
    _provider = TracerProvider(resource=resource)
    _provider.add_span_processor(_EXPORTERS)
    trace.set_tracer_provider(_provider)


def exporter_of(configured: str | None) -> str | None:
    """The exporter a server runs: its deploy key, else `OTEL_TRACES_EXPORTER` (a comma
    list: the first this server knows; others are named in the log); None: off."""
    if configured is not None:
        return None if configured == "none" else configured
    names = [n.strip().lower() for n in (os.environ.get("OTEL_TRACES_EXPORTER") or "").split(",") if n.strip()]
    known = [n for n in names if n in EXPORTERS]
    unknown = [n for n in names if n not in EXPORTERS and n != "none"]
    if unknown:
        log.warning("OTEL_TRACES_EXPORTER names %s, which this server does not run (it runs %s)", unknown, ", ".join(EXPORTERS))
    return known[0] if known else None


def start(exporter: str | None, endpoint: str | None = None) -> Any:
    """Turn tracing on for one server (None: it stays off). Returns the processor to
    hand to `stop`."""
    global _on
    if exporter is None:
        return None
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    _ensure_provider()
    if exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exp: Any = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
    else:
        exp = ConsoleSpanExporter()
    processor = BatchSpanProcessor(exp, schedule_delay_millis=500)
    _EXPORTERS.add(processor)
    _on += 1
    log.info("tracing on: %s exporter%s", exporter, f" to {endpoint}" if endpoint else "")
    return processor


def add_processor(processor: Any) -> None:
    """A processor of the caller's own (tests: the SDK's in-memory exporter)."""
    global _on
    _ensure_provider()
    _EXPORTERS.add(processor)
    _on += 1


def stop(processor: Any) -> None:
    """Flush and remove a server's exporter."""
    global _on
    if processor is None:
        return
    try:
        processor.force_flush(5000)
    finally:
        _EXPORTERS.remove(processor)
        _on = max(0, _on - 1)


def on() -> bool:
    return _on > 0


def tracer() -> Any:
    # this module's provider (another one may be the process's global: ours still exports)
    return _provider.get_tracer(TRACER_NAME) if _provider is not None else trace.get_tracer(TRACER_NAME)


def span(name: str, parent: Any = None, **attributes: Any) -> Any:
    """A started span (a no-op one while tracing is off), child of `parent` (a span)
    or of the current context."""
    if not on():
        return trace.INVALID_SPAN
    ctx = trace.set_span_in_context(parent) if parent is not None else None
    return tracer().start_span(name, context=ctx, attributes={k: v for k, v in attributes.items() if v is not None})


def end(s: Any, error: BaseException | None = None) -> None:
    if s is None or s is trace.INVALID_SPAN:
        return
    if error is not None:
        s.set_status(trace.Status(trace.StatusCode.ERROR, str(error)[:200]))
        s.record_exception(error)
    s.end()


@contextmanager
def remote_parent(headers: Any) -> Iterator[None]:
    """The W3C trace context a request carried (`traceparent`), current for its handler."""
    if not on() or "traceparent" not in headers:
        yield
        return
    token = otel_context.attach(extract(headers))
    try:
        yield
    finally:
        otel_context.detach(token)
