"""A phone agent: openai-agents answering a Twilio number through omni-rt, with the SDKs
unchanged and no media server of your own.

The phone leg: the number's TwiML streams the call to omni-rt
(`<Connect><Stream url="wss://agent.example.com/v1/telephony/twilio">`, see
docs/api/telephony.md). omni-rt runs with call control on:

    # deploy overlay
    server:
      call_webhook_url: https://app.example.com/hooks   # this script's endpoint
      call_webhook_secret: whsec_...                     # the same secret as --secret

This script is the app: it receives each `realtime.call.incoming` webhook, verifies its
signature with `client.webhooks.unwrap`, accepts the call with the agent's session
(`OpenAIRealtimeSIPModel.build_initial_session_payload`) and attaches the agent to the
call as its sideband (`OpenAIRealtimeSIPModel` with the `call_id`); the agent's tools run
here, the caller hears the answers on the phone.

    python examples/phone_agent.py --omni-rt https://agent.example.com --api-key sk-... \\
        --secret whsec_... --listen 0.0.0.0:8080
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

import openai
from agents import function_tool
from agents.realtime import RealtimeAgent, RealtimeRunner
from agents.realtime.openai_realtime import OpenAIRealtimeSIPModel
from aiohttp import web

log = logging.getLogger("phone_agent")
OPENING_HOURS = {"monday": "9-17", "tuesday": "9-17", "wednesday": "9-17", "thursday": "9-19", "friday": "9-15"}


@function_tool
def opening_hours(day: str) -> str:
    """The clinic's opening hours on a weekday."""
    return OPENING_HOURS.get(day.lower(), "closed")


def agent() -> RealtimeAgent:
    return RealtimeAgent(name="Front desk", instructions="You answer the phone for a dental clinic. Be brief and friendly.",
                         tools=[opening_hours])


def build_app(omni_rt: str, api_key: str, secret: str, ws_url: str | None = None) -> web.Application:
    """The webhook endpoint (`POST /hooks`); each accepted call's agent runs as a task of
    the app. `ws_url`: omni-rt's `/v1/realtime` WebSocket (default: from `omni_rt`)."""
    client = openai.AsyncOpenAI(base_url=omni_rt.rstrip("/") + "/v1", api_key=api_key, webhook_secret=secret)
    realtime = ws_url or omni_rt.rstrip("/").replace("https://", "wss://").replace("http://", "ws://") + "/v1/realtime"
    calls: set[asyncio.Task[Any]] = set()

    async def answer(call_id: str) -> None:
        a = agent()
        payload = await OpenAIRealtimeSIPModel.build_initial_session_payload(a)
        await client.realtime.calls.accept(call_id, **payload.model_dump(exclude_none=True))
        runner = RealtimeRunner(a, model=OpenAIRealtimeSIPModel())
        session = await runner.run(model_config={"call_id": call_id, "url": f"{realtime}?call_id={call_id}", "api_key": api_key})
        async with session:
            async for event in session:  # the call runs until the caller or omni-rt hangs up
                if event.type == "error":
                    log.warning("call %s: %s", call_id, event.error)
        log.info("call %s ended", call_id)

    async def hooks(request: web.Request) -> web.Response:
        body = await request.text()
        try:
            event = client.webhooks.unwrap(body, dict(request.headers))
        except openai.InvalidWebhookSignatureError:
            return web.Response(status=400, text="bad signature")
        if event.type == "realtime.call.incoming":
            log.info("incoming call %s", event.data.call_id)
            task = asyncio.get_running_loop().create_task(answer(event.data.call_id))
            calls.add(task)
            task.add_done_callback(calls.discard)
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/hooks", hooks)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--omni-rt", required=True, help="omni-rt's base URL, e.g. https://agent.example.com")
    ap.add_argument("--api-key", default="sk-unused", help="an omni-rt API key (any value when the server has none)")
    ap.add_argument("--secret", required=True, help="the call webhook secret (whsec_...), as server.call_webhook_secret")
    ap.add_argument("--listen", default="127.0.0.1:8080", help="host:port the webhook endpoint listens on")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    host, _, port = args.listen.rpartition(":")
    web.run_app(build_app(args.omni_rt, args.api_key, args.secret), host=host or "127.0.0.1", port=int(port))


if __name__ == "__main__":
    main()
