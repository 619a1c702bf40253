"""The pages in a real browser: headless Chromium (Debian `chromium`, driven by
playwright) against `omni-rt serve` with the tiny defaults over https, with a
self-signed certificate made here for a name that is not localhost (`omni-rt.test`,
mapped to 127.0.0.1 inside Chromium): a browser grants the microphone only to a secure
page, which on any other host means https.

- the voice demo: a fake microphone playing espeak-ng speech calls the server over
  WebRTC; the page must receive RTP audio and measure a non-silent reply;
- the world page: key presses become `world.step` actions and change the frame;
- the live-video page: chunks play, an edit of the prompt changes the stream;
- the dashboard: shows a session the test opened.
Screenshots are saved (OMNI_RT_ARTIFACTS, default .cache/artifacts) and checked to be
non-blank."""

from __future__ import annotations

import os
import shutil
import wave
from pathlib import Path
from typing import Any

import pytest

from testkit.harness import ADMIN_KEY, SERVER_OVERLAY, silence, speech_pcm16
from tests.tls import self_signed

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
HOST = "omni-rt.test"
FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--allow-loopback-in-peer-connection",
    "--use-fake-device-for-media-stream",
    "--use-fake-ui-for-media-stream",
    "--autoplay-policy=no-user-gesture-required",
    "--disable-features=WebRtcHideLocalIpsWithMdns",
    f"--host-resolver-rules=MAP {HOST} 127.0.0.1",
]
SHOTS = Path(os.environ.get("OMNI_RT_ARTIFACTS", REPO / ".cache" / "artifacts"))


