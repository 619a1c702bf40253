"""The voice-agent frameworks people build on, driven against the real server as their
docs show: openai-agents (RealtimeAgent / RealtimeRunner), pipecat (OpenAITTSService,
OpenAIRealtimeLLMService), LiveKit's OpenAI plugin (TTS, realtime.RealtimeModel, without
a room) and litellm (speech, chat completions).

Each client runs with its own defaults (model names aside, which name what this server
serves): default voices, turn detection and audio formats. The tiny voice model says
random words, so the tests check the protocol (events and audio arrive, the reply
resolves, the client raises or logs no error), never the content."""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
from typing import Any, Literal

import pytest

from testkit.harness import ALICE_KEY

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

REALTIME_MODEL = "gpt-realtime"
TTS_MODEL = "gpt-4o-mini-tts"
CHAT_MODEL = "gpt-4o-audio-preview"
TURN_TIMEOUT_S = 60.0
TEXT = "Hello from an agent framework."


def ws_url(server) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/realtime"


def server_log_tail(server, n: int = 4000) -> str:
    try:
        return server.log_file.read_text()[-n:]
    except Exception:  # pragma: no cover - diagnostics only
        return ""


def client_errors(caplog: pytest.LogCaptureFixture, *loggers: str) -> list[str]:
    """ERROR records of the client under test (its loggers; not asyncio's reports of
    clients other tests left to the garbage collector)."""
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith(loggers)]


# ----------------------------------------------------------------------------- openai-agents


def _agents():
    return importlib.import_module("agents.realtime")  # installed by `make install` (a missing one fails, not skips)


async def _agent_turn(session, *, interrupt: bool = False, linger_s: float = 0.0, updates: list[dict] | None = None) -> dict[str, Any]:
    """Session events until the agent's turn ends (agent_end), then `linger_s` more
    seconds (replies to what the SDK sent after the turn, e.g. conversation.item.retrieve);
    `updates` collects the server's session.created / session.updated events."""
    seen: dict[str, Any] = {"events": [], "server": [], "errors": [], "audio": 0, "interrupted": False}

    async def loop() -> None:
        async for ev in session:
            seen["events"].append(ev.type)
            if ev.type == "raw_model_event":
                data = ev.data
                if data.type == "raw_server_event":
                    seen["server"].append(data.data.get("type"))
                    if updates is not None and data.data.get("type") in ("session.created", "session.updated"):
                        updates.append(data.data)
                    if data.data.get("type") == "error":
                        seen["errors"].append(("server error event", data.data.get("error")))
                elif data.type in ("error", "exception"):
                    seen["errors"].append((data.type, getattr(data, "error", None) or getattr(data, "exception", None)))
            elif ev.type == "error":
                seen["errors"].append(("RealtimeError", ev.error))
            elif ev.type == "audio":
                seen["audio"] += len(ev.audio.data)
                if interrupt and not seen["interrupted"]:
                    seen["interrupted"] = True
                    await session.interrupt()
            elif ev.type == "agent_end":
                return

    await asyncio.wait_for(loop(), TURN_TIMEOUT_S)
    if linger_s:
        try:
            await asyncio.wait_for(loop(), linger_s)
        except asyncio.TimeoutError:
            pass
    return seen


async def _agent_session(server):
    rt = _agents()
    agent = rt.RealtimeAgent(name="Assistant", instructions="You are a helpful voice assistant. Answer briefly.")
    runner = rt.RealtimeRunner(agent)
    # the documented way to point the OpenAI transport elsewhere: model_config url/api_key
    return await runner.run(model_config={"url": f"{ws_url(server)}?model={REALTIME_MODEL}", "api_key": ALICE_KEY})


