"""The demo page in a real browser: headless Chromium (Debian `chromium`, driven by
playwright) with a fake microphone playing espeak-ng speech calls the shared server
over WebRTC on loopback; the page must receive RTP audio and measure a non-silent
reply. A screenshot is saved (OMNI_RT_ARTIFACTS, default .cache/artifacts)."""

from __future__ import annotations

import os
import shutil
import wave
from pathlib import Path

import pytest

from tests.harness import ADMIN_KEY, silence, speech_pcm16

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
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
]


def test_root_links_the_demo_and_pages_need_no_key(server):
    import httpx

    with httpx.Client(base_url=server.url, timeout=30) as http:
        index = http.get("/")
        assert index.status_code == 200 and 'href="/demo"' in index.text and "/v1/realtime/calls" in index.text
        demo = http.get("/demo")
        assert demo.status_code == 200 and "RTCPeerConnection" in demo.text and "oai-events" in demo.text
        assert http.post("/v1/realtime/calls", content="v=0").status_code == 401  # calls still need a key


def test_demo_page_call_in_headless_chromium(server, tmp_path):
    from playwright.sync_api import sync_playwright

    assert os.path.exists(CHROMIUM), "Chromium is required for the browser test (apt-get install chromium)"
    wav = tmp_path / "mic.wav"
    pcm = silence(0.5) + speech_pcm16("Hello there, what can you tell me about the sea?") + silence(3.0)
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes(pcm)
    shots = Path(os.environ.get("OMNI_RT_ARTIFACTS", REPO / ".cache" / "artifacts"))
    shots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[*FLAGS, f"--use-file-for-fake-audio-capture={wav}"])
        try:
            page = browser.new_page()
            logs: list[str] = []
            page.on("console", lambda m: logs.append(m.text))
            page.goto(server.url + "/demo")
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
                page.screenshot(path=str(shots / "demo-call.png"), full_page=True)
            stats = page.evaluate("() => window.omniStats")
            assert stats["state"] == "connected", (stats["state"], logs[-10:])
            assert "input_audio_buffer.speech_started" in stats["events"] and "response.created" in stats["events"]
            assert stats["packetsReceived"] > 100 and stats["maxAgentRms"] > 0.01
            assert 0 < stats["replyLatencyMs"][0] < 30_000
            assert "agent:" in page.inner_text("#transcript")
            page.click("#stop")
            page.wait_for_function("() => window.omniStats.state === 'idle'", timeout=10_000)
        finally:
            browser.close()
    assert (shots / "demo-call.png").stat().st_size > 1000
