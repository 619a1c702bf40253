"""Asyncio client for omni-rt's OpenPI policy WebSocket (`/` or `/v1/openpi`).

The same wire as openpi's `WebsocketClientPolicy` (metadata frame first, lockstep
msgpack-numpy observations and replies), without its numpy<2 pin, for many robots in
one process (tests, latency_bench). It also speaks omni-rt's extensions: `layout` and
`seed` query parameters and the `{"endpoint": "reset"}` request.

    async with await PolicyClient.connect("ws://127.0.0.1:8000", layout="droid") as robot:
        reply = await robot.infer(droid_observation(seed=0))
        reply["actions"]            # float32 [action_horizon, action_dim]

CLI: ``python -m clients.openpi --url ws://127.0.0.1:8000 --calls 20`` prints the
metadata and the round-trip times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any
from urllib.parse import urlencode

import numpy as np
import websockets
from websockets.asyncio.client import ClientConnection, connect

from clients.closing import close
from media.msgpack_numpy import packb, unpackb


class OpenPIError(RuntimeError):
    """The server answered with a text frame (openpi's error form) or closed."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


def droid_observation(seed: int = 0, prompt: str = "pick up the red cup", size: int = 224) -> dict[str, Any]:
    """DROID-shaped: two HWC uint8 cameras, 7 joint positions and a gripper (float64)."""
    rng = np.random.default_rng(seed)
    return {
        "observation/exterior_image_1_left": rng.integers(0, 256, (size, size, 3), dtype=np.uint8),
        "observation/wrist_image_left": rng.integers(0, 256, (size, size, 3), dtype=np.uint8),
        "observation/joint_position": rng.uniform(-1, 1, 7),
        "observation/gripper_position": rng.uniform(0, 1, 1),
        "prompt": prompt,
    }


def aloha_observation(seed: int = 0, prompt: str = "fold the towel", size: int = 224) -> dict[str, Any]:
    """ALOHA-shaped: 14 state dims and CHW uint8 cameras nested under `images`."""
    rng = np.random.default_rng(seed)
    cams = ("cam_high", "cam_left_wrist", "cam_right_wrist")
    return {
        "state": rng.uniform(-1, 1, 14),
        "images": {c: rng.integers(0, 256, (3, size, size), dtype=np.uint8) for c in cams},
        "prompt": prompt,
    }


class PolicyClient:
    def __init__(self, ws: ClientConnection, metadata: dict[str, Any]) -> None:
        self.ws = ws
        self.metadata = metadata

    @classmethod
    async def connect(
        cls,
        url: str,
        api_key: str | None = None,
        *,
        layout: str | None = None,
        seed: int | None = None,
        open_timeout: float = 30.0,
    ) -> PolicyClient:
        query = {k: v for k, v in (("layout", layout), ("seed", seed)) if v is not None}
        if query:
            url += ("&" if "?" in url else "?") + urlencode(query)
        headers = {"Authorization": f"Api-Key {api_key}"} if api_key else None
        ws = await connect(url, compression=None, max_size=None, additional_headers=headers, open_timeout=open_timeout)
        first = await cls._recv(ws)
        return cls(ws, first)

    @staticmethod
    async def _recv(ws: ClientConnection) -> Any:
        try:
            msg = await ws.recv()
        except websockets.ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd is not None else None
            reason = exc.rcvd.reason if exc.rcvd is not None else ""
            raise OpenPIError(f"connection closed ({code} {reason})".strip(), code) from None
        if isinstance(msg, str):
            code = None
            try:
                await asyncio.wait_for(ws.wait_closed(), 2.0)
                code = ws.close_code
            except asyncio.TimeoutError:
                pass
            raise OpenPIError(msg, code)
        return unpackb(msg)

    async def call(self, message: dict[str, Any]) -> dict[str, Any]:
        try:
            await self.ws.send(packb(message))
        except websockets.ConnectionClosed:
            pass  # the server ended the connection first: why (its text frame) is read next
        return await self._recv(self.ws)

    async def infer(self, obs: dict[str, Any]) -> dict[str, Any]:
        return await self.call(obs)

    async def reset(self, seed: int | None = None) -> dict[str, Any]:
        return await self.call({"endpoint": "reset", **({"seed": seed} if seed is not None else {})})

    async def close(self) -> None:
        await close(self.ws)

    async def __aenter__(self) -> PolicyClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _main(args: argparse.Namespace) -> int:
    robot = await PolicyClient.connect(args.url, args.api_key, layout=args.layout, seed=args.seed)
    async with robot:
        print(json.dumps(robot.metadata, indent=2))
        make = aloha_observation if robot.metadata.get("layout") == "aloha" else droid_observation
        obs = make(0, args.prompt)
        times = []
        for _ in range(args.calls):
            t = time.perf_counter()
            reply = await robot.infer(obs)
            times.append((time.perf_counter() - t) * 1000)
        a = reply["actions"]
        print(f"actions {list(a.shape)} {a.dtype}; first step {np.round(a[0], 3).tolist()}")
        print(f"round trip ms: p50 {np.percentile(times, 50):.2f} p99 {np.percentile(times, 99):.2f}; "
              f"last server_timing {reply['server_timing']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Call an omni-rt (or openpi) policy server a few times.")
    ap.add_argument("--url", default="ws://127.0.0.1:8000")
    ap.add_argument("--api-key")
    ap.add_argument("--layout", help="embodiment layout (omni-rt; see the metadata's 'layouts')")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--prompt", default="pick up the red cup")
    ap.add_argument("--calls", type=int, default=20)
    try:
        return asyncio.run(_main(ap.parse_args(argv)))
    except OpenPIError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