async def test_openai_agents_text_message_turn(server, caplog):
    caplog.set_level(logging.WARNING)
    session = await _agent_session(server)
    async with session:
        await session.send_message("Hello! What can you do?")
        seen = await _agent_turn(session)
    assert not seen["errors"], (seen["errors"], seen["server"], server_log_tail(server))
    assert "agent_start" in seen["events"] and "audio" in seen["events"] and "audio_end" in seen["events"], seen["events"]
    assert seen["audio"] > 0 and seen["audio"] % 2 == 0
    assert "response.done" in seen["server"]
    assert not client_errors(caplog, "openai.agents"), client_errors(caplog, "openai.agents")


async def test_openai_agents_interrupt_truncates_and_retrieves(server, caplog):
    caplog.set_level(logging.WARNING)
    session = await _agent_session(server)
    async with session:
        await session.send_message("Tell me a long story about the sea.")
        # interrupt() once audio plays: conversation.item.truncate, then (on
        # conversation.item.truncated) conversation.item.retrieve
        seen = await _agent_turn(session, interrupt=True, linger_s=3.0)
    assert seen["interrupted"], seen["events"]
    assert not seen["errors"], (seen["errors"], seen["server"], server_log_tail(server))
    assert "audio_interrupted" in seen["events"], seen["events"]
    assert "conversation.item.truncated" in seen["server"], seen["server"]
    assert "conversation.item.retrieved" in seen["server"], seen["server"]
    assert not client_errors(caplog, "openai.agents"), client_errors(caplog, "openai.agents")


async def test_openai_agents_speech_on_its_default_semantic_vad_then_an_idle_nudge(server, caplog):
    """openai-agents' own defaults (turn_detection semantic_vad): a spoken question is
    answered on the server's end-of-turn model; with `idle_timeout_ms` in the agent's
    model settings, the silence after the answer brings
    `input_audio_buffer.timeout_triggered` and a second answer (the nudge)."""
    caplog.set_level(logging.WARNING)
    rt = _agents()
    from testkit.harness import silence, speech_pcm16

    speech = silence(0.3) + speech_pcm16("Hello, can you tell me what the weather is like today?")
    for settings in (None, {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 1500}}):
        agent = rt.RealtimeAgent(name="Assistant", instructions="Answer briefly.")
        runner = rt.RealtimeRunner(agent, config={"model_settings": settings} if settings else None)
        session = await runner.run(model_config={"url": f"{ws_url(server)}?model={REALTIME_MODEL}", "api_key": ALICE_KEY})
        updates: list[dict] = []
        async with session:

            async def microphone(session: Any = session) -> None:  # the speech, then silence as long as the call lasts (100 ms a chunk)
                for i in range(0, len(speech), 4800):
                    await session.send_audio(speech[i : i + 4800])
                while True:
                    await session.send_audio(silence(0.1))
                    await asyncio.sleep(0.05)

            mic = asyncio.create_task(microphone())
            try:
                seen = await _agent_turn(session, updates=updates)
                if settings:
                    nudge = await _agent_turn(session)
            finally:
                mic.cancel()
                await asyncio.gather(mic, return_exceptions=True)
        assert not seen["errors"], (seen["errors"], seen["server"], server_log_tail(server))
        td = updates[-1]["session"]["audio"]["input"]["turn_detection"]
        assert "input_audio_buffer.committed" in seen["server"] and seen["audio"] > 0, seen["server"]
        if settings is None:
            assert td["type"] == "semantic_vad", td  # the SDK's default, as the server applied it
        else:
            assert td["idle_timeout_ms"] == 1500 and not nudge["errors"], nudge["errors"]
            assert "input_audio_buffer.timeout_triggered" in nudge["server"] and nudge["audio"] > 0, nudge["server"]
    assert not client_errors(caplog, "openai.agents"), client_errors(caplog, "openai.agents")


