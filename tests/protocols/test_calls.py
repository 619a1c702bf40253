"""Call control for phone calls (`protocols.calls`), in process over fake engines, with
the official `openai` SDK on the app's side: the signed `realtime.call.incoming`
webhook verified by `client.webhooks.unwrap`, `client.realtime.calls.accept / reject /
refer / hangup`, and the sideband control socket (`/v1/realtime?call_id=`), while a
Twilio-faithful peer (`clients.twilio`) holds the phone leg."""

from __future__ import annotations

import asyncio
import base64
import json
import secrets

import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from clients.twilio import TwilioStream
from testkit import serve
from testkit.wire import Events, g711, quiet, tone

SECRET = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
SPEECH = g711(quiet(0.4) + tone(0.8) + quiet(0.8))


class Webhooks:
    """The app's webhook endpoint: every delivery verified with the SDK, its events queued."""

    def __init__(self) -> None:
        self.events: asyncio.Queue = asyncio.Queue()
        self.unsigned: list[str] = []
        app = web.Application()
        app.router.add_post("/hooks", self.receive)
        self.server = TestServer(app)

    async def receive(self, request: web.Request) -> web.Response:
        body = await request.text()
        sdk = openai.AsyncOpenAI(api_key="unused", webhook_secret=SECRET)
        with pytest.raises(openai.InvalidWebhookSignatureError):  # a wrong secret does not verify it
            sdk.webhooks.unwrap(body, dict(request.headers), secret="whsec_" + base64.b64encode(b"x" * 24).decode())
        event = sdk.webhooks.unwrap(body, dict(request.headers))
        await self.events.put(event)
        return web.Response(status=200)


@pytest.fixture
async def hooks():
    w = Webhooks()
    await w.server.start_server()
    yield w
    await w.server.close()


def sdk(h) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key="sk-unused", base_url=str(h.client.make_url("/v1")), max_retries=0)


