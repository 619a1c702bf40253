"""Every example overlay under examples/deploy/ served, as written but for its model
paths and its devices (cuda -> cpu), and asked one request with the client a user
would use.

The directories the overlays name are laid out as their hub repos are: the
Qwen2.5-Omni (7B, 3B), Qwen3-Omni and hf-moshiko ones by `tests.hub` (transformers'
own classes, the repos' files, config keys, dtypes, token ids and speakers, shrunk),
π0 and PaliGemma's by `testkit.pi0_hub`; the rest (Whisper, Orpheus, SNAC, the chat LM,
Wan, LTX, SkyReels-V2) are the tiny checkpoints. The dtypes are the overlay's and the
checkpoint's own (bfloat16 where they say so; a real-time torch stage on this CPU
computes in float32, as the server says when it starts). Pipelines the overlay does
not name and that share no stage with it stay at their tiny defaults elsewhere in the
suite; here they are switched off so that each server starts in seconds.

What each answer must be:
- a voice agent (openai SDK realtime, server VAD, a spoken question): a completed
  response whose transcript is the text streamed, with audio whose length the answer's
  tokens bound (Qwen2.5-Omni's talker reads one row per thinker token: at most
  base + 12 codes a token of 20 ms; Qwen3-Omni: 6 + 3 frames a token of 80 ms);
- Orpheus' speech (openai SDK speech), when the overlay serves it;
- the full-duplex model (`clients.duplex`): its voice while the user speaks, and its text
  stream as Kyutai's servers render it (word spaces, no control pieces);
- π0 (openpi-client): an action chunk of the layout's shape, finite;
- a video job (openai SDK videos): an MP4 that decodes; live video: frames.
"""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from testkit.harness import silence, speech_pcm16
from tests.conftest import start_server
from tests.test_realtime import append, until

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "deploy"
OVERLAYS = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
PIPELINES = ("voice", "tts", "asr", "image", "world", "video", "video_edit", "robot", "moshi")
# the tiny checkpoints standing in for the repos no hub-shaped builder writes
TINY = {"whisper-large-v3-turbo": "tiny-whisper", "orpheus-3b-0.1-ft": "tiny-orpheus-talker", "snac_24khz": "tiny-snac-24khz",
        "Llama-3.2-3B-Instruct": "tiny-qwen2-thinker", "Wan2.1-T2V-1.3B-Diffusers": "tiny-wan", "LTX-Video": "tiny-ltx",
        "SkyReels-V2-DF-1.3B-540P-Diffusers": "tiny-skyreels-df"}
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hub")


def model_dir(name: str, root: Path, models_dir: Path) -> Path:
    from testkit.pi0_hub import paligemma_processor, pi0_dir
    from tests import hub

    if name in hub.NAMES:
        return hub.build(name, root)
    if name in TINY:
        return models_dir / TINY[name]
    d = root / name
    if not d.is_dir():
        if name == "paligemma2-3b-mix-224":
            paligemma_processor(d)
        elif name in ("pi0_base", "pi0-droid"):  # π0 base: transformers' layout; the DROID fine-tune: lerobot's, with its statistics
            pi0_dir(d, models_dir / "tiny-pi0", "transformers" if name == "pi0_base" else "lerobot")
        else:
            raise AssertionError(f"no directory for {name}")
    return d


def materialise(name: str, root: Path, models_dir: Path) -> dict[str, Any]:
    """The overlay with its /models/<repo> paths pointing at directories laid out as the
    repos are and its devices on the CPU; nothing else of it changed."""
    text = (EXAMPLES / name).read_text()
    for repo in sorted(set(re.findall(r"/models/([\w.\-]+)", text))):
        text = text.replace(f"/models/{repo}", str(model_dir(repo, root, models_dir)))
    overlay = yaml.safe_load(text)
    for pipeline in overlay["pipelines"].values():
        for stage in (pipeline.get("stages") or {}).values():
            args = stage.get("engine_args") or {}
            if str(args.get("device", "")).startswith("cuda"):
                args["device"] = "cpu"
    named = set(overlay["pipelines"])
    # the asr pipeline shares the voice pipeline's asr stage; tts its talker and code2wav
    related = {"asr", "tts"} if "voice" in named and overlay["pipelines"]["voice"].get("enabled", True) else set()
    for p in PIPELINES:
        if p not in named and p not in related:
            overlay["pipelines"][p] = {"enabled": False}
    return overlay


@pytest.fixture
def served(request: pytest.FixtureRequest, hub_root: Path, models_dir: Path, tmp_path: Path) -> Any:
    overlay = materialise(request.param, hub_root, models_dir)
    proc = start_server(overlay, tmp_path, models_dir)
    proc.overlay = overlay
    proc.name = request.param
    try:
        yield proc
    finally:
        proc.stop()


def _sdk(server: Any) -> Any:
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{server.url}/v1", websocket_base_url=f"ws://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)


async def spoken_turn(server: Any) -> tuple[Any, np.ndarray]:
    speech = speech_pcm16("Hello, can you tell me what the weather is like today?")
    async with _sdk(server).realtime.connect(model="gpt-realtime") as conn:
        assert (await conn.recv()).type == "session.created"
        await conn.session.update(session={"type": "realtime", "max_output_tokens": MAX_TOKENS})
        assert (await conn.recv()).type == "session.updated"
        await append(conn, silence(0.6) + speech + silence(1.0), chunk=4800)
        seen: list = []
        done = await until(conn, "response.done", seen)
    assert done.response.status == "completed", done.response.status_details
    audio = np.frombuffer(b"".join(base64.b64decode(e.delta) for e in seen if e.type == "response.output_audio.delta"), "<i2")
    transcript = "".join(e.delta for e in seen if e.type == "response.output_audio_transcript.delta")
    assert transcript == done.response.output[0].content[0].transcript
    return done.response, audio


