"""semantic_vad: the end-of-turn model decides at each pause whether the turn ended.

On the voice-activity fake (EnergyVad) with a scripted model; then the real Smart Turn v3
ONNX (the pipecat-ai wheel's) on espeak-ng speech, batched; then through /v1/realtime.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from protocols.realtime.models import RATE, TurnDetection, TurnDetectionIn
from protocols.realtime.turn import PAUSE_MS, SemanticVad, SmartTurn, smart_turn_path
from testkit import serve
from testkit.vad import EnergyVad
from testkit.wire import b64, connect, quiet, tone


class Scripted:
    """An end-of-turn model that answers from a script and keeps what it heard."""

    def __init__(self, *answers: float) -> None:
        self.answers = list(answers)
        self.heard: list[np.ndarray] = []

    def complete(self, audio16k: np.ndarray) -> float:
        self.heard.append(audio16k)
        return self.answers.pop(0) if self.answers else 0.0


class ByLength(Scripted):
    """"Done" once the turn it hears is at least `seconds` long (the second pause)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def complete(self, audio16k: np.ndarray) -> float:
        self.heard.append(audio16k)
        return 0.9 if len(audio16k) >= self.seconds * 16000 else 0.1


def loud(s: float) -> np.ndarray:
    return (0.3 * np.sin(np.arange(int(s * RATE)) * 2 * np.pi * 220 / RATE)).astype(np.float32)


def still(s: float) -> np.ndarray:
    return np.zeros(int(s * RATE), np.float32)