async def test_a_call_rings_is_accepted_with_the_sdk_and_steered_over_the_sideband(hooks):
    overlay = {"server": {"call_webhook_url": str(hooks.server.make_url("/hooks")), "call_webhook_secret": SECRET}}
    async with serve(["voice"], overlay) as h:
        client = sdk(h)
        t = TwilioStream(await h.client.ws_connect("/v1/telephony/twilio"), play_speed=8.0)
        await t.start({"caller": "+15550100"})
        event = await asyncio.wait_for(hooks.events.get(), 10)
        assert event.type == "realtime.call.incoming"
        call_id = event.data.call_id
        assert {"name": "X-Twilio-CallSid", "value": t.call_sid} in [hdr.model_dump() for hdr in event.data.sip_headers]
        assert {"name": "X-Twilio-Param-caller", "value": "+15550100"} in [hdr.model_dump() for hdr in event.data.sip_headers]
        # ringing: the caller is not heard and nothing is said
        await t.say(SPEECH)
        await asyncio.sleep(0.3)
        assert not [m for m in t.received if m["event"] == "media"] and not h.processor("thinker").seen
        await client.realtime.calls.accept(call_id, type="realtime", instructions="Answer briefly.", max_output_tokens=6,
                                           audio={"output": {"voice": "alloy"}})
        with pytest.raises(openai.BadRequestError):  # answered once
            await client.realtime.calls.accept(call_id, type="realtime")
        side = Events(await h.client.ws_connect(f"/v1/realtime?call_id={call_id}"))
        created = await side.until("session.created")
        assert created["session"]["instructions"] == "Answer briefly."
        assert created["session"]["audio"]["output"]["format"] == {"type": "audio/pcmu"}
        # the caller speaks: the sideband sees the conversation, the phone leg gets the audio
        await t.say(SPEECH)
        done = await side.until("response.done", timeout=10)
        assert done["response"]["status"] == "completed"
        await t.wait_for(lambda: t.played_marks)
        assert not [e for e in side.seen if e["type"] == "response.output_audio.delta"]  # audio stays on the phone leg
        # the app speaks through the sideband: a message and a response, heard on the phone
        before = len(t.audio)
        await side.send("conversation.item.create", item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hi."}]})
        await side.send("response.create")
        await side.until("response.done", timeout=10)
        await t.wait_for(lambda: len(t.audio) > before)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.realtime.calls.refer(call_id, target_uri="tel:+15550199")
        assert "not supported on a twilio media stream" in str(refused.value)
        # hang-up ends the call: the phone leg and the sideband close
        await client.realtime.calls.hangup(call_id)
        await t.wait_for(lambda: t.closed is not None)
        assert (await side.until("connection.closed"))["code"] == 1000
        assert not h.sessions.sessions()
        with pytest.raises(openai.NotFoundError):
            await client.realtime.calls.accept(call_id, type="realtime")
        await t.close()


async def test_a_rejected_or_unanswered_call_ends_and_unknown_calls_are_not_found(hooks):
    overlay = {"server": {"call_webhook_url": str(hooks.server.make_url("/hooks")), "call_webhook_secret": SECRET, "call_accept_timeout_s": 1.0}}
    async with serve(["voice"], overlay) as h:
        client = sdk(h)
        t = TwilioStream(await h.client.ws_connect("/v1/telephony/twilio"))
        await t.start()
        event = await asyncio.wait_for(hooks.events.get(), 10)
        t0 = asyncio.get_running_loop().time()
        await client.realtime.calls.reject(event.data.call_id, status_code=486)
        await t.wait_for(lambda: t.closed is not None)
        assert asyncio.get_running_loop().time() - t0 < 0.5  # the reject closed it, not the 1 s accept timeout
        await t.close()
        t = TwilioStream(await h.client.ws_connect("/v1/telephony/twilio"))
        await t.start()
        await asyncio.wait_for(hooks.events.get(), 10)
        await t.wait_for(lambda: t.closed is not None, timeout=5)  # not accepted within 1 s
        await t.close()
        assert not h.sessions.sessions()
        with pytest.raises(openai.NotFoundError):
            await client.realtime.calls.accept("sess_nope", type="realtime")
        async with h.client.ws_connect("/v1/realtime?call_id=sess_nope") as ws:
            msg = await ws.receive(timeout=5)
            assert json.loads(msg.data)["error"]["code"] == "call_not_found"


async def test_without_a_webhook_a_call_is_answered_at_once_and_its_sideband_can_attach():
    async with serve(["voice"]) as h:
        t = TwilioStream(await h.client.ws_connect("/v1/telephony/twilio"), play_speed=8.0)
        await t.start({"max_output_tokens": "4"})
        await t.say(SPEECH)
        await t.wait_for(lambda: t.played_marks)
        call_id = h.sessions.sessions()[0].id
        async with h.client.ws_connect(f"/v1/realtime?call_id={call_id}") as ws:
            side = Events(ws)
            await side.until("session.created")
            await side.send("session.update", session={"type": "realtime", "instructions": "Be kind."})
            assert (await side.until("session.updated"))["session"]["instructions"] == "Be kind."
        assert t.closed is None  # the sideband left; the call goes on
        await t.stop()
        await t.wait_for(lambda: t.closed is not None)
        await t.close()


async def test_openai_agents_sip_flow_runs_unchanged(hooks):
    """openai-agents' SIP flow as its docs show it: the webhook verified with the SDK,
    the call accepted with `OpenAIRealtimeSIPModel.build_initial_session_payload(agent)`,
    the agent attached as the sideband (`OpenAIRealtimeSIPModel` with the `call_id`), a
    tool round trip, and the SDK's hang-up ending the phone leg."""
    from agents import function_tool
    from agents.realtime import RealtimeAgent, RealtimeRunner
    from agents.realtime.model_inputs import RealtimeModelSendRawMessage
    from agents.realtime.openai_realtime import OpenAIRealtimeSIPModel

    ran: list[str] = []

    @function_tool
    def book_table(day: str) -> str:
        """Book a table for a day."""
        ran.append(day)
        return f"Booked for {day}."

    overlay = {"server": {"call_webhook_url": str(hooks.server.make_url("/hooks")), "call_webhook_secret": SECRET}}
    async with serve(["voice"], overlay) as h:
        client = sdk(h)
        t = TwilioStream(await h.client.ws_connect("/v1/telephony/twilio"), play_speed=8.0)
        await t.start()
        event = await asyncio.wait_for(hooks.events.get(), 10)
        call_id = event.data.call_id
        agent = RealtimeAgent(name="Front desk", instructions="Book tables. Answer briefly.", tools=[book_table])
        payload = await OpenAIRealtimeSIPModel.build_initial_session_payload(agent)
        body = payload.model_dump(exclude_none=True)
        await client.realtime.calls.accept(call_id, **body)
        runner = RealtimeRunner(agent, model=OpenAIRealtimeSIPModel())
        ws_url = str(h.client.make_url("/v1/realtime")).replace("http://", "ws://")
        session = await runner.run(model_config={"call_id": call_id, "url": f"{ws_url}?call_id={call_id}", "api_key": "sk-unused"})
        server_events: list[str] = []
        async with session:
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "A table for Friday, please."}]}
            await session.model.send_event(RealtimeModelSendRawMessage(message={"type": "conversation.item.create", "other_data": {"item": item}}))
            await session.model.send_event(RealtimeModelSendRawMessage(message={"type": "response.create", "other_data": {"response": {"tool_choice": "required"}}}))

            async def until_spoken_after_tool() -> None:
                async for ev in session:
                    if ev.type == "raw_model_event" and ev.data.type == "raw_server_event":
                        server_events.append(ev.data.data.get("type"))
                        assert ev.data.data.get("type") != "error", ev.data.data
                    if ran and server_events.count("response.done") >= 2:
                        return

            await asyncio.wait_for(until_spoken_after_tool(), 20)
        assert ran, server_events
        await t.wait_for(lambda: t.played_marks)  # the answer after the tool was heard on the phone
        await client.realtime.calls.hangup(call_id)
        await t.wait_for(lambda: t.closed is not None)
        await t.close()


