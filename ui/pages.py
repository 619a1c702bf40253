"""The pages: `GET /`, an index of what this server speaks (the routes every mounted
wire listed) linking every page; the pages themselves, each one self-contained HTML
file under `static/` with no build step, mounted where the wire they drive is served —
`/demo` (WebRTC voice agent, the webrtc wire), `/demo/world` (the world wire),
`/demo/video` (the live-video wire) — and `/dashboard` (the server's own state);
`GET /static/{file}`: the stylesheet and script the pages share, and vendored
libraries (`static/vendor/`, each with its license). No page loads anything from
outside the server."""

from __future__ import annotations

import html
import mimetypes
from pathlib import Path
from typing import Any

from aiohttp import web

from omni_rt.errors import NotFound
from protocols.registry import Routes

STATIC = Path(__file__).parent / "static"

# path -> (title, what it is): the pages the index links when they are mounted
PAGES = {
    "/demo": ("Voice agent", "talk to the voice pipeline over WebRTC, in this browser"),
    "/demo/world": ("World model", "drive a world-model rollout from the keyboard"),
    "/demo/video": ("Live video", "watch a video generate and edit its prompt while it runs"),
    "/dashboard": ("Dashboard", "sessions, admission, stage queues and TTFP, live (admin)"),
}


def page(name: str) -> web.Response:
    """One page of `static/`, sent as it is (the file is read per request: small)."""
    return web.Response(text=(STATIC / name).read_text(encoding="utf-8"), content_type="text/html",
                        headers={"cache-control": "no-cache"})


# demo page path -> (its file, the route of the wire it drives)
DEMOS = {
    "/demo": ("demo.html", ("POST", "/v1/realtime/calls")),
    "/demo/world": ("world.html", ("WS", "/v1/world")),
    "/demo/video": ("video.html", ("WS", "/v1/realtime/video")),
}


def add_demos(routes: Routes) -> None:
    """Mount each demo page whose wire is served (after the wires are mounted)."""
    for path, (name, (method, wire)) in DEMOS.items():
        served = wire in routes.websocket or wire in routes.by_model if method == "WS" else (method, wire) in routes.http or (method, wire) in routes.http_by_model
        if served:
            routes.add("GET", path, _page_handler(name), "ui")


def _page_handler(name: str) -> Any:
    async def handler(request: web.Request) -> web.Response:
        return page(name)

    return handler


def static_file(rel: str) -> web.FileResponse:
    """A file under `static/` (never outside it; a page itself is served at its route)."""
    path = (STATIC / rel).resolve()
    if STATIC.resolve() not in path.parents or not path.is_file() or path.suffix == ".html":
        raise NotFound(f"Unknown path /static/{rel}")
    ctype = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return web.FileResponse(path, headers={"content-type": ctype, "cache-control": "max-age=3600"})


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
        cards = "".join(
            f'<a class="card" href="{p}"><b>{html.escape(title)}</b><span>{html.escape(what)}</span></a>'
            for p, (title, what) in PAGES.items() if ("GET", p) in routes.http
        )
        return (
            "<!doctype html><html lang=en><head><meta charset=utf-8><meta name=viewport content='width=device-width, initial-scale=1'>"
            "<title>omni-rt</title><link rel=stylesheet href='/static/omni.css'></head><body>"
            "<header><a class=brand href='/'>omni-rt</a></header><main>"
            f"<h1>omni-rt</h1><p class=muted>Pipelines: {html.escape(', '.join(pipelines))}</p>"
            f"<nav class=cards>{cards}</nav><h2>Routes</h2><table class=routes>{items}</table></main></body></html>"
        )

    async def root(request: web.Request) -> web.Response:
        nonlocal index
        if index is None:  # every wire has listed its routes by the first request
            index = render()
        return web.Response(text=index, content_type="text/html")

    async def static(request: web.Request) -> web.FileResponse:
        return static_file(request.match_info["path"])

    routes.add("GET", "/", root, "server")
    routes.add("GET", "/static/{path:.+}", static, "server")
