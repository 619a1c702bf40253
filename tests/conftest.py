"""Shared fixtures. One models dir (tiny checkpoints) for the whole run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from testkit.harness import free_port

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def models_dir() -> Path:
    """Tiny checkpoints, built once per machine under .cache/models (or $OMNI_RT_MODELS_DIR)."""
    path = Path(os.environ.get("OMNI_RT_MODELS_DIR", REPO / ".cache" / "models"))
    from pipelines.tiny import build_tiny

    build_tiny(path)
    return path


def start_server(overlay: dict, tmp: Path, models_dir: Path, tls_ca: Path | None = None):
    """A real `omni-rt serve` with `overlay` (tiny checkpoints), ready; the caller stops it."""
    import yaml

    from latency_bench.server import ServerProcess

    log = tmp / "server.log"
    # The test process and its clients (espeak-ng, Chromium, decoders) share the cores
    # with the server by design: admission does not count them as a noisy neighbour
    # unless the test says so. Nor does it calibrate (some 15 s of start-up a server)
    # unless the test says so (tests/test_duplex_pacing.py does).
    sessions = dict(overlay.get("sessions") or {})
    sessions["realtime_admission"] = {"weigh_outside_load": False, "calibrate": False, **(sessions.get("realtime_admission") or {})}
    overlay = {**overlay, "sessions": sessions}
    deploy = tmp / "deploy.yaml"
    deploy.write_text(yaml.safe_dump(overlay))
    env = dict(os.environ, OMNI_RT_MODELS_DIR=str(models_dir))
    for attempt in range(3):
        # the port is free when picked but another process may take it before the
        # server binds; the server then exits at once and another port is tried
        log.unlink(missing_ok=True)
        proc = ServerProcess(port=free_port(), deploy=deploy, log_path=log, cwd=REPO, env=env, tls_ca=tls_ca)
        proc.start()
        try:
            proc.wait_ready(timeout_s=300)
            break
        except Exception:
            proc.stop()
            tail = log.read_text()[-4000:]
            if "cannot listen on" in tail and attempt < 2:
                continue
            print(tail)
            raise
    proc.log_file = log  # type: ignore[attr-defined]
    return proc


@pytest.fixture(scope="session")
def server(models_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One real omni-rt server (tiny checkpoints, vLLM talker) shared by all integration tests;
    API keys on (testkit.harness.SERVER_OVERLAY)."""
    from testkit.harness import SERVER_OVERLAY

    proc = start_server(SERVER_OVERLAY, tmp_path_factory.mktemp("server"), models_dir)
    yield proc
    proc.stop()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tiers are enforced: a test that starts the real server is an integration
    test; the in-process protocol tests never start it."""
    wrong = []
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        integration = item.get_closest_marker("integration") is not None
        if "server" in fixtures and not integration:
            wrong.append(f"{item.nodeid}: uses the real server but is not marked integration")
        if "models_dir" in fixtures and not integration:
            wrong.append(f"{item.nodeid}: loads the tiny checkpoints into real engines but is not marked integration")
        if "tests/protocols/" in item.nodeid.replace("\\", "/") and ("server" in fixtures or integration):
            wrong.append(f"{item.nodeid}: the in-process tier must not use the real server")
    if wrong:
        raise pytest.UsageError("test markers:\n" + "\n".join(wrong))