async def test_openai_agents_function_tool_round_trip(server, caplog):
    """A RealtimeAgent with a @function_tool: the first response is made to call it
    (a raw response.create with tool_choice required: the tiny model would not on its
    own), the agent runs the tool, sends its result and asks again; the answer is spoken."""
    caplog.set_level(logging.WARNING)
    rt = _agents()
    from agents import function_tool
    from agents.realtime.model_inputs import RealtimeModelSendRawMessage

    ran: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Lima"]) -> str:
        """The weather in a city."""
        ran.append(city)
        return f"Sunny in {city}."

    agent = rt.RealtimeAgent(name="Assistant", instructions="Use your tools.", tools=[get_weather])
    runner = rt.RealtimeRunner(agent)
    session = await runner.run(model_config={"url": f"{ws_url(server)}?model={REALTIME_MODEL}", "api_key": ALICE_KEY})
    seen: dict[str, Any] = {"events": [], "server": [], "errors": [], "audio_after_tool": 0}
    async with session:
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]}
        await session.model.send_event(RealtimeModelSendRawMessage(message={"type": "conversation.item.create", "other_data": {"item": item}}))
        await session.model.send_event(RealtimeModelSendRawMessage(message={"type": "response.create", "other_data": {"response": {"tool_choice": "required"}}}))

        async def loop() -> None:
            ended = False
            async for ev in session:
                seen["events"].append(ev.type)
                if ev.type == "raw_model_event" and ev.data.type == "raw_server_event":
                    seen["server"].append(ev.data.data.get("type"))
                    if ev.data.data.get("type") == "error":
                        seen["errors"].append(ev.data.data.get("error"))
                elif ev.type == "error":
                    seen["errors"].append(ev.error)
                elif ev.type == "tool_end":
                    ended = True
                elif ev.type == "audio" and ended:
                    seen["audio_after_tool"] += len(ev.audio.data)
                elif ev.type == "agent_end" and ended and seen["audio_after_tool"]:
                    return

        await asyncio.wait_for(loop(), TURN_TIMEOUT_S)
    assert not seen["errors"], (seen["errors"], server_log_tail(server))
    assert ran and ran[0] in ("Paris", "Lima"), seen["events"]
    assert "tool_start" in seen["events"] and "tool_end" in seen["events"]
    assert "response.function_call_arguments.done" in seen["server"]
    assert seen["audio_after_tool"] > 0  # the agent answered the tool's result out loud
    assert not client_errors(caplog, "openai.agents"), client_errors(caplog, "openai.agents")


# ----------------------------------------------------------------------------- pipecat


def _pipecat():
    return importlib.import_module("pipecat")  # installed by `make install` (a missing one fails, not skips)


class _LoguruErrors:
    """pipecat logs through loguru: its ERROR records during the test."""

    def __init__(self) -> None:
        from loguru import logger

        self.records: list[str] = []
        self._logger = logger
        self._id = logger.add(lambda m: self.records.append(str(m).strip()), level="ERROR")

    def close(self) -> None:
        self._logger.remove(self._id)


async def _run_pipeline(processor, frames: list, until: type, timeout: float = TURN_TIMEOUT_S, predicate: Any = None,
                        until_up: type | None = None) -> tuple[list, list]:
    """pipecat.tests.utils.run_test's pipeline (source -> processor -> sink), ended once a
    frame of type `until` comes downstream (or an ErrorFrame either way); with
    `predicate(frame, frames so far)`, only an `until` frame it accepts ends it; with
    `until_up`, a frame of that type must also have come upstream."""
    from pipecat.frames.frames import EndFrame, ErrorFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.processors.frame_processor import FrameDirection
    from pipecat.tests.utils import QueuedFrameProcessor
    from pipecat.workers.runner import WorkerRunner

    up: asyncio.Queue = asyncio.Queue()
    down: asyncio.Queue = asyncio.Queue()
    source = QueuedFrameProcessor(queue=up, queue_direction=FrameDirection.UPSTREAM)
    sink = QueuedFrameProcessor(queue=down, queue_direction=FrameDirection.DOWNSTREAM)
    worker = PipelineWorker(Pipeline([source, processor, sink]), cancel_on_idle_timeout=False, params=PipelineParams())
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def _started(worker, frame):
        started.set()

    got_down: list = []
    got_up: list = []

    async def drive() -> None:
        await asyncio.wait_for(started.wait(), 30)
        for f in frames:
            await worker.queue_frame(f)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        ended_down = False
        while loop.time() < deadline:
            while not up.empty():
                got_up.append(up.get_nowait())
            if any(isinstance(f, ErrorFrame) for f in got_up):
                break
            if ended_down and until_up is not None and any(isinstance(f, until_up) for f in got_up):
                break
            try:
                f = await asyncio.wait_for(down.get(), 0.2)
            except asyncio.TimeoutError:
                continue
            got_down.append(f)
            if isinstance(f, ErrorFrame):
                break
            if isinstance(f, until) and (predicate is None or predicate(f, got_down)):
                ended_down = True
                if until_up is None:
                    break
        await worker.queue_frame(EndFrame())

    runner = WorkerRunner()
    await runner.add_workers(worker)
    await asyncio.wait_for(asyncio.gather(runner.run(), drive()), timeout + 60)
    while not down.empty():
        got_down.append(down.get_nowait())
    while not up.empty():
        got_up.append(up.get_nowait())
    return got_down, got_up


