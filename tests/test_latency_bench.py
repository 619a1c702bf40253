"""Tests for clients.tts and latency_bench, against a tiny fake speech server
(`testkit/fake_speech_server.py`: in a thread for most tests, a subprocess for the
--compare ones)."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

from clients.tts import SpeechError, speak  # noqa: E402
from latency_bench import stats  # noqa: E402
from latency_bench.tts import TtsOptions, run_closed_loop, run_compare  # noqa: E402
from latency_bench.tts_report import compute_ratios  # noqa: E402
from omni_rt.specs import ChunkingSpec  # noqa: E402
from pipelines.codec import SAMPLES_PER_FRAME  # noqa: E402
from testkit.fake_speech_server import AUDIO_S, CHUNK_SAMPLES, N_CHUNKS, FakeState, ThreadServer, pcm_chunk  # noqa: E402

FAKE_SERVER = ROOT / "testkit" / "fake_speech_server.py"


@pytest.fixture(scope="module")
def fake():
    state = FakeState()
    with ThreadServer(state) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _reset(request):
    if "fake" in request.fixturenames:
        request.getfixturevalue("fake").state.reset()


def _run(coro):
    return asyncio.run(coro)


async def _speak(url: str, text: str = "hello there", **kw):
    async with httpx.AsyncClient(timeout=10, trust_env=False) as c:
        return await speak(c, url, text, **kw)


def test_speak_pcm_measures_ttfp_e2el_and_audio(fake):
    r = _run(_speak(fake.url, seed=7, voice="tara"))
    assert r.status == 200
    assert r.audio_bytes == N_CHUNKS * CHUNK_SAMPLES * 2
    assert r.audio_s == pytest.approx(AUDIO_S)
    assert r.audio == b"".join(pcm_chunk(i) for i in range(N_CHUNKS))
    assert 0 < r.ttfp_s < r.e2el_s
    assert r.rtf == pytest.approx(r.e2el_s / AUDIO_S)
    body = fake.state.bodies[-1]
    assert body == {"model": "tts", "input": "hello there", "voice": "tara", "response_format": "pcm",
                    "speed": 1.0, "stream_format": "audio", "seed": 7}


def test_speak_without_keeping_audio(fake):
    r = _run(_speak(fake.url, keep_audio=False))
    assert r.audio is None and r.audio_s == pytest.approx(AUDIO_S)
    assert "seed" not in fake.state.bodies[-1]


def test_speak_wav_skips_header(fake):
    r = _run(_speak(fake.url, response_format="wav"))
    assert r.audio_bytes == N_CHUNKS * CHUNK_SAMPLES * 2
    assert r.audio_s == pytest.approx(AUDIO_S)
    assert r.audio[:4] != b"RIFF"
    # The header arrives immediately, audio only after first_delay: TTFP counts audio.
    assert r.ttfp_s >= fake.state.first_delay * 0.9
    assert r.ttfp_s < r.e2el_s


def test_speak_sse(fake):
    r = _run(_speak(fake.url, "one two three", stream_format="sse"))
    assert r.audio_s == pytest.approx(AUDIO_S)
    assert r.chunks == N_CHUNKS
    assert r.usage == {"input_tokens": 3}
    assert 0 < r.ttfp_s < r.e2el_s


def test_speak_sse_error_event_and_truncation(fake):
    with pytest.raises(SpeechError) as ei:
        _run(_speak(fake.url, "SSE_ERROR", stream_format="sse"))
    assert ei.value.status == 200 and ei.value.code == "engine_error" and "engine died" in ei.value.message
    with pytest.raises(SpeechError) as ei:
        _run(_speak(fake.url, "SSE_TRUNCATE", stream_format="sse"))
    assert ei.value.code == "incomplete_stream"


def test_speak_error_raises_with_server_message(fake):
    with pytest.raises(SpeechError) as ei:
        _run(_speak(fake.url, "FAIL_ALWAYS"))
    e = ei.value
    assert e.status == 400
    assert e.message == "input rejected by fake server"
    assert (e.type, e.param, e.code) == ("invalid_request_error", "input", "bad_input")


def test_speak_json_on_200_is_not_audio(fake):
    with pytest.raises(SpeechError) as ei:
        _run(_speak(fake.url, "JSON200"))
    assert ei.value.status == 200 and ei.value.message == "not audio" and ei.value.code == "unexpected_json"


def test_speak_accepts_base_url_with_v1(fake):
    r = _run(_speak(fake.url + "/v1/"))
    assert r.status == 200


@pytest.mark.parametrize("c,n", [(1, 3), (3, 7), (8, 16)])
def test_closed_loop_keeps_exactly_c_in_flight(fake, c, n):
    lvl = _run(run_closed_loop(fake.url, c, n, TtsOptions(text="hi", warmup=0, timeout_s=10)))
    assert fake.state.max_current == c  # seen by the server
    assert lvl["max_in_flight"] == c  # seen by the client
    assert len(fake.state.bodies) == n  # nothing issued beyond N
    assert lvl["requests"] == n and lvl["completed"] == n and lvl["ok"] == n and lvl["errors"] == 0
    assert len(lvl["samples"]) == n
    for s in lvl["samples"]:
        assert 0 < s["ttfp_ms"] < s["e2el_ms"]
        assert s["audio_s"] == pytest.approx(AUDIO_S)
        assert s["rtf"] == pytest.approx(s["e2el_ms"] / 1000 / AUDIO_S)
    assert lvl["audio_s_total"] == pytest.approx(n * AUDIO_S)
    assert lvl["audio_s_per_s"] == pytest.approx(n * AUDIO_S / lvl["wall_s"])
    assert lvl["ttfp_ms"]["p50"] <= lvl["ttfp_ms"]["p90"]
    assert lvl["ttfp_ms"]["p50"] == pytest.approx(stats.percentile([s["ttfp_ms"] for s in lvl["samples"]], 50))


def test_errors_are_counted_not_dropped(fake):
    lvl = _run(run_closed_loop(fake.url, 2, 9, TtsOptions(text="FAIL_EVERY_3", warmup=0, timeout_s=10)))
    assert fake.state.failed == 3
    assert lvl["completed"] == 9
    assert lvl["errors"] == 3 and lvl["ok"] == 6
    assert lvl["error_statuses"] == {"400": 3}
    assert lvl["error_messages"] == [{"message": "input rejected by fake server", "count": 3}]
    bad = [s for s in lvl["samples"] if not s["ok"]]
    assert all(s["status"] == 400 and s["error_code"] == "bad_input" for s in bad)
    assert lvl["ttfp_ms"]["n"] == 6  # latency stats only over successful requests


def test_transport_errors_are_counted():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    lvl = _run(run_closed_loop(f"http://127.0.0.1:{port}", 2, 4, TtsOptions(warmup=0, timeout_s=2)))
    assert lvl["errors"] == 4 and lvl["ok"] == 0
    assert lvl["ttfp_ms"]["p50"] is None and lvl["audio_s_per_s"] == 0.0
    assert all(s["status"] is None and "Connect" in s["error"] for s in lvl["samples"])


TOP_KEYS = {"schema", "created", "mode", "machine", "config", "variants", "ratios"}
LEVEL_KEYS = {"concurrency", "requests", "completed", "ok", "errors", "wall_s", "max_in_flight", "ttfp_ms",
              "e2el_ms", "rtf", "audio_s_total", "audio_s_per_s", "samples"}


def test_cli_url_run_writes_json(fake, tmp_path, capsys):
    from latency_bench.__main__ import main

    out = tmp_path / "tts.json"
    rc = main(["tts", "--url", fake.url, "--concurrency", "1,4", "--requests", "6", "--warmup", "1",
               "--json", str(out)])
    assert rc == 0
    assert len(fake.state.bodies) == 1 + 6 + 6
    printed = capsys.readouterr().out
    assert "ttfp" in printed and "C=4" in printed
    res = json.loads(out.read_text())
    assert TOP_KEYS <= set(res)
    assert res["schema"] == "omni-rt.latency_bench.tts/1" and res["mode"] == "url"
    assert {"cpu_count", "python", "platform"} <= set(res["machine"])
    v = res["variants"]["url"]
    assert {"deploy", "server_rss_mib_peak", "levels", "warmup"} <= set(v)
    assert v["warmup"]["requests"] == 1
    assert set(v["levels"]) == {"1", "4"}
    for lvl in v["levels"].values():
        assert LEVEL_KEYS <= set(lvl)
        assert {"p50", "p90", "mean"} <= set(lvl["ttfp_ms"]) and {"p50", "p90"} <= set(lvl["e2el_ms"])
        assert {"mean", "p90"} <= set(lvl["rtf"])
        assert len(lvl["samples"]) == 6
    assert res["ratios"]["ttfp_c_max_over_c1"]["url"] == pytest.approx(
        v["levels"]["4"]["ttfp_ms"]["p50"] / v["levels"]["1"]["ttfp_ms"]["p50"])


def test_default_requests_per_level():
    from latency_bench.tts import default_requests, parse_levels

    assert [default_requests(c) for c in (1, 8, 32)] == [16, 16, 64]
    assert parse_levels("1, 8,32,8") == [1, 8, 32]
    with pytest.raises(ValueError):
        parse_levels("0")


def test_compute_ratios():
    def var(t1, t8, rtf=0.5):
        return {"levels": {"1": {"ttfp_ms": {"p50": t1}, "rtf": {"mean": rtf, "p90": rtf}, "audio_s_per_s": 1.0,
                                 "errors": 0},
                           "8": {"ttfp_ms": {"p50": t8}, "rtf": {"mean": rtf, "p90": rtf}, "audio_s_per_s": 4.0,
                                 "errors": 0}},
                "server_rss_mib_peak": 100.0}

    r = compute_ratios({"split_chunk": var(10, 30), "split_batch": var(40, 80), "fused": var(5, 20)})
    assert r["chunk_over_batch_ttfp"] == {"1": 0.25, "8": 0.375}
    assert r["ttfp_p50_over_split_chunk"]["fused"] == {"1": 0.5, "8": 20 / 30}
    assert r["ttfp_c_max_over_c1"] == {"split_chunk": 3.0, "split_batch": 2.0, "fused": 4.0}
    assert r["rtf_mean"]["fused"] == {"1": 0.5, "8": 0.5}
    # Missing data gives None, never a made-up number.
    r = compute_ratios({"split_chunk": var(None, 30), "split_batch": var(0, 80)})
    assert r["chunk_over_batch_ttfp"]["1"] is None


def test_variant_files():
    d = ROOT / "latency_bench" / "variants"
    assert yaml.safe_load((d / "split_chunk.yaml").read_text()) == {
        "pipelines": {"tts": {"profile": "split", "edges": {"talker->code2wav": {"mode": "chunk"}}}}}
    assert yaml.safe_load((d / "split_batch.yaml").read_text()) == {
        "pipelines": {"tts": {"profile": "split", "edges": {"talker->code2wav": {"mode": "batch"}}}}}
    assert yaml.safe_load((d / "fused.yaml").read_text()) == {"pipelines": {"tts": {"profile": "fused"}}}


def _free_port_base(n: int) -> int:
    from latency_bench.server import port_is_free

    for _ in range(200):
        base = random.randint(20000, 50000)
        if all(port_is_free("127.0.0.1", base + i) for i in range(n)):
            return base
    raise RuntimeError("no free port range")


def _fake_cmd(*extra: str) -> str:
    return " ".join([sys.executable, str(FAKE_SERVER), "--host", "{host}", "--port", "{port}", "--deploy", "{deploy}",
                     *extra])


def _pid_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.integration  # real server processes and their signal timeouts
def test_compare_starts_each_variant_and_reports_ratios(tmp_path):
    child_pid_file = tmp_path / "child.pid"
    out = tmp_path / "cmp.json"
    res = run_compare(
        ["split_chunk", "split_batch", "fused"], [1, 3], TtsOptions(text="hi", warmup=1, timeout_s=10),
        requests=6, json_path=str(out), port=_free_port_base(3), startup_timeout_s=30, stop_timeout_s=5,
        server_cmd=_fake_cmd("--spawn-child", str(child_pid_file)), log=lambda *_: None,
    )
    on_disk = json.loads(out.read_text())
    assert on_disk == json.loads(json.dumps(res))
    assert TOP_KEYS <= set(res) and res["mode"] == "compare"
    assert list(res["variants"]) == ["split_chunk", "split_batch", "fused"]
    for name, v in res["variants"].items():
        assert "error" not in v, v.get("error")
        assert v["deploy"].endswith(f"variants/{name}.yaml")
        assert v["server_rss_mib_peak"] > 5  # a python process tree is at least a few MiB
        assert v["server_rss_peak_procs"] >= 2  # the server and its child were both counted
        assert v["server_returncode"] is not None and v["server_stop_signal"] == "SIGINT"
        assert v["server_alive_before_stop"] is True
        assert f"deploy={v['deploy']}" in Path(v["server_log"]).read_text()
        for c in ("1", "3"):
            assert v["levels"][c]["errors"] == 0 and v["levels"][c]["completed"] == 6
            assert v["levels"][c]["max_in_flight"] == int(c)
    # The last variant's child (and every other) died with its server's process group.
    assert not _pid_alive(int(child_pid_file.read_text()))
    r = res["ratios"]
    assert set(r["chunk_over_batch_ttfp"]) == {"1", "3"}
    assert r["chunk_over_batch_ttfp"]["1"] < 1  # the fake batch variant answers later
    assert set(r["ttfp_c_max_over_c1"]) == {"split_chunk", "split_batch", "fused"}
    assert r["ttfp_p50_over_split_chunk"]["split_chunk"]["1"] == pytest.approx(1.0)
    assert set(r["rtf_mean"]["fused"]) == {"1", "3"}


def test_compare_records_a_variant_that_fails_to_start(tmp_path):
    out = tmp_path / "cmp.json"
    res = run_compare(
        ["fused"], [1], TtsOptions(warmup=0, timeout_s=5), requests=1, json_path=str(out),
        port=_free_port_base(1), startup_timeout_s=10, server_cmd=_fake_cmd("--exit-now"), log=lambda *_: None,
    )
    v = res["variants"]["fused"]
    assert "exited with code 3" in v["error"] and "giving up" in v["error"]
    assert v["levels"] == {}
    assert json.loads(out.read_text())["variants"]["fused"]["error"] == v["error"]


@pytest.mark.integration  # real server processes and their signal timeouts
def test_server_stop_escalates_to_sigterm(tmp_path):
    from latency_bench.server import ServerProcess

    srv = ServerProcess(port=_free_port_base(1), log_path=tmp_path / "s.log", command=_fake_cmd("--ignore-sigint"))
    srv.start()
    try:
        srv.wait_ready(20)
        assert srv.rss_peak_mib > 5
    finally:
        t0 = time.perf_counter()
        srv.stop(int_timeout_s=1, term_timeout_s=5)
    assert srv.stop_signal == "SIGTERM"
    assert time.perf_counter() - t0 < 8
    assert srv.proc.poll() is not None


def test_server_refuses_busy_port(tmp_path):
    from latency_bench.server import ServerError, ServerProcess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        srv = ServerProcess(port=s.getsockname()[1], command=_fake_cmd())
        with pytest.raises(ServerError, match="already in use"):
            srv.start()
        assert srv.proc is None


def test_clients_import_nothing_of_the_server():
    code = ("import sys, clients, clients.tts, clients.realtime, latency_bench.realtime; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'omni_rt','sessions','protocols','pipelines'}); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_stats():
    assert stats.percentile([1, 2, 3, 4], 50) == 2.5
    assert stats.percentile([1, 2, 3, 4, 5], 90) == pytest.approx(4.6)
    assert stats.percentile([], 50) is None and stats.mean([None]) is None
    assert stats.summarize([3.0, None, 1.0])["n"] == 2
    assert stats.ratio(1, 0) is None and stats.ratio(None, 2) is None


# -- connectors -----------------------------------------------------------------------


def test_parse_sizes():
    from latency_bench.connectors import format_size, parse_sizes

    assert parse_sizes("1KiB,64KiB,1MiB,16MiB,64MiB") == [1024, 65536, 1 << 20, 16 << 20, 64 << 20]
    assert parse_sizes("100,1KB") == [100, 1000]
    assert format_size(64 << 20) == "64MiB" and format_size(1000) == "1000B"
    with pytest.raises(ValueError):
        parse_sizes("12 parsecs")


def _check_connectors_result(res: dict, backend: str, sizes: list[int]) -> None:
    assert res["schema"] == "omni-rt.latency_bench.connectors/1"
    assert res["backend"] == backend
    assert {"created", "machine", "config", "sizes"} <= set(res)
    assert [e["bytes"] for e in res["sizes"]] == sizes
    for e in res["sizes"]:
        assert e["memcpy"]["data_ok"] and e["memcpy"]["gbps"] > 0 and len(e["memcpy"]["samples_s"]) == 2
        assert set(e["backends"]) == {backend, "inproc"}
        for b in e["backends"].values():
            assert b["data_ok"] is True
            assert len(b["samples_put_get_s"]) == 2
            assert b["put_get_median_s"] > 0
        ip = e["backends"]["inproc"]
        assert ip["copied"] is False and ip["shares_memory_with_src"] is True
        assert e["ratio_over_memcpy"][backend] == pytest.approx(e["backends"][backend]["gbps"] / e["memcpy"]["gbps"])
        assert e["ratio"] == e["ratio_over_memcpy"][backend]


def test_connectors_bench_inproc(tmp_path):
    out = tmp_path / "conn.json"
    p = subprocess.run(
        [sys.executable, "-m", "latency_bench", "connectors", "--backend", "inproc", "--sizes", "1KiB,64KiB",
         "--repeat", "2", "--warmup", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert "64KiB" in p.stdout
    _check_connectors_result(json.loads(out.read_text()), "inproc", [1024, 65536])


class _CopyingStandIn:
    """Copies into a multiprocessing.shared_memory segment on put, returns a view on get,
    as a copying backend (Ray's object store) does, without starting Ray: the bench must
    drop its views before cleanup (closing a segment a view still holds raises
    BufferError)."""

    name = "ray"

    def __init__(self) -> None:
        self._segs: dict[str, list] = {}

    def put(self, request_id, key, payload, readers=1):
        from multiprocessing import shared_memory

        from omni_rt.payloads import Handle

        arr = payload.arrays["x"]
        seg = shared_memory.SharedMemory(create=True, size=max(1, arr.nbytes))
        import numpy as np

        np.ndarray(arr.shape, arr.dtype, buffer=seg.buf)[...] = arr
        self._segs.setdefault(request_id, []).append(seg)
        return Handle(self.name, request_id, key, payload.kind, payload.fence, payload.nbytes, readers,
                      {"seg": seg.name, "shape": arr.shape, "dtype": arr.dtype.str})

    def get(self, handle):
        import numpy as np

        from omni_rt.payloads import Payload

        seg = next(s for s in self._segs[handle.request_id] if s.name == handle.locator["seg"])
        x = np.ndarray(handle.locator["shape"], np.dtype(handle.locator["dtype"]), buffer=seg.buf)
        return Payload(kind=handle.kind, fence=handle.fence, arrays={"x": x})

    def cleanup(self, request_id):
        segs = self._segs.pop(request_id, [])
        for seg in segs:
            seg.close()  # BufferError if the bench still held a view
            seg.unlink()
        return len(segs)

    def close(self):
        for rid in list(self._segs):
            self.cleanup(rid)


def test_connectors_bench_copying_backend_drops_views_before_cleanup(monkeypatch):
    import latency_bench.connectors as lc

    real = lc.make_connector
    monkeypatch.setattr(lc, "make_connector", lambda b: _CopyingStandIn() if b == "ray" else real(b))
    res = lc.run([1000, 1 << 20], repeat=2, warmup=1, backend="ray", log=lambda *_: None)
    _check_connectors_result(res, "ray", [1000, 1 << 20])
    for e in res["sizes"]:
        b = e["backends"]["ray"]
        assert b["get_is_view"] is True and b["copied"] is True and b["cleanup_freed"] == 1


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_sessions_bench(tmp_path, store):
    out = tmp_path / "sessions.json"
    p = subprocess.run(
        [sys.executable, "-m", "latency_bench", "sessions", "--store", store, "-n", "300", "-c", "1,8", "--warmup", "10", "--json", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    assert r["schema"] == "omni-rt.latency_bench.sessions/1" and r["store"] == store
    assert [lvl["concurrency"] for lvl in r["levels"]] == [1, 8]
    for lvl in r["levels"]:
        assert lvl["cycles"] == 300 and lvl["refused"] == 0 and lvl["slots_left"] == 0
        a = lvl["admission_ms"]
        assert 0 < a["p50"] <= a["p90"] <= a["p99"] <= a["max"]
        assert lvl["cycles_per_s"] > 0
    assert r["targets"]["no_refusals_no_leftover_slots"]["met"] is True
    assert ("p99_admission_ms" in r["targets"]) == (store == "redis")
    assert "target cycles_per_s" in p.stdout


# ---- the TTS engines driven directly (latency_bench.tts_engines) -------------------------


class _FakeTalker:
    """Frames in three pushes, then (for the text "fail") an error."""

    def __init__(self) -> None:
        self.contexts: list = []

    async def frames(self, ctx, ar, text):
        self.contexts.append(ctx)
        for k in (1, 4, 3):
            await asyncio.sleep(0.001)
            yield np.zeros((k, 7), np.int32)
        if text == "fail":
            raise RuntimeError("talker died")


async def _fake_decode(frames, deadline=None):
    await asyncio.sleep(0.001)
    return np.zeros(len(frames) * SAMPLES_PER_FRAME, np.float32)


def test_engines_driver_measures_what_the_server_bench_measures():
    from latency_bench.tts import closed_loop
    from latency_bench.tts_engines import SAMPLE_RATE, one_request

    talker = _FakeTalker()
    chunking = ChunkingSpec(first_chunk_frames=1, chunk_frames=2, left_context_frames=0, lookahead_frames=0, refill_ms=0)
    one = one_request(talker, None, _fake_decode, chunking, TtsOptions(text="hello", voice="leo", seed=3))
    lvl = _run(closed_loop(2, 3, one))
    assert lvl["completed"] == lvl["ok"] == 3 and lvl["errors"] == 0 and lvl["max_in_flight"] == 2
    for s in lvl["samples"]:
        assert s["audio_s"] == pytest.approx(8 * SAMPLES_PER_FRAME / SAMPLE_RATE)  # every frame decoded once
        assert s["chunks"] == 5  # 1 + 2 + 2 + 2, then the last frame at the end
        assert 0 < s["ttfp_ms"] < s["e2el_ms"] and s["rtf"] == pytest.approx(s["e2el_ms"] / 1000 / s["audio_s"])
    assert {c.params["voice"] for c in talker.contexts} == {"leo"} and {c.params["seed"] for c in talker.contexts} == {3}
    assert len({c.request_id for c in talker.contexts}) == 3
    assert lvl["audio_s_per_s"] == pytest.approx(3 * 8 * SAMPLES_PER_FRAME / SAMPLE_RATE / lvl["wall_s"])
    # a request that fails is recorded as an error, not dropped; batch (no chunking) decodes once at the end
    bad = _run(closed_loop(1, 1, one_request(_FakeTalker(), None, _fake_decode, None, TtsOptions(text="fail"))))
    assert bad["errors"] == 1 and "talker died" in bad["samples"][0]["error"]
    whole = _run(closed_loop(1, 1, one_request(_FakeTalker(), None, _fake_decode, None, TtsOptions(text="ok"))))
    assert whole["samples"][0]["chunks"] == 1 and whole["samples"][0]["audio_s"] == pytest.approx(8 * SAMPLES_PER_FRAME / SAMPLE_RATE)


def test_engine_ratios_and_targets_at_the_top_level():
    from latency_bench.tts_report import engine_ratios, tts_targets

    def level(aps, p50, p99):
        return {"audio_s_per_s": aps, "ttfp_ms": {"p50": p50, "p99": p99}, "rtf": {"mean": 1.0, "p90": 1.0}, "errors": 0}

    result: dict[str, Any] = {
        "variants": {"split_chunk": {"levels": {"1": level(2.0, 100.0, 120.0), "64": level(9.0, 1000.0, 3500.0)}}},
        "engines": {"variant": "split_chunk", "levels": {"1": level(2.0, 90.0, 100.0), "64": level(10.0, 900.0, 1000.0)}},
    }
    result["ratios"] = compute_ratios(result["variants"])
    assert result["ratios"]["ttfp_p99_over_p50"]["split_chunk"] == {"1": pytest.approx(1.2), "64": pytest.approx(3.5)}
    result["ratios"].update(engine_ratios(result))
    assert result["ratios"]["audio_s_per_s_over_engines"] == {"1": pytest.approx(1.0), "64": pytest.approx(0.9)}
    t = tts_targets(result)
    assert t["ttfp_p99_over_p50_at_64"]["met"] is False and t["audio_s_per_s_over_engines_at_64"]["met"] is True
    result["engines"] = {"variant": "split_chunk", "error": "RuntimeError: boom"}
    assert engine_ratios(result) == {}


@pytest.mark.integration  # the tts variant's real engines (vLLM talker, SNAC) in this process
def test_engines_driver_runs_a_variants_real_talker_and_decoder():
    from latency_bench.tts import VARIANTS_DIR
    from latency_bench.tts_engines import engine_levels

    res = _run(engine_levels(VARIANTS_DIR / "split_chunk.yaml", [2], TtsOptions(text="Hi there.", warmup=0, seed=1), requests=2,
                             log=lambda *_: None))
    lvl = res["levels"]["2"]
    assert lvl["ok"] == 2 and lvl["errors"] == 0, lvl["error_messages"]
    assert all(s["audio_s"] > 0 and s["chunks"] > 1 and s["ttfp_ms"] < s["e2el_ms"] for s in lvl["samples"])


def test_histograms_are_read_from_metrics_text_with_prometheus_clients_parser():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from latency_bench.machine import bucket_bound, histogram

    reg = CollectorRegistry()
    h = Histogram("omni_rt_test_step_seconds", "a step", ["engine"], buckets=(0.01, 0.05, 0.1), registry=reg)
    for v in (0.005, 0.02, 0.03, 0.07):
        h.labels(engine="dit").observe(v)
    h.labels(engine="other").observe(5.0)
    text = generate_latest(reg).decode()
    dit = histogram(text, "omni_rt_test_step_seconds", engine="dit")
    assert dit == {0.01: 1.0, 0.05: 3.0, 0.1: 4.0, float("inf"): 4.0, "_count": 4.0, "_sum": pytest.approx(0.125)}
    assert histogram(text, "omni_rt_test_step_seconds")["_count"] == 5.0  # every series, summed
    assert bucket_bound(dit, 0.5) == 0.05 and bucket_bound(dit, 0.99) == 0.1 and bucket_bound({}, 0.5) is None