async def test_the_phone_agent_example_answers_a_call():
    """examples/phone_agent.py as the app: it verifies the webhook, accepts the call with
    its agent's session and attaches the agent; the caller hears the agent."""
    import importlib.util
    from pathlib import Path

    from testkit.harness import free_port

    spec = importlib.util.spec_from_file_location("phone_agent", Path(__file__).parents[2] / "examples" / "phone_agent.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    port = free_port()
    overlay = {"server": {"call_webhook_url": f"http://127.0.0.1:{port}/hooks", "call_webhook_secret": SECRET}}
    async with serve(["voice"], overlay) as h:
        base = str(h.client.make_url("/")).rstrip("/")
        app = TestServer(example.build_app(base, "sk-unused", SECRET), port=port)
        await app.start_server()
        try:
            t = TwilioStream(await h.client.ws_connect("/v1/telephony/twilio"), play_speed=8.0)
            await t.start()
            from protocols.calls import calls_of

            await t.wait_for(lambda: bool(h.sessions.sessions()))
            call_id = h.sessions.sessions()[0].id

            await t.wait_for(lambda: calls_of(h.sessions).calls[call_id].accepted, timeout=10)
            conv = calls_of(h.sessions).calls[call_id].conv
            assert "dental clinic" in conv.cfg.instructions and conv.cfg.tools  # the agent's session
            await t.say(SPEECH)
            await t.wait_for(lambda: t.played_marks, timeout=15)
            await sdk(h).realtime.calls.hangup(call_id)
            await t.wait_for(lambda: t.closed is not None)
            await t.close()
        finally:
            await app.close()


async def test_with_api_keys_a_call_is_controlled_by_its_own_principal_only(hooks):
    keys = [{"key": "sk-phones", "principal": "phones"}, {"key": "sk-other", "principal": "other"}]
    overlay = {"server": {"api_keys": keys, "call_webhook_url": str(hooks.server.make_url("/hooks")), "call_webhook_secret": SECRET}}
    async with serve(["voice"], overlay) as h:
        base = str(h.client.make_url("/v1"))
        mine = openai.AsyncOpenAI(api_key="sk-phones", base_url=base, max_retries=0)
        other = openai.AsyncOpenAI(api_key="sk-other", base_url=base, max_retries=0)
        nobody = openai.AsyncOpenAI(api_key="sk-nobody", base_url=base, max_retries=0)
        t = TwilioStream(await h.client.ws_connect("/v1/telephony/twilio"))
        await t.start({"authorization": "Bearer sk-phones"})
        call_id = (await asyncio.wait_for(hooks.events.get(), 10)).data.call_id
        with pytest.raises(openai.AuthenticationError):
            await nobody.realtime.calls.accept(call_id, type="realtime")
        with pytest.raises(openai.NotFoundError):  # another principal's call is not found
            await other.realtime.calls.accept(call_id, type="realtime")
        async with h.client.ws_connect(f"/v1/realtime?call_id={call_id}", headers={"authorization": "Bearer sk-other"}) as ws:
            assert json.loads((await ws.receive(timeout=5)).data)["error"]["code"] == "call_not_found"
        await mine.realtime.calls.accept(call_id, type="realtime", max_output_tokens=4)
        async with h.client.ws_connect(f"/v1/realtime?call_id={call_id}", headers={"authorization": "Bearer sk-phones"}) as ws:
            side = Events(ws)
            await side.until("session.created")
            await t.say(SPEECH)
            assert (await side.until("response.done", timeout=10))["response"]["status"] == "completed"
        await mine.realtime.calls.hangup(call_id)
        await t.wait_for(lambda: t.closed is not None)
        await t.close()