async def test_pipecat_openai_tts(server):
    _pipecat()
    from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame, TTSSpeakFrame, TTSStoppedFrame
    from pipecat.services.openai.tts import OpenAITTSService

    errors = _LoguruErrors()
    try:
        tts = OpenAITTSService(api_key=ALICE_KEY, base_url=f"{server.url}/v1")
        down, up = await _run_pipeline(tts, [TTSSpeakFrame(TEXT)], until=TTSStoppedFrame)
    finally:
        errors.close()
    errs = [f for f in down + up if isinstance(f, ErrorFrame)]
    assert not errs, (errs, server_log_tail(server))
    audio = [f for f in down if isinstance(f, TTSAudioRawFrame)]
    assert audio and sum(len(f.audio) for f in audio) > 0, [type(f).__name__ for f in down]
    assert all(f.sample_rate == 24000 and f.num_channels == 1 for f in audio)
    assert any(isinstance(f, TTSStoppedFrame) for f in down)
    assert not errors.records, errors.records


async def test_pipecat_openai_realtime_llm(server):
    _pipecat()
    from pipecat.frames.frames import ErrorFrame, LLMContextFrame, LLMFullResponseEndFrame, TTSAudioRawFrame, TTSStartedFrame
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService

    errors = _LoguruErrors()
    try:
        settings = OpenAIRealtimeLLMService.Settings(model=REALTIME_MODEL, system_instruction="Answer briefly.")
        llm = OpenAIRealtimeLLMService(api_key=ALICE_KEY, base_url=ws_url(server), settings=settings)
        context = LLMContext(messages=[{"role": "user", "content": "Hello there!"}])
        down, up = await _run_pipeline(llm, [LLMContextFrame(context)], until=LLMFullResponseEndFrame)
    finally:
        errors.close()
    errs = [f for f in down + up if isinstance(f, ErrorFrame)]
    assert not errs, (errs, server_log_tail(server))
    names = [type(f).__name__ for f in down]
    assert any(isinstance(f, TTSStartedFrame) for f in down), names
    audio = [f for f in down if isinstance(f, TTSAudioRawFrame)]
    assert audio and sum(len(f.audio) for f in audio) > 0, names
    assert any(isinstance(f, LLMFullResponseEndFrame) for f in down), names
    assert not errors.records, errors.records


