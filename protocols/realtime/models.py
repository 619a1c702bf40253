"""The Realtime session configuration: what a session runs with (`Config`, a plain
struct), the wire models its client events are validated against (pydantic; the
first error becomes an OpenAI `error` whose `param` is the field path), and the
session object as each dialect shows it.

`session.update` takes either shape: GA (`audio.input.{format, turn_detection}`,
`audio.output.{format, voice, speed}`, `output_modalities`) or beta (flat `voice`,
`modalities`, `input_audio_format`, `turn_detection`, …). Unknown keys are ignored,
as the reference server does for fields it does not act on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from media.wire_audio import WireFormat, WireFormatError
from omni_rt.errors import ClientError
from protocols.http import validation_error
from protocols.tools import parse_tool_choice, parse_tools, realtime_choice_wire, realtime_tools_wire

RATE = 24000
PCM24 = WireFormat("pcm16", RATE)  # the model rate, and the Realtime API's default format


# ---- what a session runs with --------------------------------------------------------------


# semantic_vad's eagerness -> the silence that ends a turn (this server's end-of-turn
# detector is voice activity: a more eager setting ends the turn after less silence)
EAGERNESS_SILENCE_MS = {"high": 300, "medium": 700, "auto": 700, "low": 1500}


@dataclass(frozen=True)
class TurnDetection:
    """OpenAI's turn detection: server_vad settings, or semantic_vad's eagerness mapped
    onto them (EAGERNESS_SILENCE_MS)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    type: str = "server_vad"
    eagerness: str = "auto"  # semantic_vad only
    idle_timeout_ms: int | None = None  # server_vad only: silence after the answer played -> a response

    def wire(self) -> dict[str, Any]:
        common = {"create_response": self.create_response, "interrupt_response": self.interrupt_response}
        if self.type == "semantic_vad":
            return {"type": "semantic_vad", "eagerness": self.eagerness, **common}
        return {
            "type": "server_vad",
            "threshold": self.threshold,
            "prefix_padding_ms": self.prefix_padding_ms,
            "silence_duration_ms": self.silence_duration_ms,
            "idle_timeout_ms": self.idle_timeout_ms,
            **common,
        }


@dataclass(frozen=True)
class Truncation:
    """OpenAI's `truncation`: what happens when the conversation would pass the
    thinker's context. `auto`: the oldest whole turns are dropped until it fills at most
    `AUTO_RETAIN` of the context (room for the answer); `retention_ratio`: until it fills
    `ratio` of the limit (`post_instructions` tokens when given, which also triggers it,
    else the context), so truncations are rarer and the prompt's cached prefix lasts
    longer; `disabled`: the response fails with `context_length_exceeded`."""

    type: str = "auto"  # auto | disabled | retention_ratio
    ratio: float = 1.0
    post_instructions: int | None = None

    def wire(self) -> Any:
        if self.type != "retention_ratio":
            return self.type
        out: dict[str, Any] = {"type": "retention_ratio", "retention_ratio": self.ratio}
        if self.post_instructions is not None:
            out["token_limits"] = {"post_instructions": self.post_instructions}
        return out


AUTO_RETAIN = 0.9


@dataclass(frozen=True)
class Config:
    model: str
    voice: str = "alloy"
    instructions: str = ""
    audio_out: bool = True  # modalities include audio (else text only)
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    temperature: float = 0.8
    max_output_tokens: int | None = None
    speed: float = 1.0
    transcription: dict[str, Any] | None = None  # input transcription {model, language, prompt}; None: off
    transcription_only: bool = False  # a transcription session: utterances are transcribed, never answered
    tools: tuple[dict[str, Any], ...] = ()  # function tools, in the chat shape (protocols.tools)
    tool_choice: Any = "auto"  # auto | none | required | {"type": "function", "function": {"name"}}
    input_format: WireFormat = PCM24  # what the client's audio is in (decoded to the model rate)
    output_format: WireFormat = PCM24  # what the answer's audio goes out in
    truncation: Truncation = Truncation()

    def wire(self, ga: bool, session_id: str) -> dict[str, Any]:
        td = self.turn_detection.wire() if self.turn_detection else None
        limit: Any = self.max_output_tokens if self.max_output_tokens is not None else "inf"
        if self.transcription_only:
            if ga:
                return {"type": "transcription", "object": "realtime.transcription_session", "id": session_id,
                        "audio": {"input": {"format": self.input_format.ga(), "transcription": self.transcription, "noise_reduction": None, "turn_detection": td}},
                        "include": None}
            return {"id": session_id, "object": "realtime.transcription_session", "modalities": ["text"], "input_audio_format": self.input_format.beta(),
                    "input_audio_transcription": self.transcription, "turn_detection": td, "input_audio_noise_reduction": None}
        if ga:
            return {
                "type": "realtime",
                "object": "realtime.session",
                "id": session_id,
                "model": self.model,
                "output_modalities": ["audio"] if self.audio_out else ["text"],
                "instructions": self.instructions,
                "audio": {
                    "input": {"format": self.input_format.ga(), "transcription": self.transcription, "noise_reduction": None, "turn_detection": td},
                    "output": {"format": self.output_format.ga(), "voice": self.voice, "speed": self.speed},
                },
                "tools": realtime_tools_wire(self.tools),
                "tool_choice": realtime_choice_wire(self.tool_choice),
                "max_output_tokens": limit,
                "tracing": None,
                "truncation": self.truncation.wire(),
                "prompt": None,
                "include": None,
            }
        return {
            "id": session_id,
            "object": "realtime.session",
            "model": self.model,
            "modalities": ["text", "audio"] if self.audio_out else ["text"],
            "instructions": self.instructions,
            "voice": self.voice,
            "input_audio_format": self.input_format.beta(),
            "output_audio_format": self.output_format.beta(),
            "input_audio_transcription": self.transcription,
            "turn_detection": td,
            "tools": realtime_tools_wire(self.tools),
            "tool_choice": realtime_choice_wire(self.tool_choice),
            "temperature": self.temperature,
            "max_response_output_tokens": limit,
            "speed": self.speed,
        }


