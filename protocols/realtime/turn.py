"""semantic_vad: an end-of-turn model decides when the user has finished, not a silence.

Voice activity (silero, or a test's fake) still decides speech from non-speech. With
`semantic_vad` it is asked for a short pause only (`PAUSE_MS`; a second at low
eagerness); at each pause the end-of-turn model hears the turn's audio (its last 8 s)
and says how likely the user is done.
At or over the eagerness's threshold the turn ends at the pause (`speech_stopped` at
the end of the speech); under it the turn stays open: the model is asked again after
each `RECHECK_MS` more of silence (a finished sentence followed by a longer silence
reads as finished; a hesitation, "to, um,", stays open), speech that resumes continues
the same turn (no second `speech_started`), and a silence that lasts the eagerness's
longest wait (OpenAI's 2 / 4 / 8 s for high / medium / low) ends it anyway.

The model is Smart Turn v3 (a Whisper-tiny encoder with a classifier, BSD-2, 23
languages; pipecat's default end-of-turn detector), run with onnxruntime from the ONNX
the `pipecat-ai` wheel ships (`server.turn_model`: that file by default, or a path; no
download at run time). Features are Whisper's log-mel over the last 8 s at 16 kHz,
from transformers' `WhisperFeatureExtractor`. One model serves every session of the
process: the decisions that arrive while a batch runs go together in the next one, so
many sessions pausing at once cost one batched call, not one call each.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from protocols.realtime.models import RATE, TurnDetection
from protocols.realtime.vad import VoiceActivity

__all__ = ["EAGERNESS", "PAUSE_MS", "SemanticVad", "SmartTurn", "TurnModel", "smart_turn_path"]

log = logging.getLogger("protocols.realtime.turn")

# silence after speech at which the model is first asked (the voice-activity detector's
# silence_duration_ms under semantic_vad), but at low eagerness
PAUSE_MS = 200
# eagerness -> (probability of a finished turn that ends it, the silence before the model
# is first asked, the longest silence waited for when it says the user is not done):
# low lets the caller take their time (a second of silence before any end of turn)
EAGERNESS: dict[str, tuple[float, int, int]] = {
    "high": (0.3, PAUSE_MS, 2000), "medium": (0.5, PAUSE_MS, 4000), "auto": (0.5, PAUSE_MS, 4000), "low": (0.7, 1000, 8000),
}
# while the model says "not done", it is asked again after each this much more silence
RECHECK_MS = 300
MODEL_RATE = 16000
WINDOW_S = 8  # the model hears the turn's last 8 s
BEFORE_SPEECH_MS = 500  # and up to this much audio before the turn's speech started
MAX_BATCH = 64


class TurnModel(Protocol):
    def complete(self, audio16k: np.ndarray) -> float:
        """The probability that the user has finished their turn, from the turn's audio
        (float32 mono, 16 kHz). Blocks (called from a VAD's worker thread)."""
        ...


def smart_turn_path(setting: str | None) -> Path | None:
    """The ONNX file `server.turn_model` names: None for "none", the `pipecat-ai` wheel's
    Smart Turn v3 for "smart-turn-v3" (None when that wheel is not installed), else the
    path given (which must exist)."""
    if setting is None or setting == "none":
        return None
    if setting == "smart-turn-v3":
        spec = find_spec("pipecat")  # located, not imported
        if spec is None or not spec.submodule_search_locations:
            return None
        data = Path(next(iter(spec.submodule_search_locations))) / "audio" / "turn" / "smart_turn" / "data"
        found = sorted(data.glob("smart-turn-v3*.onnx"))
        return found[-1] if found else None
    path = Path(setting).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"server.turn_model: no ONNX file at {path}")
    return path