async def test_pipecat_shows_the_callers_words_while_they_speak(server):
    """pipecat's OpenAI realtime service with input transcription (gpt-4o-transcribe) on
    server VAD: the spoken turn's transcript comes as interim transcription frames (the
    server's deltas, written while the audio streams) and then the final one, and the
    turn is answered."""
    _pipecat()
    from pipecat.frames.frames import ErrorFrame, InputAudioRawFrame, InterimTranscriptionFrame, LLMFullResponseEndFrame, TranscriptionFrame
    from pipecat.services.openai.realtime import events
    from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService

    from testkit.harness import admitting, silence, speech_pcm16

    await admitting(server.url)  # (the earlier tests' answers may still weigh on admission)
    pcm = silence(0.3) + speech_pcm16("Hello, can you tell me what the weather is like today?") + silence(1.2)
    audio = [InputAudioRawFrame(audio=pcm[i : i + 960], sample_rate=24000, num_channels=1) for i in range(0, len(pcm), 960)]  # 20 ms
    errors = _LoguruErrors()
    try:
        props = events.SessionProperties(instructions="Answer briefly.", max_output_tokens=8, audio=events.AudioConfiguration(
            input=events.AudioInput(transcription=events.InputAudioTranscription(model="gpt-4o-transcribe"), turn_detection=events.TurnDetection())))
        settings = OpenAIRealtimeLLMService.Settings(model=REALTIME_MODEL, session_properties=props)
        llm = OpenAIRealtimeLLMService(api_key=ALICE_KEY, base_url=ws_url(server), settings=settings)
        down, up = await _run_pipeline(llm, audio, until=LLMFullResponseEndFrame, until_up=TranscriptionFrame)
    finally:
        errors.close()
    errs = [f for f in down + up if isinstance(f, ErrorFrame)]
    assert not errs, (errs, server_log_tail(server))
    interim = [f.text for f in up if isinstance(f, InterimTranscriptionFrame)]
    final = [f.text for f in up if isinstance(f, TranscriptionFrame)]
    assert interim and final == ["".join(interim).strip()], (interim, final)
    assert not errors.records, errors.records


async def test_pipecat_openai_realtime_llm_function_call(server):
    """OpenAIRealtimeLLMService with a registered function, and the assistant context
    aggregator that asks for the answer once a result is in: the session forces a
    call, pipecat runs the handler (which lets the model answer freely from then on,
    as an app switching tool_choice would), sends the result, and the answer is spoken."""
    _pipecat()
    from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
    from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema
    from pipecat.frames.frames import ErrorFrame, LLMRunFrame, LLMUpdateSettingsFrame, TTSAudioRawFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
    from pipecat.services.openai.realtime import events
    from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService

    weather = FunctionSchema(name="get_weather", description="The weather in a city.",
                             properties={"city": {"type": "string", "enum": ["Paris", "Lima"]}}, required=["city"])
    ran: list[dict] = []
    errors = _LoguruErrors()
    try:
        settings = OpenAIRealtimeLLMService.Settings(
            model=REALTIME_MODEL, system_instruction="Use your tools.", session_properties=events.SessionProperties(tool_choice="required"))
        llm = OpenAIRealtimeLLMService(api_key=ALICE_KEY, base_url=ws_url(server), settings=settings)

        async def get_weather(params) -> None:
            ran.append(dict(params.arguments))
            await params.llm.queue_frame(LLMUpdateSettingsFrame(
                delta=OpenAIRealtimeLLMService.Settings(session_properties=events.SessionProperties(tool_choice="none"))))
            await params.result_callback({"conditions": "sunny", "temp_c": 21})

        llm.register_function("get_weather", get_weather)
        context = LLMContext(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=ToolsSchema(standard_tools=[weather]))
        aggregators = LLMContextAggregatorPair(context)
        # the forced response is a pure call (no audio): audio once the function ran is the answer
        pipeline = Pipeline([aggregators.user(), llm, aggregators.assistant()])
        down, up = await _run_pipeline(pipeline, [LLMRunFrame()], until=TTSAudioRawFrame,
                                       predicate=lambda f, got: bool(ran))
    finally:
        errors.close()
    errs = [f for f in down + up if isinstance(f, ErrorFrame)]
    assert not errs, (errs, server_log_tail(server))
    names = [type(f).__name__ for f in down]
    assert ran and ran[0]["city"] in ("Paris", "Lima"), names
    assert "TTSAudioRawFrame" in names, (names, server_log_tail(server))  # the answer to the result was spoken
    roles = [m.get("role") for m in context.get_messages() if isinstance(m, dict)]
    assert "tool" in roles, context.get_messages()  # the aggregator recorded the call's result
    assert not errors.records, errors.records


