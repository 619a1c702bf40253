"""Pipeline specs and deploy overlays: validation, clear errors, CLI behaviour."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest

import pipelines
from omni_rt.specs import DeployOverlay, SpecError, apply_overlay, load_overlay, parse_overlay, parse_pipeline
from tests.conftest import REPO

TTS = pipelines.load_builtin("tts")


def overlay_error(tmp_path, text: str) -> str:
    f = tmp_path / "deploy.yaml"
    f.write_text(text)
    with pytest.raises(SpecError) as exc:
        apply_overlay(TTS, load_overlay(f), str(f))
    return str(exc.value)


@pytest.mark.parametrize(
    "text,key",
    [
        ("server:\n  prot: 1\n", "server.prot: unknown key"),
        ("server:\n  port: 99999\n", "server.port"),
        ("pipelines:\n  tts:\n    edges:\n      talker->code2wav: {mode: stream}\n", "pipelines.tts.edges.talker->code2wav.mode"),
        ("pipelines:\n  tts:\n    edges:\n      talker->code2wav: {chunking: {chunk_frames: 0}}\n", "chunking.chunk_frames"),
        ("pipelines:\n  tts:\n    edges:\n      talker->nowhere: {mode: batch}\n", "pipelines.tts.edges.talker->nowhere: no such edge"),
        ("pipelines:\n  tts:\n    stages:\n      thinker: {replicas: 2}\n", "pipelines.tts.stages.thinker: no such stage"),
        ("pipelines:\n  tts:\n    stages:\n      talker: {replicas: 0}\n", "pipelines.tts.stages.talker.replicas"),
        ("pipelines:\n  tts:\n    profile: turbo\n", "pipelines.tts.profile: unknown profile 'turbo'"),
        ("pipelines:\n  tts:\n    edges:\n      talker->code2wav: {connector: redis9}\n", "connector 'redis9' is not declared"),
        ("connectors:\n  fast: {backend: rdma}\n", "connectors.fast.backend"),
    ],
)
def test_overlay_errors_name_file_and_key(tmp_path, text, key):
    msg = overlay_error(tmp_path, text)
    assert str(tmp_path / "deploy.yaml") in msg
    assert key in msg


def test_overlay_applies_modes_chunking_replicas_and_args():
    ov = parse_overlay(
        {
            "pipelines": {
                "tts": {
                    "edges": {"talker->code2wav": {"mode": "batch", "connector": "ray", "chunking": {"chunk_frames": 4}}},
                    "stages": {"code2wav": {"replicas": 3, "engine_args": {"max_batch": 8}}},
                }
            }
        },
        "x",
    )
    p = apply_overlay(TTS, ov)
    e = p.edges[0]
    assert (e.mode, e.connector, e.chunking.chunk_frames) == ("batch", "ray", 4)
    assert e.chunking.first_chunk_frames == TTS.profiles["split"].edges[0].chunking.first_chunk_frames  # untouched keys stay
    c2w = p.stage("code2wav")
    assert c2w.replicas == 3 and c2w.engine_args["max_batch"] == 8 and c2w.engine_args["max_wait_ms"] == 1.0
    fused = apply_overlay(TTS, parse_overlay({"pipelines": {"tts": {"profile": "fused"}}}, "x"))
    assert [s.name for s in fused.stages] == ["talker_fused"] and "decoder" in fused.stage("talker_fused").aux


def test_pipeline_graph_errors():
    base = TTS.model_dump(mode="json")
    prof = base["profiles"]["split"]
    cyc = dict(base, profiles={"split": dict(prof, edges=prof["edges"] + [{"src": "code2wav", "dst": "talker", "payload": "codes"}])})
    with pytest.raises(SpecError, match="entry stage|cycle"):
        parse_pipeline(cyc, "p.yaml")
    bad_final = dict(base, profiles={"split": dict(prof, final_outputs=["nope"])})
    with pytest.raises(SpecError, match="final output 'nope'"):
        parse_pipeline(bad_final, "p.yaml")
    bad_default = dict(base, default_profile="zzz")
    with pytest.raises(SpecError, match="default_profile"):
        parse_pipeline(bad_default, "p.yaml")


def test_defaults_are_valid():
    ov = DeployOverlay()
    assert ov.server.port == 8000 and ov.server.host == "127.0.0.1"
    # ray is declared but only used by edges into or out of a remote placement
    assert set(ov.connectors) == {"inproc", "ray"}


def _cli(*args: str) -> subprocess.CompletedProcess:
    """`omni-rt ARGS`: `check` runs in this process (an exception out of it, which the
    command would print as a traceback, fails the test), `serve` in a process of its own."""
    if args[0] != "check":
        return subprocess.run([sys.executable, "-m", "omni_server.cli", *args], capture_output=True, text=True, cwd=REPO, timeout=120)
    from omni_server.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return subprocess.CompletedProcess(["omni-rt", *args], rc, out.getvalue(), err.getvalue())


def test_cli_broken_overlay_exits_with_message_no_traceback(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("pipelines:\n  tts:\n    edges:\n      talker->code2wav: {mode: stream}\n")
    for cmd in (["check", "--deploy", str(f)], ["serve", "--deploy", str(f), "--port", "0"]):
        r = _cli(*cmd)
        assert r.returncode == 2
        assert "Traceback" not in r.stderr
        assert str(f) in r.stderr and "pipelines.tts.edges.talker->code2wav.mode" in r.stderr
    f.write_text("a: [\n")
    r = _cli("check", "--deploy", str(f))
    assert r.returncode == 2 and "not valid YAML" in r.stderr and "Traceback" not in r.stderr
    r = _cli("check", "--deploy", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "cannot read" in r.stderr


def test_cli_serve_on_a_taken_port_fails_at_once():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = _cli("serve", "--port", str(taken.getsockname()[1]))
    assert r.returncode == 2 and "cannot listen on 127.0.0.1:" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.integration
def test_cli_missing_model_dir_names_key(tmp_path, models_dir):
    f = tmp_path / "d.yaml"
    f.write_text(f"server: {{models_dir: {models_dir}}}\npipelines:\n  tts:\n    stages:\n      talker: {{model: /nonexistent/orpheus}}\n")
    r = _cli("check", "--deploy", str(f))
    assert r.returncode == 2 and "pipelines.tts.stages.talker.model" in r.stderr and "Traceback" not in r.stderr


def test_fused_aux_overlay():
    ov = parse_overlay(
        {"pipelines": {"tts": {"profile": "fused", "stages": {"talker_fused": {"aux": {"decoder": {"engine_args": {"max_batch": 2}}}}}}}},
        "x",
    )
    aux = apply_overlay(TTS, ov).stage("talker_fused").aux["decoder"]
    assert aux.engine_args["max_batch"] == 2 and aux.engine_args["max_wait_ms"] == 1.0 and aux.model == "tiny:code2wav"
    with pytest.raises(SpecError, match="aux.decoder.colour: unknown key"):
        parse_overlay({"pipelines": {"tts": {"stages": {"talker_fused": {"aux": {"decoder": {"colour": 1}}}}}}}, "x")
    bad = parse_overlay({"pipelines": {"tts": {"profile": "fused", "stages": {"talker_fused": {"aux": {"vocoder": {}}}}}}}, "x")
    with pytest.raises(SpecError, match="no such aux engine"):
        apply_overlay(TTS, bad)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--idle-ttl", "-1"], "command line: sessions.idle_ttl_s: Input should be greater than 0"),
        (["--disconnect-grace", "-5"], "sessions.disconnect_grace_s: Input should be greater than or equal to 0"),
        (["--max-sessions", "0"], "sessions.max_total: Input should be greater than or equal to 1"),
        (["--max-sessions-per-kind", "oneshot=0"], "max_per_kind.oneshot: cap must be at least 1, got 0"),
        (["--max-sessions-per-kind", "chat=3"], "max_per_kind.chat: unknown session kind"),
        (["--max-sessions-per-kind", "oneshot"], "--max-sessions-per-kind: expected KIND=N, got 'oneshot'"),
        (["--api-key", "short"], "server.api_key: String should have at least 8 characters"),
        (
            ["--session-store", "redis", "--redis-url", "redis://127.0.0.1:1/0"],
            "sessions.redis_url: the session store Redis at redis://127.0.0.1:1/0 is unreachable",
        ),
        (["--session-store", "redis", "--reaper-interval", "10"], "slot_lease_ttl_s (15.0) must be at least 3 x reaper_interval_s"),
    ],
)
def test_cli_bad_session_settings_exit_2_naming_the_key(args, message):
    p = _cli("check", *args)
    assert p.returncode == 2, p.stdout + p.stderr
    assert message in p.stderr and "Traceback" not in p.stderr


def test_overlay_sessions_block_and_keys_file(tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("- {key: abcdefgh-1, principal: alice}\n- {key: abcdefgh-2, principal: ops, admin: true}\n")
    deploy = tmp_path / "d.yaml"
    deploy.write_text("sessions:\n  max_total: 9\n  principal_caps: {alice: 2}\n  idle_ttl_s: 5\n")
    from omni_server.cli import _overlay, parser

    args = parser().parse_args(["serve", "--deploy", str(deploy), "--api-keys-file", str(keys), "--max-sessions-per-kind", "realtime=3"])
    overlay, _ = _overlay(args)
    assert overlay.sessions.max_total == 9 and overlay.sessions.idle_ttl_s == 5
    assert overlay.sessions.max_per_kind == {"realtime": 3} and overlay.sessions.principal_caps == {"alice": 2}
    assert [(k.principal, k.admin) for k in overlay.server.api_keys] == [("alice", False), ("ops", True)]
    bad = tmp_path / "bad.yaml"
    bad.write_text("sessions:\n  max_per_kind: {world: -1}\n")
    p = _cli("check", "--deploy", str(bad))
    assert p.returncode == 2 and f"{bad}: sessions: max_per_kind.world: cap must be at least 1, got -1" in p.stderr


def test_shared_stage_override_applies_to_every_pipeline_with_it(tmp_path):
    from omni_server.app import resolve_profiles

    ov = parse_overlay({"pipelines": {"tts": {"stages": {"talker": {"replicas": 2}}}}}, "d.yaml")
    profiles, _ = resolve_profiles(ov, "d.yaml")
    assert profiles["tts"].stage("talker").replicas == 2 and profiles["voice"].stage("talker").replicas == 2
    assert profiles["voice"].stage("thinker").replicas == 1
    clash = parse_overlay(
        {"pipelines": {"tts": {"stages": {"talker": {"replicas": 2}}}, "voice": {"stages": {"talker": {"replicas": 3}}}}}, "d.yaml"
    )
    with pytest.raises(SpecError, match="pipelines.voice.stages.talker: stage 'talker' is shared with pipeline tts"):
        resolve_profiles(clash, "d.yaml")
