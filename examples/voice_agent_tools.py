"""A voice agent that acts: openai-agents' `RealtimeAgent` with a weather tool, against
omni-rt (`make serve`), with the SDK unchanged.

    python examples/voice_agent_tools.py --url ws://127.0.0.1:8000/v1/realtime --city Lima

The user asks for the weather; the agent calls `get_weather`, the tool runs here, its
result goes back to the server and the agent answers it out loud (the answer's audio is
written to --out as a WAV file). On the tiny default checkpoints the model is random: the
first response is asked with `tool_choice: "required"` so that it calls the tool (vLLM's
grammar makes the call's arguments fit the tool's schema); a real model decides itself
under the default `auto`. Prints the call, the tool's result and the spoken answer's
length; exit status 1 if the round trip did not complete.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import wave
from typing import Literal

from agents import function_tool
from agents.realtime import RealtimeAgent, RealtimeRunner
from agents.realtime.model_inputs import RealtimeModelSendRawMessage

City = Literal["Paris", "Lima", "Oslo", "Tokyo"]
FORECASTS = {"Paris": "18 °C and sunny", "Lima": "21 °C, overcast", "Oslo": "4 °C with light rain", "Tokyo": "15 °C, clear skies"}


@function_tool
def get_weather(city: City) -> str:
    """Today's weather in a city."""
    forecast = FORECASTS[city]
    print(f"tool: get_weather(city={city!r}) -> {forecast!r}")
    return forecast


async def run(url: str, api_key: str, city: str, out: str, timeout: float) -> int:
    agent = RealtimeAgent(name="Weather", instructions="You tell people the weather. Use get_weather, then answer in one sentence.",
                          tools=[get_weather])
    session = await RealtimeRunner(agent).run(model_config={"url": url, "api_key": api_key})
    audio = bytearray()
    tool_ran = False
    async with session:
        question = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"What's the weather in {city}?"}]}
        await session.model.send_event(RealtimeModelSendRawMessage(message={"type": "conversation.item.create", "other_data": {"item": question}}))
        await session.model.send_event(RealtimeModelSendRawMessage(
            message={"type": "response.create", "other_data": {"response": {"tool_choice": "required"}}}))

        async def events() -> None:
            nonlocal tool_ran
            async for ev in session:
                if ev.type == "tool_end":
                    tool_ran = True
                elif ev.type == "audio" and tool_ran:
                    audio.extend(ev.audio.data)
                elif ev.type == "agent_end" and tool_ran and audio:
                    return
                elif ev.type == "error":
                    print(f"error: {ev.error}", file=sys.stderr)

        try:
            await asyncio.wait_for(events(), timeout)
        except asyncio.TimeoutError:
            print(f"no spoken answer to the tool's result within {timeout:.0f} s", file=sys.stderr)
            return 1
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes(bytes(audio))
    print(f"answer: {len(audio) / 48000:.2f} s of audio -> {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="ws://127.0.0.1:8000/v1/realtime?model=gpt-realtime")
    ap.add_argument("--api-key", default="sk-local", help="the server's key (any value when keys are off)")
    ap.add_argument("--city", default="Paris", choices=sorted(FORECASTS))
    ap.add_argument("--out", default="answer.wav")
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    return asyncio.run(run(args.url, args.api_key, args.city, args.out, args.timeout))


if __name__ == "__main__":
    sys.exit(main())