# ----------------------------------------------------------------------------- LiveKit


def _livekit():
    return importlib.import_module("livekit.plugins.openai")  # installed by `make install` (a missing one fails, not skips)


async def test_livekit_openai_tts_synthesize(server, caplog):
    caplog.set_level(logging.WARNING)
    lk = _livekit()
    tts = lk.TTS(base_url=f"{server.url}/v1", api_key=ALICE_KEY)  # default model and voice
    frames = []
    try:
        async with tts.synthesize(TEXT) as stream:
            async for ev in stream:
                frames.append(ev.frame)
    finally:
        await tts.aclose()
    assert frames, server_log_tail(server)
    assert sum(f.samples_per_channel for f in frames) > 0
    assert all(f.sample_rate == 24000 and f.num_channels == 1 for f in frames)
    assert not client_errors(caplog, "livekit"), client_errors(caplog, "livekit")


def _livekit_session(lk, server, http) -> tuple[Any, Any, list, list[dict]]:
    """A RealtimeModel and its session on the server, recording errors and the server's
    events. Outside a job there is no utils.http_context: the HTTP session is passed in."""
    model = lk.realtime.RealtimeModel(base_url=f"{server.url}/v1", api_key=ALICE_KEY, http_session=http)
    sess = model.session()
    errors: list = []
    server_events: list[dict] = []
    sess.on("error", errors.append)
    sess.on("openai_server_event_received", server_events.append)
    return model, sess, errors, server_events


@pytest.mark.parametrize("instructions", [True, False], ids=["instructions", "bare_greeting"])
async def test_livekit_openai_realtime_model_generate_reply(server, caplog, instructions):
    """RealtimeModel.session() then generate_reply(), as an agent's greeting does: with
    update_instructions + per-reply instructions, and bare (an empty conversation, no
    instructions at all)."""
    caplog.set_level(logging.WARNING)
    lk = _livekit()
    import aiohttp

    async with aiohttp.ClientSession() as http:
        model, sess, errors, server_events = _livekit_session(lk, server, http)
        try:
            if instructions:
                await sess.update_instructions("You are a helpful voice assistant. Answer briefly.")
                reply = sess.generate_reply(instructions="Greet the user.")
            else:
                reply = sess.generate_reply()
            gen = await asyncio.wait_for(reply, 20)  # resolves on response.created carrying its metadata
            audio_samples = 0
            texts: list[str] = []

            async def consume() -> None:
                nonlocal audio_samples
                async for msg in gen.message_stream:

                    async def text(m=msg) -> None:
                        async for t in m.text_stream:
                            texts.append(t)

                    task = asyncio.create_task(text())
                    async for frame in msg.audio_stream:
                        audio_samples += frame.samples_per_channel
                    await task

            await asyncio.wait_for(consume(), TURN_TIMEOUT_S)
        finally:
            await sess.aclose()
            await model.aclose()
    types = [e.get("type") for e in server_events]
    assert not errors, (errors, [e for e in server_events if e.get("type") == "error"], server_log_tail(server))
    assert "error" not in types, [e for e in server_events if e.get("type") == "error"]
    done = [e for e in server_events if e.get("type") == "response.done"]
    assert done and done[-1]["response"]["status"] == "completed", done
    assert audio_samples > 0, types
    assert not client_errors(caplog, "livekit"), client_errors(caplog, "livekit")