class SmartTurn:
    """Smart Turn v3 on onnxruntime, one instance per process, batched across sessions."""

    def __init__(self, path: Path, threads: int = 1) -> None:
        self.path = path
        self.threads = threads
        self._session: Any = None
        self._features: Any = None
        self._loaded = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[np.ndarray, concurrent.futures.Future[float]]] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._start = threading.Lock()
        self.batches = 0  # calls made, and the decisions they carried (read by the bench)
        self.decisions = 0
        self.last_batch_s = 0.0

    def load(self) -> None:
        """Open the ONNX and the feature extractor (once; ~0.2 s)."""
        with self._loaded:
            if self._session is not None:
                return
            import onnxruntime as ort
            from transformers import WhisperFeatureExtractor

            so = ort.SessionOptions()
            so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            so.inter_op_num_threads = 1
            so.intra_op_num_threads = self.threads
            self._features = WhisperFeatureExtractor(chunk_length=WINDOW_S)
            self._session = ort.InferenceSession(str(self.path), sess_options=so, providers=["CPUExecutionProvider"])

    def predict(self, clips: Sequence[np.ndarray]) -> np.ndarray:
        """Probabilities of a finished turn for `clips` (16 kHz float32), in one call."""
        self.load()
        n = WINDOW_S * MODEL_RATE
        # the last 8 s of each, silence before a shorter one (the model was trained so)
        fixed = [np.pad(c[-n:], (max(0, n - len(c)), 0)).astype(np.float32) for c in clips]
        feats = self._features(fixed, sampling_rate=MODEL_RATE, return_tensors="np", padding="max_length",
                               max_length=n, truncation=True, do_normalize=True).input_features
        out = self._session.run(None, {"input_features": feats.astype(np.float32)})[0]
        return np.asarray(out, np.float32).reshape(len(clips))

    def complete(self, audio16k: np.ndarray) -> float:
        fut: concurrent.futures.Future[float] = concurrent.futures.Future()
        self._queue.put((audio16k, fut))
        self._ensure_worker()
        return fut.result()

    def _ensure_worker(self) -> None:
        if self._worker is not None:
            return
        with self._start:
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, name="smart-turn", daemon=True)
                self._worker.start()

    def _serve(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < MAX_BATCH:  # what arrived while the last batch ran goes together
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            t0 = time.perf_counter()
            try:
                probs = self.predict([a for a, _ in batch])
            except Exception as exc:  # noqa: BLE001 - each waiting session hears the failure
                for _, fut in batch:
                    fut.set_exception(exc)
                continue
            self.last_batch_s = time.perf_counter() - t0
            self.batches += 1
            self.decisions += len(batch)
            for (_, fut), p in zip(batch, probs, strict=True):
                fut.set_result(float(p))


_MODELS: dict[Path, SmartTurn] = {}
_MODELS_LOCK = threading.Lock()


def shared_smart_turn(path: Path) -> SmartTurn:
    """The process's model for `path`, loaded on the first call (a server's start-up:
    ~0.3 s, in the calling thread — importing transformers from a second thread while
    the start-up imports it too can fail)."""
    with _MODELS_LOCK:
        m = _MODELS.get(path)
        if m is None:
            m = _MODELS[path] = SmartTurn(path)
            m.load()
        return m


class SemanticVad:
    """A voice-activity detector whose turn ends when the end-of-turn model says so.

    Under `server_vad` it is the detector it wraps. Under `semantic_vad` the wrapped
    detector ends speech after `PAUSE_MS` of silence and the model decides whether the
    turn ended there (see the module's doc). Events are ("start" | "stop", ms) on the
    audio timeline, as the wrapped detector's."""

    def __init__(self, inner: VoiceActivity, model: TurnModel | None, on_decision: Callable[[float, bool], None] | None = None) -> None:
        import soxr

        self.inner = inner
        self.model = model
        self.on_decision = on_decision  # (probability, ended) of each decision: metrics, tests
        self.resampler = soxr.ResampleStream(RATE, MODEL_RATE, 1, dtype="float32")
        self.audio: np.ndarray | None = None  # the last 8.5 s heard at 16 kHz: a ring, allocated under semantic_vad
        self.end = 0  # the ring's write position (the oldest sample is there)
        self.pos_ms = 0.0  # audio pushed so far
        self.turn_start_ms: int | None = None  # the open turn's speech start
        self.held_ms: int | None = None  # where the speech paused while the model said "not done"
        self.ask_at_ms = 0.0  # while held: when the model is asked again

    def push(self, pcm: np.ndarray, td: TurnDetection) -> list[tuple[str, int]]:
        if td.type != "semantic_vad" or self.model is None:
            # no model: semantic_vad runs on its eagerness's silence (TurnDetection's)
            held = [self._end(self.held_ms)] if self.held_ms is not None else []  # switched away while a turn waited
            self.turn_start_ms = None
            return held + self.inner.push(pcm, td)
        x = self.resampler.resample_chunk(pcm)
        self._keep(x)
        self.pos_ms += len(pcm) * 1000 / RATE
        threshold, pause_ms, longest_ms = EAGERNESS.get(td.eagerness, EAGERNESS["auto"])
        out: list[tuple[str, int]] = []
        for kind, at_ms in self.inner.push(pcm, replace(td, silence_duration_ms=pause_ms)):
            if kind == "start":
                if self.held_ms is not None:
                    self.held_ms = None  # the user goes on: the same turn
                elif self.turn_start_ms is None:
                    self.turn_start_ms = at_ms
                    out.append(("start", at_ms))
                continue
            if self.turn_start_ms is None:  # a turn that began before semantic_vad was set
                out.append(("stop", at_ms))
                continue
            if self._ask(threshold):
                out.append(self._end(at_ms))
            else:
                self.held_ms, self.ask_at_ms = at_ms, self.pos_ms + RECHECK_MS
        if self.held_ms is not None:
            if self.pos_ms >= self.ask_at_ms:
                # asked again as the silence grows: a finished sentence followed by more
                # silence reads as finished, a hesitation ("to, um,") stays open
                if self._ask(threshold):
                    out.append(self._end(self.held_ms))
                    return out
                self.ask_at_ms = self.pos_ms + RECHECK_MS
            if self.pos_ms - self.held_ms >= longest_ms:
                out.append(self._end(self.held_ms))  # silent for the longest wait: done anyway
        return out

    def _ask(self, threshold: float) -> bool:
        assert self.model is not None
        try:
            p = self.model.complete(self._turn_audio())
        except Exception:  # noqa: BLE001 - a broken model must not break the caller's turn taking
            log.exception("the end-of-turn model failed: this session's semantic_vad ends turns on its eagerness's silence from now on")
            self.model = None
            return True  # the pause it was asked at ends the turn
        ended = p >= threshold
        if self.on_decision is not None:
            self.on_decision(p, ended)
        return ended

    def _end(self, at_ms: int) -> tuple[str, int]:
        self.turn_start_ms = self.held_ms = None
        return ("stop", at_ms)

    def _turn_audio(self) -> np.ndarray:
        """The audio since the turn's speech started (and a little before), at most 8 s."""
        assert self.turn_start_ms is not None
        ms = min(self.pos_ms - self.turn_start_ms + BEFORE_SPEECH_MS, WINDOW_S * 1000)
        n = int(ms * MODEL_RATE / 1000)
        assert self.audio is not None
        ring = np.concatenate([self.audio[self.end :], self.audio[: self.end]])  # oldest first
        return ring[-n:]

    def _keep(self, x: np.ndarray) -> None:
        """Write `x` into the ring (no copy of the whole window per piece of audio)."""
        if self.audio is None:
            self.audio = np.zeros((WINDOW_S * 1000 + BEFORE_SPEECH_MS) * MODEL_RATE // 1000, np.float32)
        size = len(self.audio)
        x = x[-size:]
        first = min(len(x), size - self.end)
        self.audio[self.end : self.end + first] = x[:first]
        self.audio[: len(x) - first] = x[first:]
        self.end = (self.end + len(x)) % size
