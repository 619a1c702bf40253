"""`GET /`: a short index of what this server speaks; `GET /demo`: the browser voice
agent (WebRTC, `static/demo.html`: one self-contained page, no build step)."""

from __future__ import annotations

import html
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

STATIC = Path(__file__).parent / "static"


def build_pages_router(pipelines: list[str]) -> APIRouter:
    router = APIRouter()
    demo = (STATIC / "demo.html").read_text()
    voice = "voice" in pipelines
    rows = [
        ("GET", "/health", "readiness and per-stage state"),
        ("GET", "/metrics", "Prometheus metrics"),
        ("GET", "/v1/models", "the models served"),
        ("POST", "/v1/audio/speech", "text to speech (OpenAI)"),
        ("GET", "/v1/sessions", "sessions (yours; all for admins)"),
    ]
    if voice:
        rows += [
            ("POST", "/v1/chat/completions", "chat, text and audio (OpenAI)"),
            ("WS", "/v1/realtime", "OpenAI Realtime (GA and beta)"),
            ("WS", "/v1/duplex", "full-duplex voice with resume"),
            ("POST", "/v1/realtime/calls", "WebRTC call (SDP offer → answer)"),
        ]
    if "image" in pipelines:
        rows += [("POST", "/v1/images/generations", "text to image (OpenAI)")]
    if "world" in pipelines:
        rows += [("WS", "/v1/world", "world-model rollouts (action in, frames out)")]
    if "video_edit" in pipelines:
        rows += [
            ("POST", "/v1/videos", "video jobs (OpenAI); GET/DELETE /v1/videos/{id}, …/content"),
            ("WS", "/v1/realtime/video", "live video generation with prompt edits"),
        ]
    if "robot" in pipelines:
        rows += [
            ("WS", "/", "OpenPI policy (openpi-client; also /v1/openpi)"),
        ]
    items = "".join(f"<tr><td>{m}</td><td><code>{html.escape(p)}</code></td><td>{html.escape(d)}</td></tr>" for m, p, d in rows)
    demo_link = '<p><a href="/demo">Voice agent demo</a> (WebRTC, in this browser)</p>' if voice else ""
    index = (
        "<!doctype html><html lang=en><meta charset=utf-8><title>omni-rt</title>"
        "<body style='font:15px system-ui,sans-serif;max-width:44rem;margin:2rem auto'>"
        f"<h1>omni-rt</h1><p>Pipelines: {html.escape(', '.join(pipelines))}</p>{demo_link}"
        f"<table>{items}</table></body></html>"
    )

    @router.get("/", response_class=HTMLResponse)
    async def root() -> str:
        return index

    if voice:

        @router.get("/demo", response_class=HTMLResponse)
        async def demo_page() -> str:
            return demo

    return router
