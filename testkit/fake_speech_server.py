"""A tiny fake speech server for the tests of clients.tts and latency_bench.

It streams PCM in small chunks with short sleeps and records how many requests it is
serving at once. It runs in a thread for most tests; the --compare tests start it as
a subprocess (``python testkit/fake_speech_server.py --port P --deploy FILE``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from aiohttp import web

RATE = 24000
CHUNK_SAMPLES = 2400  # 0.1 s per chunk
N_CHUNKS = 4  # 0.4 s of audio per request
AUDIO_S = N_CHUNKS * CHUNK_SAMPLES / RATE


# -- the fake server ------------------------------------------------------------------


class FakeState:
    def __init__(self, first_delay: float = 0.01, chunk_delay: float = 0.01) -> None:
        self.first_delay = first_delay
        self.chunk_delay = chunk_delay
        self.reset()

    def reset(self) -> None:
        self.current = 0
        self.max_current = 0
        self.served = 0
        self.failed = 0
        self.bodies: list[dict] = []


def pcm_chunk(i: int) -> bytes:
    return struct.pack("<h", i % 1000) * CHUNK_SAMPLES


def _wav_header() -> bytes:
    # Streaming WAV: sizes unknown, so 0xFFFFFFFF as many servers do.
    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE" + b"fmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, RATE, RATE * 2, 2, 16)
            + b"data" + struct.pack("<I", 0xFFFFFFFF))


def _error(status: int, message: str, code: str, param: str | None = None) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}},
        status=status,
    )


def make_app(state: FakeState) -> web.Application:
    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def speech(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        state.bodies.append(body)
        text = body.get("input", "")
        n = len(state.bodies)
        if text.startswith("FAIL_ALWAYS") or (text.startswith("FAIL_EVERY_3") and n % 3 == 0):
            state.failed += 1
            return _error(400, "input rejected by fake server", "bad_input", "input")
        if text.startswith("JSON200"):
            return web.json_response({"error": {"message": "not audio", "type": "server_error"}})
        fmt = body.get("response_format", "pcm")
        sse = body.get("stream_format") == "sse"
        state.current += 1
        state.max_current = max(state.max_current, state.current)

        async def gen():
            try:
                if fmt == "wav" and not sse:
                    yield _wav_header()  # header first, audio later: TTFP must skip it
                for i in range(N_CHUNKS):
                    await asyncio.sleep(state.first_delay if i == 0 else state.chunk_delay)
                    pcm = pcm_chunk(i)
                    if sse:
                        ev = {"type": "speech.audio.delta", "audio": base64.b64encode(pcm).decode()}
                        yield f"data: {json.dumps(ev)}\n\n".encode()
                    else:
                        yield pcm
                if sse:
                    if text.startswith("SSE_ERROR"):
                        err = {"type": "error", "error": {"message": "engine died", "code": "engine_error"}}
                        yield f"data: {json.dumps(err)}\n\n".encode()
                    elif not text.startswith("SSE_TRUNCATE"):
                        done = {"type": "speech.audio.done", "usage": {"input_tokens": len(text.split())}}
                        yield f"data: {json.dumps(done)}\n\n".encode()
                state.served += 1
            finally:
                state.current -= 1

        resp = web.StreamResponse()
        resp.content_type = "text/event-stream" if sse else ("audio/wav" if fmt == "wav" else "audio/pcm")
        await resp.prepare(request)
        try:
            async for chunk in gen():
                await resp.write(chunk)
            await resp.write_eof()
        except ConnectionError:
            pass  # the client left
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/audio/speech", speech)
    return app


class ThreadServer:
    """The fake server on its own event loop in a thread."""

    def __init__(self, state: FakeState, sock: socket.socket | None = None) -> None:
        self.state = state
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
        self.sock = sock
        self.port = self.sock.getsockname()[1]
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.runner: web.AppRunner | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(make_app(self.state), access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.SockSite(self.runner, self.sock).start())
        self.started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        if not self.started.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.sock.close()


def fake_main(argv: list[str] | None = None) -> None:
    """Run the fake as a server process (used by --compare tests)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--deploy", default="")
    ap.add_argument("--startup-delay", type=float, default=0.3)
    ap.add_argument("--spawn-child", default=None, help="start a sleeping child; write its pid to this file")
    ap.add_argument("--ignore-sigint", action="store_true")
    ap.add_argument("--ignore-sigterm", action="store_true")
    ap.add_argument("--exit-now", action="store_true")
    a = ap.parse_args(argv)
    print(f"fake server starting: deploy={a.deploy}", flush=True)
    if a.exit_now:
        print("fake server: giving up", flush=True)
        sys.exit(3)
    stem = Path(a.deploy).stem if a.deploy else ""
    # Make variants distinguishable: batch hands over late, fused is quickest.
    first = {"split_batch": 0.06, "split_chunk": 0.015, "fused": 0.01}.get(stem, 0.01)
    state = FakeState(first_delay=first, chunk_delay=0.01)
    if a.spawn_child:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        Path(a.spawn_child).write_text(str(child.pid))
    time.sleep(a.startup_delay)
    if a.ignore_sigint or a.ignore_sigterm:
        # Serve from a thread (its loop installs no signal handlers) and keep the main
        # thread alive, so only the signals we do not ignore stop us.
        if a.ignore_sigint:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if a.ignore_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        ThreadServer(state, socket.create_server((a.host, a.port))).thread.start()
        while True:
            time.sleep(1)
    # SIGINT / SIGTERM end run_app gracefully
    web.run_app(make_app(state), host=a.host, port=a.port, print=None, access_log=None)


if __name__ == "__main__":
    fake_main()
    sys.exit(0)