def feed(vad: SemanticVad, audio: np.ndarray, td: TurnDetection, step_ms: int = 20) -> list[tuple[str, int, int]]:
    """Push in `step_ms` pieces: (event, its ms, the ms pushed when it came)."""
    out, n = [], step_ms * RATE // 1000
    for i in range(0, len(audio), n):
        for kind, ms in vad.push(audio[i : i + n], td):
            out.append((kind, ms, (i + n) * 1000 // RATE))
    return out


SEMANTIC = TurnDetectionIn(type="semantic_vad", eagerness="auto").settings()


def test_a_pause_the_model_hears_as_unfinished_keeps_the_turn_open():
    model = ByLength(2.0)  # "not done" at the first pause, "done" at the second
    vad = SemanticVad(EnergyVad(), model)
    events = feed(vad, np.concatenate([still(0.2), loud(0.5), still(0.6), loud(0.5), still(0.6)]), SEMANTIC)
    # one turn: no second start when the user goes on, one stop at the end of the speech
    assert [(k, ms) for k, ms, _ in events] == [("start", 200), ("stop", 1800)]
    assert events[1][2] == 1800 + PAUSE_MS  # decided after the pause, not after 700 ms of silence
    # asked at the first pause and again 300 ms later (still "not done"), then at the second
    assert len(model.heard) == 3
    # it heard the turn: from 500 ms before its speech to the pause (16 kHz)
    assert len(model.heard[-1]) == pytest.approx((2000 - 200 + 500) * 16, abs=16 * 20)


def test_a_model_that_hears_the_silence_grow_ends_the_turn_before_the_longest_wait():
    """Asked again every 300 ms of silence: "done" at the third ask ends the turn there,
    at the end of the speech, long before the 4 s wait."""
    model = Scripted(0.1, 0.2, 0.8)
    events = feed(SemanticVad(EnergyVad(), model), np.concatenate([loud(0.5), still(3.0)]), SEMANTIC)
    assert [(k, ms) for k, ms, _ in events] == [("start", 0), ("stop", 500)]
    assert events[1][2] == 500 + PAUSE_MS + 2 * 300 and len(model.heard) == 3


def test_the_longest_wait_ends_a_turn_the_model_never_calls_finished():
    for eagerness, longest in (("high", 2000), ("auto", 4000), ("low", 8000)):
        td = TurnDetectionIn.model_validate({"type": "semantic_vad", "eagerness": eagerness}).settings()
        events = feed(SemanticVad(EnergyVad(), Scripted()), np.concatenate([loud(0.5), still(9.0)]), td)
        assert [(k, ms) for k, ms, _ in events] == [("start", 0), ("stop", 500)]
        assert events[1][2] == 500 + longest


def test_eagerness_is_the_models_threshold_and_low_waits_a_second_before_asking():
    for eagerness, p, ends in (("high", 0.35, True), ("auto", 0.35, False), ("auto", 0.55, True), ("low", 0.55, False), ("low", 0.75, True)):
        td = TurnDetectionIn.model_validate({"type": "semantic_vad", "eagerness": eagerness}).settings()
        model = Scripted(p)
        events = feed(SemanticVad(EnergyVad(), model), np.concatenate([loud(0.5), still(1.1)]), td)
        assert (("stop", 500) in [(k, ms) for k, ms, _ in events]) is ends, (eagerness, p)
        if ends:  # decided at the first ask: after 200 ms of silence, a second at low
            assert events[-1][2] == 500 + (1000 if eagerness == "low" else PAUSE_MS)


def test_server_vad_and_a_missing_model_use_the_silence():
    audio = np.concatenate([loud(0.5), still(0.4), loud(0.5), still(1.0)])
    model = Scripted(1.0, 1.0)
    server = feed(SemanticVad(EnergyVad(), model), audio, TurnDetection(silence_duration_ms=300))
    assert [k for k, _, _ in server] == ["start", "stop", "start", "stop"] and model.heard == []
    none = feed(SemanticVad(EnergyVad(), None), audio, SEMANTIC)  # semantic_vad's own silence: 700 ms
    assert [(k, ms) for k, ms, _ in none] == [("start", 0), ("stop", 1400)]
    assert none[1][2] == 1400 + SEMANTIC.silence_duration_ms


def test_a_failing_model_falls_back_to_the_silence_and_the_turn_still_ends(caplog):
    class Broken:
        def complete(self, audio16k):
            raise RuntimeError("onnxruntime: bad model")

    vad = SemanticVad(EnergyVad(), Broken())
    events = feed(vad, np.concatenate([loud(0.5), still(0.5), loud(0.5), still(1.0)]), SEMANTIC)
    # the first pause ends its turn; the next turn ends on semantic_vad's own silence (700 ms)
    assert [(k, ms) for k, ms, _ in events] == [("start", 0), ("stop", 500), ("start", 1000), ("stop", 1500)]
    assert events[-1][2] == 1500 + SEMANTIC.silence_duration_ms and vad.model is None
    assert "end-of-turn model failed" in caplog.text


def test_decisions_arriving_together_run_as_one_batch():
    class Timed(SmartTurn):
        def __init__(self) -> None:
            super().__init__(Path(__file__))  # predict is replaced: no file is read
            self.sizes: list[int] = []

        def predict(self, clips):
            self.sizes.append(len(clips))
            time.sleep(0.05)
            return np.array([len(c) / 16000 for c in clips], np.float32)

    m = Timed()
    got: dict[int, float] = {}

    def ask(i: int) -> None:
        got[i] = m.complete(np.zeros(16000 * (i + 1), np.float32))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {i: float(i + 1) for i in range(16)}  # each hears its own answer
    assert sum(m.sizes) == 16 and len(m.sizes) < 16 and max(m.sizes) > 1


# ---- the real model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def smart_turn():
    path = smart_turn_path("smart-turn-v3")
    assert path is not None, "the pipecat-ai wheel (and its Smart Turn v3 ONNX) is part of the test install"
    m = SmartTurn(path)
    m.load()
    return m


def _speech16(text: str) -> np.ndarray:
    from testkit.harness import speech_pcm16

    return np.frombuffer(speech_pcm16(text, 16000), "<i2").astype(np.float32) / 32768


def test_smart_turn_hears_a_finished_sentence_apart_from_one_cut_mid_way(smart_turn):
    done = _speech16("Please turn off the lights in the kitchen.")
    unfinished = _speech16("I would like to book a flight to, um,")  # a speaker hesitating mid-sentence
    pad = np.zeros(3200, np.float32)  # the 200 ms pause the model is asked at
    p_done, p_unfinished = smart_turn.predict([np.concatenate([done, pad]), np.concatenate([unfinished, pad])])
    assert p_done > 0.5 > p_unfinished, (p_done, p_unfinished)
    # batched and alone give the same answer
    alone = smart_turn.predict([np.concatenate([done, pad])])[0]
    assert alone == pytest.approx(p_done, abs=1e-4)


def test_bad_settings_name_the_file():
    with pytest.raises(FileNotFoundError, match="server.turn_model"):
        smart_turn_path("/nonexistent/turn.onnx")
    assert smart_turn_path("none") is None


# ---- through the wire -----------------------------------------------------------------------


async def test_semantic_vad_on_the_realtime_wire_keeps_a_paused_turn_whole():
    model = ByLength(2.0)
    async with serve(["voice"], turn_model=model) as h:
        ws = await connect(h, "/v1/realtime?model=gpt-realtime")
        await ws.until("session.created")
        await ws.send("session.update", session={"type": "realtime", "max_output_tokens": 4,
                                                 "audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "medium"}}}})
        assert (await ws.until("session.updated"))["session"]["audio"]["input"]["turn_detection"]["type"] == "semantic_vad"
        audio = quiet(0.4) + tone(0.6) + quiet(0.5) + tone(0.6) + quiet(0.5)
        for i in range(0, len(audio), 4800):
            await ws.send("input_audio_buffer.append", audio=b64(audio[i : i + 4800]))
        done = await ws.until("response.done")
        t = ws.types()
        assert t.count("input_audio_buffer.speech_started") == 1 and t.count("input_audio_buffer.speech_stopped") == 1
        assert t.count("input_audio_buffer.committed") == 1 and done["response"]["status"] == "completed"
        stopped = ws.seen[t.index("input_audio_buffer.speech_stopped")]
        assert 2090 <= stopped["audio_end_ms"] <= 2110
        assert len(model.heard) >= 2 and len(model.heard[-1]) >= 2 * 16000
        await ws.ws.close()



async def test_semantic_vad_on_the_duplex_wire_keeps_a_paused_turn_whole():
    from clients.duplex import DuplexClient

    model = ByLength(2.0)
    async with serve(["voice"], turn_model=model) as h:
        c = await DuplexClient.connect(h.url("/v1/duplex", ws=True))
        u = await c.update(max_output_tokens=4, audio={"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "high"}}})
        assert u["session"]["audio"]["input"]["turn_detection"]["type"] == "semantic_vad"
        await c.stream_audio(quiet(0.4) + tone(0.6) + quiet(0.5) + tone(0.6) + quiet(0.5), realtime=False)
        seen: list = []
        done = await c.until("response.done", seen)
        t = [e["type"] for e in seen]
        assert t.count("input_audio_buffer.speech_started") == 1 and t.count("input_audio_buffer.speech_stopped") == 1
        assert done["response"]["status"] == "completed" and len(model.heard) >= 2
        await c.close()
