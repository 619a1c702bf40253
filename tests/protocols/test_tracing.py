"""OpenTelemetry tracing in-process: the spans a voice turn and a speech call make
(session → request → stages, first-token / first-audio events, the W3C traceparent of
the upgrade or request as the parent), caught by the SDK's in-memory exporter; and the
same exported over OTLP/HTTP to a receiver the test runs (decoded with the OTLP
protobuf definitions), as a collector would get them."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from omni_rt import tracing
from testkit import serve
from testkit.wire import connect

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


@pytest.fixture
def spans():
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    processor = SimpleSpanProcessor(exporter)
    tracing.add_processor(processor)
    try:
        yield exporter
    finally:
        tracing.stop(processor)


async def test_a_voice_turn_is_one_trace_from_the_upgrade_through_the_stages(spans):
    async with serve(["voice"]) as h:
        ws = await connect(h, "/v1/realtime?model=gpt-realtime", headers={"traceparent": TRACEPARENT})
        await ws.until("session.created")
        await ws.send("session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        await ws.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]})
        await ws.send("response.create", response={"max_output_tokens": 4})
        await ws.until("response.done")
        sid = next(e["session"]["id"] for e in ws.seen if e["type"] == "session.created")
        await ws.ws.close()
        await h.sessions.close(sid)
    got = {s.name: s for s in spans.get_finished_spans()}
    session, request = got["session"], got["request voice"]
    assert f"{session.context.trace_id:032x}" == TRACE_ID  # the client's trace continues here
    assert session.parent is not None and f"{session.parent.span_id:016x}" == "00f067aa0ba902b7"
    assert session.attributes["omni_rt.session.id"] == sid and session.attributes["omni_rt.session.kind"] == "realtime"
    assert session.attributes["omni_rt.pipeline"] == "voice" and session.attributes["omni_rt.principal"]
    assert request.parent.span_id == session.context.span_id and request.attributes["omni_rt.request.status"] == "completed"
    stages = [s for s in spans.get_finished_spans() if s.name.startswith("stage ")]
    assert {s.name for s in stages} >= {"stage thinker", "stage talker", "stage code2wav"}
    assert all(s.parent.span_id == request.context.span_id for s in stages)
    events = [e.name for e in request.events]
    assert "first_token" in events and "first_audio" in events
    assert events.index("first_token") < events.index("first_audio")
    done = next(e for e in ws.seen if e["type"] == "response.done")
    assert request.attributes["omni_rt.usage.output_tokens"] == done["response"]["usage"]["output_tokens"]


class _Receiver(BaseHTTPRequestHandler):
    """OTLP/HTTP's traces endpoint: protobuf ExportTraceServiceRequest bodies."""

    got: list[Any] = []

    def do_POST(self) -> None:  # noqa: N802 - the handler's name
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        body = self.rfile.read(int(self.headers["content-length"]))
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        type(self).got.append((self.path, self.headers.get("content-type"), req))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


async def test_spans_reach_a_real_otlp_http_receiver():
    _Receiver.got = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    try:
        async with serve(["tts"], {"server": {"tracing": {"exporter": "otlp", "endpoint": endpoint}}}) as h:
            r = await h.client.post("/v1/audio/speech", json={"model": "tts", "voice": "tara", "input": "Hello.", "response_format": "pcm"},
                                    headers={"traceparent": TRACEPARENT})
            assert r.status == 200
            await r.read()
        # the server's stop flushed its exporter
    finally:
        server.shutdown()
    assert _Receiver.got, "nothing was exported"
    names: dict[str, Any] = {}
    for path, ctype, req in _Receiver.got:
        assert path == "/v1/traces" and ctype == "application/x-protobuf"
        for rs in req.resource_spans:
            service = {a.key: a.value.string_value for a in rs.resource.attributes}.get("service.name")
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    names[sp.name] = (service, sp)
    assert {"session", "request tts", "stage talker", "stage code2wav"} <= set(names), sorted(names)
    service, session = names["session"]
    assert service == "omni-rt" and session.trace_id.hex() == TRACE_ID
    attrs = {a.key: a.value.string_value for a in session.attributes}
    assert attrs["omni_rt.session.kind"] == "oneshot" and attrs["omni_rt.pipeline"] == "tts"
    assert any(e.name == "first_audio" for e in names["request tts"][1].events)