# ---- field types with the Realtime API's codes ----------------------------------------------


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", message)


def _audio_format(v: Any) -> WireFormat:
    """A Realtime audio format: PCM16 at 24 kHz, or G.711 μ-law / A-law at 8 kHz."""
    try:
        return WireFormat.parse_realtime(v, (RATE,))
    except WireFormatError as exc:
        raise _invalid(str(exc)) from None


def _modalities(v: Any) -> bool:
    if not isinstance(v, list) or not v or not all(m in ("text", "audio") for m in v):
        raise _invalid("Must be a list of 'text' / 'audio'.")
    return "audio" in v


def _temperature(v: Any) -> float:
    """OpenAI's realtime sampling temperature: a number in [0.6, 1.2]."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise PydanticCustomError("invalid_type", "Invalid type: expected a decimal.")
    if not 0.6 <= float(v) <= 1.2:
        raise _invalid(f"{v} is outside [0.6, 1.2].")
    return float(v)


def _max_tokens(v: Any) -> int | None:
    if v == "inf":
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 4096:
        raise _invalid("Must be an integer 1-4096 or 'inf'.")
    return v


def _number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise PydanticCustomError("invalid_type", "Must be a number.")
    return float(v)


METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


def _metadata(v: Any) -> dict[str, str] | None:
    """OpenAI's metadata: at most 16 string pairs (keys up to 64 characters, values up
    to 512)."""
    if v is None:
        return None
    if not isinstance(v, Mapping):
        raise PydanticCustomError("invalid_type", "Must be an object of string pairs.")
    if len(v) > METADATA_PAIRS:
        raise _invalid(f"At most {METADATA_PAIRS} pairs; got {len(v)}.")
    for k, val in v.items():
        if not isinstance(val, str):
            raise PydanticCustomError("invalid_type", f"The value of {k!r} must be a string.")
        if len(k) > METADATA_KEY_CHARS or len(val) > METADATA_VALUE_CHARS:
            raise _invalid(f"Keys are at most {METADATA_KEY_CHARS} characters and values at most {METADATA_VALUE_CHARS}.")
    return dict(v)


AudioFormat = Annotated[Any, AfterValidator(_audio_format)]  # -> WireFormat
Metadata = Annotated[Any, BeforeValidator(_metadata)]
AudioOut = Annotated[Any, BeforeValidator(_modalities)]  # modalities -> "audio is among them"
Temperature = Annotated[Any, BeforeValidator(_temperature)]
MaxTokens = Annotated[Any, BeforeValidator(_max_tokens)]
Number = Annotated[Any, BeforeValidator(_number)]


class WireModel(BaseModel):
    # no coercion of wrong JSON types; keys this server does not act on are ignored
    model_config = ConfigDict(strict=True, extra="ignore")


MIN_IDLE_MS, MAX_IDLE_MS = 1000, 600_000


class TurnDetectionIn(WireModel):
    type: Literal["server_vad", "semantic_vad"] = "server_vad"
    threshold: Number = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    eagerness: Literal["low", "medium", "high", "auto"] = "auto"  # semantic_vad
    idle_timeout_ms: int | None = None  # server_vad

    def settings(self) -> TurnDetection:
        if self.type == "semantic_vad":
            return TurnDetection(
                silence_duration_ms=EAGERNESS_SILENCE_MS[self.eagerness],
                create_response=self.create_response,
                interrupt_response=self.interrupt_response,
                type="semantic_vad",
                eagerness=self.eagerness,
            )
        if not 0.0 < self.threshold < 1.0:
            raise _FieldError("threshold", "Must be between 0 and 1.")
        if not 0 <= self.prefix_padding_ms <= 5000:
            raise _FieldError("prefix_padding_ms", "Must be 0-5000 ms.")
        if not 0 < self.silence_duration_ms <= 10000:
            raise _FieldError("silence_duration_ms", "Must be 1-10000 ms.")
        if self.idle_timeout_ms is not None and not MIN_IDLE_MS <= self.idle_timeout_ms <= MAX_IDLE_MS:
            raise _FieldError("idle_timeout_ms", f"Must be {MIN_IDLE_MS}-{MAX_IDLE_MS} ms, or null.")
        return TurnDetection(
            float(self.threshold), self.prefix_padding_ms, self.silence_duration_ms, self.create_response, self.interrupt_response,
            idle_timeout_ms=self.idle_timeout_ms,
        )


class TranscriptionIn(WireModel):
    """Input transcription: the model (any name: this server's asr stage does it), the
    language (ISO-639-1) and a prompt for it."""

    model: str | None = None
    language: str | None = Field(default=None, min_length=2, max_length=3)
    prompt: str | None = Field(default=None, max_length=4096)

    def settings(self) -> dict[str, Any]:
        return {"model": self.model or "whisper-1", "language": self.language, "prompt": self.prompt}


class AudioInputIn(WireModel):
    format: AudioFormat | None = None
    transcription: TranscriptionIn | None = None
    turn_detection: dict[str, Any] | None = None  # merged into the current settings; null: manual commits
    noise_reduction: Any = None  # refused unless null (none is applied)


class AudioOutputIn(WireModel):
    format: AudioFormat | None = None
    voice: str | None = None
    speed: Number | None = None


class AudioIn(WireModel):
    input: AudioInputIn | None = None
    output: AudioOutputIn | None = None


class TokenLimitsIn(WireModel):
    post_instructions: int | None = Field(default=None, ge=1)


class RetentionRatioIn(WireModel):
    type: Literal["retention_ratio"]
    retention_ratio: Number
    token_limits: TokenLimitsIn | None = None


def _truncation(raw: Any) -> Truncation:
    if raw in ("auto", "disabled"):
        return Truncation(raw)
    if isinstance(raw, str):
        raise ClientError(f"Invalid value: {raw!r}. Supported values are: 'auto', 'disabled' or a retention_ratio object.",
                          code="invalid_value", param="session.truncation")
    r = parse(RetentionRatioIn, raw, "session.truncation")
    if not 0.0 <= r.retention_ratio <= 1.0:
        raise ClientError("retention_ratio must be between 0 and 1.", code="invalid_value", param="session.truncation.retention_ratio")
    return Truncation("retention_ratio", float(r.retention_ratio), r.token_limits.post_instructions if r.token_limits else None)


class SessionUpdate(WireModel):
    """The body of `session.update` (either dialect's shape)."""

    type: Literal["realtime", "transcription"] | None = None  # GA: "transcription" makes it a transcription session

    voice: str | None = None
    instructions: str | None = None
    modalities: AudioOut | None = None
    output_modalities: AudioOut | None = None
    input_audio_format: AudioFormat | None = None
    output_audio_format: AudioFormat | None = None
    turn_detection: dict[str, Any] | None = None
    input_audio_transcription: TranscriptionIn | None = None
    temperature: Temperature | None = None
    max_response_output_tokens: MaxTokens | None = None
    max_output_tokens: MaxTokens | None = None
    audio: AudioIn | None = None
    tools: Any = None  # checked by protocols.tools (its errors name the field)
    tool_choice: Any = None
    truncation: Any = None  # "auto" | "disabled" | {type: retention_ratio, ...}
    input_audio_noise_reduction: Any = None  # refused unless null (none is applied)


class ResponseOverrides(WireModel):
    """`response.create {response: {...}}`: this response's own settings."""

    modalities: AudioOut | None = None
    output_modalities: AudioOut | None = None
    instructions: str | None = None
    voice: str | None = None
    max_output_tokens: MaxTokens | None = None
    max_response_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    metadata: Metadata | None = None
    tools: Any = None
    tool_choice: Any = None


class _FieldError(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field, message


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], raw: Any, prefix: str) -> M:
    """`raw` as `model`, or the Realtime error naming the first bad field under `prefix`."""
    if not isinstance(raw, Mapping):
        raise ClientError(f"'{prefix}' must be an object.", code="invalid_type", param=prefix)
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        raise validation_error(list(err.errors()), prefix, type_code="invalid_type") from None


def _given(m: BaseModel, name: str) -> bool:
    return name in m.model_fields_set


def voice_of(v: str, voices: Mapping[str, str], param: str) -> str:
    if v.lower() not in voices:
        raise ClientError(f"Unknown voice {v!r}; available: {', '.join(sorted(voices))}.", param=param)
    return v.lower()


def turn_detection(raw: dict[str, Any] | None, current: TurnDetection | None, param: str) -> TurnDetection | None:
    """A partial turn_detection object over the current settings (None: manual mode)."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ClientError(f"'{param}' must be an object or null.", code="invalid_type", param=param)
    kept: dict[str, Any] = {}
    if current is not None and raw.get("type", current.type) == current.type:
        # a partial update of the same kind keeps the other settings; a change of kind starts from its defaults
        kept = current.wire()
    merged = {**kept, **raw}
    td = parse(TurnDetectionIn, merged, param)
    try:
        return td.settings()
    except _FieldError as exc:
        raise ClientError(exc.message, param=f"{param}.{exc.field}") from None


def apply_update(cfg: Config, s: SessionUpdate, voices: Mapping[str, str]) -> Config:
    """A validated session.update applied to `cfg` (a new Config)."""
    changes: dict[str, Any] = {}
    if s.voice is not None:
        changes["voice"] = voice_of(s.voice, voices, "session.voice")
    if s.instructions is not None:
        changes["instructions"] = s.instructions
    for key in ("modalities", "output_modalities"):
        if getattr(s, key) is not None:
            changes["audio_out"] = getattr(s, key)
    if _given(s, "turn_detection"):
        changes["turn_detection"] = turn_detection(s.turn_detection, cfg.turn_detection, "session.turn_detection")
    if _given(s, "input_audio_transcription"):
        changes["transcription"] = s.input_audio_transcription.settings() if s.input_audio_transcription is not None else None
    if s.temperature is not None:
        changes["temperature"] = s.temperature
    if s.input_audio_format is not None:
        changes["input_format"] = s.input_audio_format
    if s.output_audio_format is not None:
        changes["output_format"] = s.output_audio_format
    for key in ("max_response_output_tokens", "max_output_tokens"):
        if _given(s, key):
            changes["max_output_tokens"] = getattr(s, key)
    if s.audio is not None:
        inp, out = s.audio.input, s.audio.output
        if inp is not None and inp.format is not None:
            changes["input_format"] = inp.format
        if out is not None and out.format is not None:
            changes["output_format"] = out.format
        if inp is not None and _given(inp, "transcription"):
            changes["transcription"] = inp.transcription.settings() if inp.transcription is not None else None
        if inp is not None and _given(inp, "turn_detection"):
            changes["turn_detection"] = turn_detection(inp.turn_detection, cfg.turn_detection, "session.audio.input.turn_detection")
        if out is not None and out.voice is not None:
            changes["voice"] = voice_of(out.voice, voices, "session.audio.output.voice")
        if out is not None and out.speed is not None:
            changes["speed"] = out.speed
    for where, value in (("session.input_audio_noise_reduction", s.input_audio_noise_reduction),
                         ("session.audio.input.noise_reduction", s.audio.input.noise_reduction if s.audio and s.audio.input else None)):
        if value is not None:
            raise ClientError(f"'{where}' is not supported by this server: no noise reduction is applied to the input audio. "
                              "Leave it out or set it to null.", code="invalid_value", param=where)
    if s.truncation is not None:
        changes["truncation"] = _truncation(s.truncation)
    if s.type is not None:
        changes["transcription_only"] = s.type == "transcription"
    tools = cfg.tools
    if _given(s, "tools"):
        tools = changes["tools"] = parse_tools(s.tools, "session.tools", nested=False)
    if _given(s, "tool_choice") or _given(s, "tools"):
        raw = s.tool_choice if _given(s, "tool_choice") else realtime_choice_wire(cfg.tool_choice)
        if not _given(s, "tool_choice") and isinstance(raw, dict) and raw["name"] not in {t["function"]["name"] for t in tools}:
            raw = "auto"  # what it named went away with the new tool list
        changes["tool_choice"] = parse_tool_choice(raw, tools, "session.tool_choice", nested=False)
    new = replace(cfg, **changes)
    if new.transcription_only and new.transcription is None:
        new = replace(new, transcription=DEFAULT_TRANSCRIPTION)
    return new


DEFAULT_TRANSCRIPTION: dict[str, Any] = {"model": "whisper-1", "language": None, "prompt": None}


def apply_session_update(cfg: Config, raw: Any, voices: Mapping[str, str]) -> Config:
    """Validate a session.update body (either shape) and apply it to `cfg`."""
    return apply_update(cfg, parse(SessionUpdate, raw, "session"), voices)