VOICE = ["qwen2.5-omni-voice.yaml", "qwen3-omni.yaml", "qwen2.5-omni.yaml", "cascade.yaml"]


@pytest.mark.parametrize("served", VOICE, indirect=True)
async def test_voice_overlays_answer_a_spoken_turn(served: Any) -> None:
    response, audio = await spoken_turn(served)
    assert len(audio) > 0
    print(f"{served.name}: {len(audio)} samples, usage {response.usage}")
    assert 0 < response.usage.output_tokens
    profile = served.overlay["pipelines"]["voice"]["profile"]
    if profile == "omni":
        # 480 samples a code; the talker's budget: 25 codes + 12 a reply token (the
        # thinker's own ids: re-encoding the detokenized text made many more rows)
        assert len(audio) % 480 == 0 and len(audio) <= 480 * (25 + 12 * MAX_TOKENS), len(audio)
    elif profile == "omni3":
        assert len(audio) <= 1920 * (6 + 3 * MAX_TOKENS + 1), len(audio)
    if served.overlay["pipelines"].get("tts", {}).get("enabled", True) and profile == "default":
        from openai import OpenAI

        client = OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)
        wav = client.audio.speech.create(model="tts-1", voice="alloy", input="Hello from the overlay.", response_format="pcm").content
        assert len(wav) > 4800


@pytest.mark.parametrize("served", ["moshiko.yaml"], indirect=True)
async def test_the_full_duplex_overlay_talks_and_writes_text_as_kyutai_renders_it(served: Any, tmp_path: Path, capsys: Any) -> None:
    from clients.duplex import _main
    from clients.realtime import read_wav_pcm16, write_wav_pcm16

    write_wav_pcm16(str(tmp_path / "q.wav"), speech_pcm16("Hello, can you hear me? Tell me about your day."))
    url = served.url.replace("http://", "ws://") + "/v1/duplex"
    rc = await _main(["--url", url, "--in", str(tmp_path / "q.wav"), "--out", str(tmp_path / "a.wav")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    heard = np.frombuffer(read_wav_pcm16(str(tmp_path / "a.wav")), "<i2")
    assert len(heard) > 24000
    text = out.strip()
    assert text, (out, err)
    # the text stream: pieces joined with their word spaces, no SentencePiece markers,
    # no control pieces (Moshi writes its padding on most frames)
    assert "\u2581" not in text and not re.search(r"<(s|/s|pad|unk)>", text), text
    assert " " in text.strip(), text


@pytest.mark.parametrize("served", ["pi0.yaml", "pi0-droid.yaml"], indirect=True)
def test_the_policy_overlays_answer_openpi_client(served: Any) -> None:
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    from clients.openpi import aloha_observation, droid_observation
    from pipelines.tiny.pi0 import IMAGE_SIZE

    droid = served.name == "pi0-droid.yaml"
    client = WebsocketClientPolicy(served.host, served.port)
    try:
        meta = client.get_server_metadata()
        dims = 8 if droid else 14
        assert meta["action_dim"] == dims
        obs = (droid_observation if droid else aloha_observation)(0, size=IMAGE_SIZE)
        actions = client.infer(obs)["actions"]
        assert actions.shape[1] == dims and np.isfinite(actions).all()
    finally:
        client._ws.close()


@pytest.mark.parametrize("served", ["wan2.1-t2v.yaml", "ltx-video.yaml"], indirect=True)
def test_the_video_job_overlays_make_a_clip(served: Any) -> None:
    import time

    import av
    import openai

    c = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0)
    v = c.videos.create(model="sora-2", prompt="a paper boat on a pond", seconds="4", size="64x64")  # type: ignore[arg-type]
    deadline = time.monotonic() + 600
    while v.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.5)
        v = c.videos.retrieve(v.id)
    assert v.status == "completed", v
    data = c.videos.download_content(v.id).read()
    with av.open(io.BytesIO(data)) as f:
        frames = [fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)]
    assert frames and frames[0].shape[2] == 3


@pytest.mark.parametrize("served", ["skyreels-v2-df.yaml"], indirect=True)
async def test_the_live_video_overlay_streams_frames(served: Any) -> None:
    from clients.video import LiveVideo

    live = await LiveVideo.connect(served.url.replace("http://", "ws://") + "/v1/realtime/video")
    try:
        await live.send("session.update", session={"prompt": "a forest path", "width": 64, "height": 64, "steps": 2, "seed": 1})
        await live.send("generation.start", frames=8)
        seen: list[dict[str, Any]] = []
        done = await live.until({"generation.done", "error"}, seen, timeout=300)
        assert done["type"] == "generation.done", done
        frames = [e for e in seen if e["type"] == "video.frame"]
        assert frames, [e["type"] for e in seen]
    finally:
        await live.close()


def test_every_example_overlay_is_served_here() -> None:
    """A new example overlay gets its request in this module."""
    covered = {"qwen2.5-omni-voice.yaml", "qwen3-omni.yaml", "qwen2.5-omni.yaml", "cascade.yaml", "moshiko.yaml", "pi0.yaml",
               "pi0-droid.yaml", "wan2.1-t2v.yaml", "ltx-video.yaml", "skyreels-v2-df.yaml"}
    assert set(OVERLAYS) == covered, set(OVERLAYS) ^ covered

