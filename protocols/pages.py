"""`GET /`: a short index of what this server speaks (the routes every mounted wire
listed); `GET /demo` (mounted by the WebRTC wire): the browser voice agent
(`static/demo.html`: one self-contained page, no build step)."""

from __future__ import annotations

import html
from pathlib import Path

from aiohttp import web

from protocols.registry import Routes

STATIC = Path(__file__).parent / "static"


def demo_page() -> web.Response:
    return web.Response(text=(STATIC / "demo.html").read_text(), content_type="text/html")


def add_routes(routes: Routes, pipelines: list[str]) -> None:
    index: str | None = None

    def render() -> str:
        rows = [
            ("GET", "/health", "readiness and per-stage state"),
            ("GET", "/metrics", "Prometheus metrics"),
            ("GET", "/v1/models", "the models served"),
            *routes.index,
        ]
        items = "".join(f"<tr><td>{m}</td><td><code>{html.escape(p)}</code></td><td>{html.escape(d)}</td></tr>" for m, p, d in rows)
        demo = ("GET", "/demo") in routes.http
        demo_link = '<p><a href="/demo">Voice agent demo</a> (WebRTC, in this browser)</p>' if demo else ""
        return (
            "<!doctype html><html lang=en><meta charset=utf-8><title>omni-rt</title>"
            "<body style='font:15px system-ui,sans-serif;max-width:44rem;margin:2rem auto'>"
            f"<h1>omni-rt</h1><p>Pipelines: {html.escape(', '.join(pipelines))}</p>{demo_link}"
            f"<table>{items}</table></body></html>"
        )

    async def root(request: web.Request) -> web.Response:
        nonlocal index
        if index is None:  # every wire has listed its routes by the first request
            index = render()
        return web.Response(text=index, content_type="text/html")

    routes.add("GET", "/", root, "server")