async def test_livekit_openai_realtime_model_function_tool_round_trip(server, caplog):
    """RealtimeModel with a function tool: generate_reply(tool_choice="required") yields
    the call on the generation's function stream (arguments valid for the tool's
    schema), its output goes back through update_chat_ctx, and the next reply is spoken."""
    caplog.set_level(logging.WARNING)
    lk = _livekit()
    import json

    import aiohttp
    from livekit.agents import llm

    @llm.function_tool
    async def get_weather(city: Literal["Paris", "Lima"]) -> str:
        """The weather in a city."""
        return f"Sunny in {city}."

    async def drain(gen) -> tuple[list, int]:
        calls: list = []
        samples = 0

        async def functions() -> None:
            async for fc in gen.function_stream:
                calls.append(fc)

        task = asyncio.create_task(functions())
        async for msg in gen.message_stream:
            async for frame in msg.audio_stream:
                samples += frame.samples_per_channel
        await task
        return calls, samples

    async with aiohttp.ClientSession() as http:
        model, sess, errors, server_events = _livekit_session(lk, server, http)
        try:
            await sess.update_tools([get_weather])
            ctx = sess.chat_ctx.copy()
            ctx.add_message(role="user", content="What is the weather in Lima?")
            await sess.update_chat_ctx(ctx)
            gen = await asyncio.wait_for(sess.generate_reply(tool_choice="required"), 20)
            calls, samples = await asyncio.wait_for(drain(gen), TURN_TIMEOUT_S)
            assert len(calls) == 1 and samples == 0, (calls, samples)  # a pure call says nothing
            fc = calls[0]
            assert fc.name == "get_weather" and json.loads(fc.arguments)["city"] in ("Paris", "Lima"), fc
            ctx = sess.chat_ctx.copy()
            ctx.items.append(llm.FunctionCallOutput(call_id=fc.call_id, name=fc.name, output="Sunny in Lima.", is_error=False))
            await sess.update_chat_ctx(ctx)
            gen = await asyncio.wait_for(sess.generate_reply(tool_choice="none"), 20)
            calls, samples = await asyncio.wait_for(drain(gen), TURN_TIMEOUT_S)
        finally:
            await sess.aclose()
            await model.aclose()
    assert not errors, (errors, [e for e in server_events if e.get("type") == "error"], server_log_tail(server))
    assert not calls and samples > 0  # the answer to the result, out loud
    outputs = [e for e in server_events if e.get("type") == "conversation.item.added" and e["item"]["type"] == "function_call_output"]
    assert outputs and outputs[0]["item"]["call_id"] == fc.call_id
    assert not client_errors(caplog, "livekit"), client_errors(caplog, "livekit")


async def test_livekit_openai_realtime_model_sees_an_image_in_the_chat_context(server, caplog):
    """An agent with vision: a user message with an image in the chat context
    (ImageContent, a data URL) and a camera frame pushed with push_video (LiveKit encodes
    it as JPEG), then generate_reply: both images reach the thinker (the usage counts
    their tokens) and the answer is spoken."""
    caplog.set_level(logging.WARNING)
    lk = _livekit()
    import base64
    import io

    import aiohttp
    import numpy as np
    from livekit import rtc
    from livekit.agents import llm
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(2).random((120, 160, 3)) * 255).astype(np.uint8)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    frame = rtc.VideoFrame(64, 48, rtc.VideoBufferType.RGBA, np.full((48, 64, 4), 200, np.uint8).tobytes())
    async with aiohttp.ClientSession() as http:
        model, sess, errors, server_events = _livekit_session(lk, server, http)
        try:
            ctx = sess.chat_ctx.copy()
            ctx.add_message(role="user", content=["What is in this picture?", llm.ImageContent(image=url)])
            await sess.update_chat_ctx(ctx)
            sess.push_video(frame)
            gen = await asyncio.wait_for(sess.generate_reply(), 20)
            samples = 0

            async def consume() -> None:
                nonlocal samples
                async for msg in gen.message_stream:
                    async for f in msg.audio_stream:
                        samples += f.samples_per_channel

            await asyncio.wait_for(consume(), TURN_TIMEOUT_S)
        finally:
            await sess.aclose()
            await model.aclose()
    assert not errors, (errors, [e for e in server_events if e.get("type") == "error"], server_log_tail(server))
    images = [c for e in server_events if e.get("type") == "conversation.item.added"
              for c in e["item"].get("content", []) if c.get("type") == "input_image"]
    assert len(images) == 2 and images[0]["image_url"] == url and images[1]["image_url"].startswith("data:image/jpeg;base64,")
    done = [e for e in server_events if e.get("type") == "response.done"]
    assert done and done[-1]["response"]["status"] == "completed", done
    details = done[-1]["response"]["usage"]["input_token_details"]
    assert details["image_tokens"] > 0 and details["text_tokens"] > 0, details
    assert samples > 0
    assert not client_errors(caplog, "livekit"), client_errors(caplog, "livekit")


