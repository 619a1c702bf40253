"""Closing a `websockets` connection whose user has stopped reading it."""

from __future__ import annotations

import asyncio

from websockets.asyncio.client import ClientConnection


async def close(ws: ClientConnection) -> None:
    """Close `ws`, discarding the messages nobody read. websockets stops reading the
    socket while its queue of unread messages is full, so the server's close frame
    would wait behind them and `close()` would give up only at its close timeout
    (10 s), with an abnormal 1006 instead of the server's code."""

    async def discard() -> None:
        async for _ in ws:
            pass

    reader = asyncio.get_running_loop().create_task(discard())
    try:
        await ws.close()
    finally:
        reader.cancel()
        # ConnectionClosed when it ends, or ConcurrencyError when another task is reading
        await asyncio.gather(reader, return_exceptions=True)
