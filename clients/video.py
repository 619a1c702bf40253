"""Clients for omni-rt video: jobs (`/v1/videos`) and live generation with prompt
edits (`/v1/realtime/video`).

    async with VideoJobs("http://127.0.0.1:8000", api_key) as jobs:
        job = await jobs.create("a paper boat on a river", seconds=2, size="128x128")
        job = await jobs.wait(job["id"])             # polls progress
        mp4 = await jobs.content(job["id"])

    live = await LiveVideo.connect("ws://127.0.0.1:8000/v1/realtime/video", api_key)
    await live.send("session.update", session={"prompt": "a cat", "width": 64, "height": 64})
    await live.send("generation.start", frames=16)
    ev = await live.until("video.frame")

CLI: ``python -m clients.video --url http://127.0.0.1:8000 --prompt "…" --out clip.mp4``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect

from clients.closing import close
from clients.errors import HttpApiError


class VideoError(HttpApiError):
    """A video jobs call was refused or failed."""


class VideoJobs:
    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120)

    async def _json(self, method: str, path: str, **kw: Any) -> Any:
        r = await self.http.request(method, path, **kw)
        if r.status_code != 200:
            raise VideoError.from_response(r)
        return r.json()

    async def create(self, prompt: str, **fields: Any) -> dict[str, Any]:
        body = {"prompt": prompt, **{k: (str(v) if k == "seconds" else v) for k, v in fields.items() if v is not None}}
        return await self._json("POST", "/v1/videos", json=body)

    async def get(self, video_id: str) -> dict[str, Any]:
        return await self._json("GET", f"/v1/videos/{video_id}")

    async def wait(self, video_id: str, poll_s: float = 0.2, on_progress: Any = None) -> dict[str, Any]:
        while True:
            job = await self.get(video_id)
            if on_progress is not None:
                on_progress(job)
            if job["status"] in ("completed", "failed"):
                return job
            await asyncio.sleep(poll_s)

    async def content(self, video_id: str) -> bytes:
        r = await self.http.get(f"/v1/videos/{video_id}/content")
        if r.status_code != 200:
            raise VideoError.from_response(r)
        return r.content

    async def delete(self, video_id: str) -> dict[str, Any]:
        return await self._json("DELETE", f"/v1/videos/{video_id}")

    async def close(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> VideoJobs:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class LiveVideo:
    def __init__(self, ws: ClientConnection, first: dict[str, Any]) -> None:
        self.ws = ws
        self.session = first.get("session", {})

    @classmethod
    async def connect(cls, url: str, api_key: str | None = None) -> LiveVideo:
        ws = await connect(url, additional_headers={"Authorization": f"Bearer {api_key}"} if api_key else None, max_size=None)
        return cls(ws, json.loads(await ws.recv()))

    async def send(self, type: str, **fields: Any) -> None:
        await self.ws.send(json.dumps({"type": type, **fields}))

    async def until(self, types: str | set[str], seen: list[dict[str, Any]] | None = None, timeout: float = 120) -> dict[str, Any]:
        want = {types} if isinstance(types, str) else types
        while True:
            ev = json.loads(await asyncio.wait_for(self.ws.recv(), timeout))
            if seen is not None:
                seen.append(ev)
            if ev["type"] in want:
                return ev

    async def close(self) -> None:
        await close(self.ws)


async def _main(args: argparse.Namespace) -> int:
    async with VideoJobs(args.url, args.api_key) as jobs:
        job = await jobs.create(args.prompt, seconds=args.seconds, size=args.size, seed=args.seed)
        job = await jobs.wait(job["id"], on_progress=lambda j: print(f"\r{j['status']} {j['progress']}%", end="", flush=True))
        print()
        if job["status"] != "completed":
            print(f"error: {job.get('error')}", file=sys.stderr)
            return 1
        data = await jobs.content(job["id"])
    with open(args.out, "wb") as f:
        f.write(data)
    print(f"wrote {args.out} ({len(data)} bytes)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Make a video with an omni-rt server (job API).")
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--seconds", type=int, default=2)
    ap.add_argument("--size")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--out", default="video.mp4")
    try:
        return asyncio.run(_main(ap.parse_args(argv)))
    except VideoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