@pytest.fixture(scope="module")
def https_server(models_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """`omni-rt serve` over https (the voice, world and live-video pipelines; keys on)."""
    from tests.conftest import start_server

    tmp = tmp_path_factory.mktemp("https")
    cert, key = self_signed(tmp / "tls", (HOST, "127.0.0.1"))
    import pipelines

    on = {"voice", "world", "video_edit"}
    base: dict[str, Any] = SERVER_OVERLAY
    overlay = {
        **base,
        "server": {**base["server"], "ssl_certfile": str(cert), "ssl_keyfile": str(key)},
        "pipelines": {**{n: {"enabled": n in on} for n in pipelines.load_all()}, "voice": {**base["pipelines"]["voice"]}},
    }
    proc = start_server(overlay, tmp, models_dir, tls_ca=cert)
    proc.origin = f"https://{HOST}:{proc.port}"
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    assert os.path.exists(CHROMIUM), "Chromium is required for the browser tests (apt-get install chromium)"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


def non_blank(png: Path) -> int:
    """How many distinct colours a screenshot has (a blank one has one or two)."""
    from PIL import Image

    with Image.open(png) as img:
        colours = img.convert("RGB").getcolors(maxcolors=1 << 20)
    return len(colours or [])


def open_page(browser, server, path: str, **context):
    ctx = browser.new_context(ignore_https_errors=True, **context)  # the certificate is the test's own
    page = ctx.new_page()
    logs: list[str] = []
    page.on("console", lambda m: logs.append(m.text))
    page.on("pageerror", lambda e: logs.append(f"pageerror: {e}"))
    page.goto(server.origin + path)
    assert page.evaluate("() => [window.isSecureContext, location.protocol, location.hostname]") == [True, "https:", HOST]
    return ctx, page, logs


def shot(page, name: str, selector: str | None = None) -> Path:
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / name
    if selector:
        page.locator(selector).screenshot(path=str(path))
    else:
        page.screenshot(path=str(path), full_page=True)
    return path


def test_root_links_the_pages_and_pages_need_no_key(server):
    import httpx

    with httpx.Client(base_url=server.url, timeout=30) as http:
        index = http.get("/")
        assert index.status_code == 200 and "/v1/realtime/calls" in index.text
        for path in ("/demo", "/demo/world", "/demo/video", "/dashboard"):
            assert f'href="{path}"' in index.text and http.get(path).status_code == 200, path
        demo = http.get("/demo")
        assert "RTCPeerConnection" in demo.text and "oai-events" in demo.text
        assert http.post("/v1/realtime/calls", content="v=0").status_code == 401  # calls still need a key


def test_demo_page_call_from_an_https_origin(https_server, browser, tmp_path):
    wav = tmp_path / "mic.wav"
    pcm = silence(0.5) + speech_pcm16("Hello there, what can you tell me about the sea?") + silence(3.0)
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes(pcm)
    # the fake microphone's file is a launch flag: this test has a browser of its own
    b = browser.browser_type.launch(executable_path=CHROMIUM, args=[*FLAGS, f"--use-file-for-fake-audio-capture={wav}"])
    try:
        ctx, page, logs = open_page(b, https_server, "/demo")
        page.fill("#key", ADMIN_KEY)
        page.click("#start")
        try:
            page.wait_for_function(
                "() => window.omniStats.packetsReceived > 100 && window.omniStats.maxAgentRms > 0.01"
                " && window.omniStats.replyLatencyMs.length > 0",
                timeout=120_000,
                polling=200,
            )
        finally:
            png = shot(page, "demo-call.png")
        stats = page.evaluate("() => window.omniStats")
        assert stats["state"] == "connected", (stats["state"], logs[-10:])
        assert "input_audio_buffer.speech_started" in stats["events"] and "response.created" in stats["events"]
        assert stats["packetsReceived"] > 100 and stats["maxAgentRms"] > 0.01
        assert 0 < stats["replyLatencyMs"][0] < 30_000
        assert "agent:" in page.inner_text("#transcript")
        page.click("#stop")
        page.wait_for_function("() => window.omniStats.state === 'idle'", timeout=10_000)
        assert non_blank(png) > 20
        ctx.close()
    finally:
        b.close()


def test_world_page_key_presses_drive_the_rollout_and_the_dashboard_shows_it(https_server, browser):
    ctx, page, logs = open_page(browser, https_server, "/demo/world")
    page.fill("#key", ADMIN_KEY)
    page.click("#start")
    page.wait_for_function("() => window.omniWorld.stepsDone >= 1 && window.omniWorld.frames >= 1", timeout=120_000, polling=100)
    before = page.evaluate("() => ({frames: window.omniWorld.frames, digests: [...window.omniWorld.digests], steps: window.omniWorld.stepsDone})")
    assert before["steps"] == 1 and not page.evaluate("() => window.omniWorld.errors.length")
    page.locator("#screen").focus()
    page.keyboard.down("d")  # move right: held for a step, then let go
    page.wait_for_function(f"() => window.omniWorld.stepsDone >= {before['steps'] + 1}", timeout=60_000, polling=100)
    page.keyboard.up("d")
    page.keyboard.press("ArrowUp")  # a tap, even while a step runs, reaches the next one
    page.wait_for_function("() => window.omniWorld.actions.some((a) => a[2] === 1) && window.omniWorld.stepsDone === window.omniWorld.actions.length",
                           timeout=60_000, polling=100)
    world = page.evaluate("() => window.omniWorld")
    assert world["actions"][0] == [0, 0, 0, 0] and [0, 1, 0, 0] in world["actions"] and [0, 0, 1, 0] in world["actions"], world["actions"]
    assert world["frames"] > before["frames"] and world["digests"][-1] != before["digests"][-1], "the frame did not change"
    assert world["state"] == "ready" and not world["errors"], (world["errors"], logs[-5:])
    assert page.inner_text("#rate") != "–" and "ms" in page.inner_text("#latency")
    assert non_blank(shot(page, "world-canvas.png", "#screen")) > 20
    assert non_blank(shot(page, "world-page.png")) > 20
    session_id = page.inner_text("#session").split(" ")[0]

    # the dashboard, opened meanwhile, shows that session
    dctx, board, blogs = open_page(browser, https_server, "/dashboard")
    board.fill("#key", ADMIN_KEY)
    board.click("#connect")
    board.wait_for_function(
        f"() => window.omniDashboard.last && window.omniDashboard.last.sessions.data.some((s) => s.id === '{session_id}')",
        timeout=30_000, polling=200)
    board.wait_for_function("() => window.omniDashboard.snapshots >= 3", timeout=30_000, polling=200)
    assert board.evaluate("() => window.omniDashboard.state") == "live", blogs[-5:]
    assert session_id in board.inner_text("#sessions") and "world" in board.inner_text("#sessions")
    assert "world_dit" in board.inner_text("#stages")
    assert "admitted" in board.inner_text("#decisions")
    assert board.locator("#c-sessions canvas").count() >= 1  # the vendored chart library drew
    assert non_blank(shot(board, "dashboard.png")) > 20
    dctx.close()
    page.click("#stop")
    page.wait_for_function("() => window.omniWorld.state === 'closed'", timeout=10_000)
    ctx.close()


def test_dashboard_refuses_a_key_that_is_not_admin(https_server, browser):
    from testkit.harness import ALICE_KEY

    ctx, board, _ = open_page(browser, https_server, "/dashboard")
    board.fill("#key", ALICE_KEY)
    board.click("#connect")
    board.wait_for_function("() => window.omniDashboard.state === 'error'", timeout=10_000)
    assert "admin" in board.evaluate("() => window.omniDashboard.error")
    ctx.close()


def test_video_page_edit_changes_the_stream(https_server, browser):
    ctx, page, logs = open_page(browser, https_server, "/demo/video")
    page.fill("#key", ADMIN_KEY)
    page.fill("#frames", "160")
    page.click("#start")
    page.wait_for_function("() => window.omniVideo.played >= 2", timeout=120_000, polling=100)
    page.click("#apply")
    page.wait_for_function("() => window.omniVideo.editLatencyMs.length >= 1", timeout=120_000, polling=100)
    video = page.evaluate("() => window.omniVideo")
    assert video["applied"] and video["applied"][0]["prompt_version"] == 1, (video["errors"], logs[-5:])
    cut = video["applied"][0]["from_frame"]
    versions = video["versions"]
    assert all(v == 0 for v in versions[:cut]) and all(v == 1 for v in versions[cut:]) and len(versions) > cut
    assert 0 < video["editLatencyMs"][0] < 60_000 and "ms" in page.inner_text("#editlat")
    assert len(set(video["digests"])) > 1 and not video["errors"]
    assert page.locator("#strip img.edited").count() >= 1
    assert non_blank(shot(page, "video-canvas.png", "#screen")) > 20
    assert non_blank(shot(page, "video-page.png")) > 20
    ctx.close()