# ----------------------------------------------------------------------------- litellm


def _litellm():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list
    return importlib.import_module("litellm")  # installed by `make install` (a missing one fails, not skips)


async def test_litellm_aspeech(server):
    litellm = _litellm()
    resp = await litellm.aspeech(model=f"openai/{TTS_MODEL}", api_base=f"{server.url}/v1", api_key=ALICE_KEY, voice="alloy", input=TEXT)
    data = resp.content
    assert len(data) > 100
    assert data[:3] == b"ID3" or (data[0] == 0xFF and data[1] & 0xE0 == 0xE0), data[:8]  # mp3, the default format


async def test_litellm_acompletion(server):
    litellm = _litellm()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
    r = await litellm.acompletion(model=f"openai/{CHAT_MODEL}", api_base=f"{server.url}/v1", api_key=ALICE_KEY, messages=messages, max_tokens=16)
    assert r.choices[0].finish_reason == "length"  # the test server's answers run to max_tokens
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 16


async def test_litellm_acompletion_stream(server):
    litellm = _litellm()
    messages = [{"role": "user", "content": "Hello there!"}]
    stream = await litellm.acompletion(
        model=f"openai/{CHAT_MODEL}", api_base=f"{server.url}/v1", api_key=ALICE_KEY, messages=messages, max_tokens=16, stream=True
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) > 1 and text
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)


async def test_litellm_acompletion_with_tools_round_trip(server):
    litellm = _litellm()
    import json

    tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}}, "required": ["city"]}}}
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    kw = {"model": f"openai/{CHAT_MODEL}", "api_base": f"{server.url}/v1", "api_key": ALICE_KEY, "tools": [tool]}
    r = await litellm.acompletion(messages=messages, tool_choice="required", parallel_tool_calls=False, **kw)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Lima")
    messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "Sunny."}]
    r2 = await litellm.acompletion(messages=messages, tool_choice="none", max_tokens=8, **kw)
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls


async def test_litellm_realtime_client_secret_opens_a_realtime_socket(server):
    """litellm's POST /v1/realtime/client_secrets (the ephemeral key a browser or phone
    client then connects with)."""
    litellm = _litellm()
    from openai import AsyncOpenAI

    resp = await litellm.acreate_realtime_client_secret(
        model=f"openai/{REALTIME_MODEL}", api_base=server.url, api_key=ALICE_KEY, session={"type": "realtime", "model": REALTIME_MODEL}
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    secret = body["value"]
    assert secret and secret != ALICE_KEY and body["expires_at"] > 0, body
    rt = AsyncOpenAI(base_url=f"{server.url}/v1", websocket_base_url=f"ws://127.0.0.1:{server.port}/v1", api_key=secret)
    async with rt.realtime.connect(model=REALTIME_MODEL) as conn:
        created = await asyncio.wait_for(conn.recv(), 30)
    assert created.type == "session.created"


def test_the_voice_agent_tools_example_runs_its_round_trip(server, tmp_path):
    """examples/voice_agent_tools.py as a user runs it: the tool runs, the answer is spoken."""
    import subprocess
    import sys
    import wave
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "voice_agent_tools.py"
    out = tmp_path / "answer.wav"
    p = subprocess.run([sys.executable, str(example), "--url", f"{ws_url(server)}?model={REALTIME_MODEL}", "--api-key", ALICE_KEY,
                        "--city", "Oslo", "--out", str(out), "--timeout", "90"], capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, (p.stdout, p.stderr[-3000:], server_log_tail(server))
    assert "tool: get_weather(city=" in p.stdout
    with wave.open(str(out)) as w:
        assert w.getframerate() == 24000 and w.getnframes() > 0
